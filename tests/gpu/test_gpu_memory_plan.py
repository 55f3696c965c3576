"""Memory plans on a real GPU (run on the H100/H200: `pytest -m gpu tests/gpu/test_gpu_memory_plan.py -s`): a request
too big for a whole load on an emulated card runs under its streamed plan within the plan's GPU bytes, and a bigger
card afterwards loads the model whole again and replays graphs.

Cards are emulated with `torch.cuda.set_per_process_memory_fraction` (tests/gpu/test_gpu_memory.py's `emulated_card`);
the full-size weights are random and built on the GPU (no download). Peaks are the allocator's allocated bytes, which
the plan's GPU bytes (margin included) must cover.
"""

import gc

import pytest
import torch

from bench.model import build_transformer
from graph_runtime.encoding.images import decode_latents
from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.memory import budget as budgets
from graph_runtime.sampling.sampler import SamplingRequest, sample
from tests.gpu.test_gpu_memory import GB, build_vae, emulated_card, fresh_device  # noqa: F401 - an autouse fixture
from tests.owners import loaded_for

pytestmark = pytest.mark.gpu


def test_a_streamed_plan_runs_within_its_bytes_and_a_bigger_card_loads_whole_again():
    """bf16 DiT, 1024x1024 on an emulated 16 GB card: the plan streams blocks, the run's allocated peak stays within
    the plan's GPU bytes and the latents are finite (the streamed steps replay too); on a 40 GB card next, the plan is
    whole, the streamed blocks come back and the steps replay a captured graph."""
    transformer = build_transformer()
    vae = build_vae()
    loaded = loaded_for(transformer)
    positive = PromptEmbeds(torch.randn(1, 128, 4096, device="cuda", dtype=torch.bfloat16),
                            torch.zeros(1, 128, dtype=torch.bool))  # no image slots: text to image
    request = SamplingRequest(positive=positive, latent_height=64, latent_width=64, sigma_preset="turbo")
    torch.cuda.empty_cache()
    with emulated_card(16 * GB):
        budget = budgets.check_runtime_request(loaded, request, vae)
        plan = budget.plan
        print(plan.describe())
        assert plan.fits and plan.streamed_blocks > 0
        loaded.follow_plan("cuda", plan)
        assert loaded.streaming is not None and loaded.streaming.resident_blocks == plan.resident_blocks
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result = sample(loaded.engine, request)
        images = decode_latents(vae, result.latents, loaded.engines())
        peak = torch.cuda.max_memory_allocated()
    print(f"streamed: peak allocated {peak / GB:.2f} GB, plan {plan.gpu_bytes / GB:.2f} GB; stats {result.stats}")
    assert torch.isfinite(result.latents).all() and torch.isfinite(images).all()
    assert peak <= plan.gpu_bytes
    assert result.stats["replays"] == 0 and sum(result.stats["eager_steps"].values()) > 0

    with emulated_card(40 * GB):
        whole = budgets.check_runtime_request(loaded, request, vae).plan
        assert whole.whole
        loaded.follow_plan("cuda", whole)
        assert loaded.streaming is None
        assert all(p.device.type == "cuda" for p in transformer.parameters())
        again = sample(loaded.engine, request)
    assert again.stats["replays"] > 0
    loaded.engine.release()
