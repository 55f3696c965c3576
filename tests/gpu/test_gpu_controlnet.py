"""The Fun ControlNet's controlled steps on a real GPU (`pytest -m gpu tests/gpu/test_gpu_controlnet.py`): they replay
captured CUDA graphs and equal the same steps run eagerly; a second prompt with another control image and strength
replays the same graph (0 captures). fp32 tiny model: 1e-5, the graph-vs-eager tolerance tests/gpu/test_gpu_decode.py
states (the eager step concatenates the prefix instead of reading the static buffer, which may change SDPA's kernel:
fp32 round-off on values ~1-5)."""

import pytest
import torch

from graph_runtime.controlnet import ControlSpec
from graph_runtime.controlnet.tiny import random_tiny_controlnet
from graph_runtime.decode import DecodeEngine
from graph_runtime.sampling.sampler import SamplingRequest, sample
from tests.owners import generator_for

pytestmark = pytest.mark.gpu
GRAPH_ATOL = 1e-5


def _encode(pixels):
    # A fixed stand-in for the VAE: 16x16 pixel blocks averaged, spread over the 64 latent channels.
    mean = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1).float().cpu(), 16)
    return torch.einsum("bchw,oc->bohw", mean, torch.randn(64, 3, generator=torch.Generator().manual_seed(2)))


def _spec(net, seed, strength, sigma_start=1.0, sigma_end=0.0):
    image = torch.rand(1, 128, 128, 3, generator=torch.Generator().manual_seed(seed))
    return ControlSpec(net, _encode, strength, sigma_start=sigma_start, sigma_end=sigma_end, image=image)


def _sample(engine, embeds, spec, mode, seed=1):
    request = SamplingRequest(positive=embeds, latent_height=8, latent_width=8, steps=6, seed=seed, control=spec,
                              decode_mode=mode)
    return sample(engine, request)


def test_controlled_steps_replay_and_equal_eager(cuda_models):
    generator = generator_for(cuda_models)
    engine = DecodeEngine(cuda_models.transformer)
    net = random_tiny_controlnet(seed=5, scale=2.0)
    embeds = generator.encoder.encode("a red cube")
    eager = _sample(engine, embeds, _spec(net, 3, 0.8), "eager")
    graph = _sample(engine, embeds, _spec(net, 3, 0.8), "graph")
    assert graph.paths == ["capture"] + ["replay"] * 5
    diff = (graph.latents - eager.latents).abs().max().item()
    print(f"controlled graph vs eager latents after 6 steps: max abs diff {diff:.3e}")
    assert diff <= GRAPH_ATOL
    plain = _sample(engine, embeds, None, "graph")
    assert (plain.latents - graph.latents).abs().max().item() > 1e-2  # the control is there

    captures = engine.stats.captures
    other = _sample(engine, embeds, _spec(net, 4, 0.5), "graph", seed=2)  # another image and strength
    assert other.paths == ["replay"] * 6 and engine.stats.captures == captures
    other_eager = _sample(engine, embeds, _spec(net, 4, 0.5), "eager", seed=2)
    assert (other.latents - other_eager.latents).abs().max().item() <= GRAPH_ATOL


def test_a_start_end_range_replays_both_graphs(cuda_models):
    """Steps inside the range replay the controlled graph, the others the plain one; nothing is captured again on
    the second prompt."""
    generator = generator_for(cuda_models)
    engine = DecodeEngine(cuda_models.transformer)
    net = random_tiny_controlnet(seed=5, scale=2.0)
    embeds = generator.encoder.encode("a red cube")
    spec = _spec(net, 3, 0.8, sigma_start=0.9, sigma_end=0.4)
    first = _sample(engine, embeds, spec, "graph")
    assert first.paths.count("capture") == 2 and set(first.paths) == {"capture", "replay"}
    second = _sample(engine, embeds, spec, "graph")
    assert second.paths == ["replay"] * 6
    eager = _sample(engine, embeds, spec, "eager")
    assert (second.latents - eager.latents).abs().max().item() <= GRAPH_ATOL
