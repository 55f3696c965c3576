"""The step cache on a CUDA GPU: computed steps replay the captured decode graph, skipped steps run nothing, and a
second prompt captures nothing.

Run on the H200 (or any CUDA GPU):

    python -m pytest -m gpu tests/gpu/test_gpu_step_cache.py

The tiny model runs in fp32, so a replayed step against an eager one differs by fp32 round-off (1e-5 on values ~1-5,
tests/gpu/test_gpu_decode.py); over 12 steps of which the same ones are skipped, 1e-4 on the latents.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
STEPS = 12


def request(cuda_models, embeds, cache, mode="auto"):
    from graph_runtime.sampling.sampler import SamplingRequest

    return SamplingRequest(positive=embeds, latent_height=16, latent_width=16, steps=STEPS, seed=4,
                           scheduler_config=cuda_models.scheduler_config, step_cache=cache, decode_mode=mode)


def test_skipped_steps_replay_nothing_and_a_second_prompt_captures_nothing(cuda_models):
    from graph_runtime.decode import DecodeEngine
    from graph_runtime.encoding.prompt import PromptEncoder
    from graph_runtime.sampling.sampler import sample
    from graph_runtime.sampling.step_cache import StepCacheSettings

    transformer = cuda_models.transformer.float()
    engine = DecodeEngine(transformer)
    embeds = PromptEncoder(cuda_models.text_encoder.float(), cuda_models.processor).encode("a red cube")
    cache = StepCacheSettings(reuse_threshold=1.0)
    first = sample(engine, request(cuda_models, embeds, cache))
    skipped = first.stats["skipped_steps"]
    assert 0 < skipped < STEPS and first.stats["eager_steps"] == {}
    assert first.stats["captures"] == 1 and first.stats["replays"] == STEPS - skipped
    second = sample(engine, request(cuda_models, embeds, cache))
    assert second.stats["captures"] == 0 and second.stats["replays"] == STEPS - skipped
    assert torch.equal(second.latents, first.latents)
    eager = sample(engine, request(cuda_models, embeds, cache, mode="eager"))
    assert eager.stats["skipped_steps"] == skipped
    assert (eager.latents - first.latents).abs().max().item() <= 1e-4
    assert not any(engine.graphs.owners.alive(k) for k in engine.graphs.entries)
