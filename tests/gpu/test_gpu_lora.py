"""Merged LoRAs with real CUDA graphs (run on the H200: `pytest -m gpu tests/gpu/test_gpu_lora.py`).

A merge writes into the weights' storage, so a captured decode step and prefix pass read the merged values on their
next replay: after a merge, and after switching LoRA sets between prompts, nothing is captured again and every
graph run equals an eager run of the same weights. The tiny model runs in fp32, so the bound is graph mechanics
(the eager fallback concatenates the prefix instead of reading the static buffer, which may pick another SDPA
kernel: fp32 round-off, GRAPH_ATOL = 1e-5 as in test_gpu_decode.py), not bf16 rounding.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from lora_layouts import reference_weights, write_layout  # noqa: E402
from test_gpu_decode import GRAPH_ATOL, _fresh_transformer, cuda_generator  # noqa: E402,F401

from graph_runtime.decode import DecodeEngine  # noqa: E402
from graph_runtime.lora import LoraChoice, read_lora  # noqa: E402
from tests.owners import loaded_for  # noqa: E402
from graph_runtime.sampling.sampler import SamplingRequest, sample  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture()
def setup(cuda_models, cuda_generator, tmp_path):
    transformer = _fresh_transformer(cuda_models).requires_grad_(False)
    files = {}
    for name, layout, seed in (("a", "kohya", 1), ("b", "comfy_fused_mlp", 2)):
        path = tmp_path / f"{name}.safetensors"
        files[name] = (write_layout(path, layout, transformer, seed=seed), read_lora(path, transformer))
    sets = {"none": [], "A": [LoraChoice(files["a"][1], 1.0)],
            "B": [LoraChoice(files["b"][1], 0.8), LoraChoice(files["a"][1], -0.4)]}
    positive = cuda_generator.encoder.encode("a red cube")
    return transformer, files, sets, positive


def _request(positive, mode, seed=3):
    return SamplingRequest(positive=positive, latent_height=8, latent_width=8, steps=5, seed=seed, decode_mode=mode)


def test_merged_weights_are_the_reference_math_and_keep_their_addresses(setup):
    """The merge on the GPU equals the reference merge computed on the CPU (fp32: the GPU's GEMM sums the rank
    products in another order, ~1e-7 relative), in the same storage; the originals are kept pinned."""
    transformer, files, sets, _ = setup
    expected = files["a"][0]
    reference = reference_weights(copy.deepcopy(transformer).cpu(), [(1.0, expected)])
    addresses = {name: p.data_ptr() for name, p in transformer.named_parameters()}
    state = loaded_for(transformer).lora_state()
    state.apply(sets["A"])
    for name, want in reference.items():
        torch.testing.assert_close(transformer.get_parameter(name).cpu(), want, rtol=1e-6, atol=1e-6)
    assert {name: p.data_ptr() for name, p in transformer.named_parameters()} == addresses
    assert all(slot.original.is_pinned() for slot in state._slots.values())


def test_after_a_merge_the_graph_output_equals_eager_and_the_next_prompt_captures_nothing(setup):
    transformer, _, sets, positive = setup
    engine = DecodeEngine(transformer)
    with loaded_for(transformer).loras_in_use(sets["A"]):
        graph = sample(engine, _request(positive, "graph"))
        eager = sample(engine, _request(positive, "eager"))
        again = sample(engine, _request(positive, "graph", seed=4))
    assert graph.stats["captures"] == 1 and graph.stats["eager_steps"] == {}
    diff = (graph.latents - eager.latents).abs().max().item()
    print(f"merged LoRA: graph vs eager latents max abs diff {diff:.3e}")
    assert diff <= GRAPH_ATOL
    assert (again.stats["captures"], again.stats["prefill_captures"]) == (0, 0)
    assert again.stats["replays"] == 5 and again.stats["eager_steps"] == {}


def test_switching_lora_sets_between_prompts_captures_nothing_and_matches_eager(setup):
    """Prompts alternate between LoRA sets on one loaded model: after the first prompt's captures, no prompt
    captures again, every graph output equals an eager run of the weights merged at that moment, the sets give
    different images, and back to no LoRA replays the first image bit for bit."""
    transformer, _, sets, positive = setup
    engine = DecodeEngine(transformer)
    outputs = {}
    for i, name in enumerate(["none", "A", "B", "A", "none"]):
        with loaded_for(transformer).loras_in_use(sets[name]):
            graph = sample(engine, _request(positive, "graph"))
            eager = sample(engine, _request(positive, "eager"))
        expected_captures = (1, 1) if i == 0 else (0, 0)
        assert (graph.stats["captures"], graph.stats["prefill_captures"]) == expected_captures, (name, graph.stats)
        assert graph.stats["eager_steps"] == {} and graph.stats["eager_prefills"] == {}, (name, graph.stats)
        diff = (graph.latents - eager.latents).abs().max().item()
        print(f"set {name}: graph vs eager latents max abs diff {diff:.3e}")
        assert diff <= GRAPH_ATOL
        if name in outputs:
            assert torch.equal(graph.latents, outputs[name]), name
        outputs[name] = graph.latents
    assert (outputs["A"] - outputs["B"]).abs().max() > 1e3 * GRAPH_ATOL
    assert (outputs["A"] - outputs["none"]).abs().max() > 1e3 * GRAPH_ATOL
    assert engine.graphs.stats.captures == 1
