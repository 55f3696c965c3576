"""Core's own EasyCache and LazyCache (a real ComfyUI's comfy_extras) on the pack's MODEL, against the same nodes on a
core reference model, and the KV-Graph Step Cache on the KV-Graph Sampler (CPU, tiny models).

tests/step_cache_driver.py runs in ComfyUI's Python (COMFYUI_PYTHON, COMFYUI_DIR; skipped without them) and measures;
the assertions are here. The reference is the same tiny transformer through core's plain model path (diffusers'
forward over the whole sequence behind core's DIFFUSION_MODEL wrappers, core's `_apply_model`); see the driver.

Tolerances: the pack's decode step and diffusers' forward agree to float32 round-off on this model (CFG scales it by
4), so 1e-4 on latents of magnitude ~10-20 for the pack vs the reference. The KV-Graph Sampler vs core's Euler in bf16:
both round the model input and prediction to bf16 at slightly different float32 latents, which random weights amplify
to ~0.2 without any cache; a cache that skipped other steps moves them by ~1 (measured `changed_by_cache`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.comfyui_driver import run_driver

pytestmark = pytest.mark.comfyui

STEPS = 10  # the driver's


@pytest.fixture(scope="module")
def measured():
    comfyui = os.environ.get("COMFYUI_DIR")
    if comfyui and not (Path(comfyui) / "comfy_extras" / "nodes_easycache.py").is_file():
        pytest.skip(f"this ComfyUI ({comfyui}) has no EasyCache node")
    return run_driver("step_cache_driver.py")


def test_the_reference_is_the_same_model(measured):
    """Without a cache the pack's MODEL and the core reference give the same latents: what the caches see on both
    is the same."""
    assert measured["no_cache"]["max_diff"] <= 1e-4


CASES = ["EasyCache 0.2 cfg1", "EasyCache 0.5 cfg1", "EasyCache 0.2 cfg4", "EasyCache 0.2 ksampler",
         "LazyCache 0.2 cfg1", "LazyCache 0.5 cfg1", "LazyCache 0.2 cfg4", "LazyCache 0.2 ksampler"]


@pytest.mark.parametrize("case", CASES)
def test_core_caches_skip_the_same_steps_as_on_a_core_model(measured, case):
    """Core's EasyCache / LazyCache with the same threshold skip as many steps on the pack's MODEL as on the core
    reference (and some: EasyCache skipped none before the MODEL's call went through core's DIFFUSION_MODEL wrappers),
    every skipped step costs no transformer step, and the latents are the reference's."""
    result = measured["cases"][case]
    pack, ref = result["pack"], result["reference"]
    assert len(pack["reported"]) == 1 and pack["reported"] == ref["reported"], result
    skipped = pack["reported"][0]["skipped"]
    assert 0 < skipped < STEPS
    branches = 2 if "cfg4" in case else 1
    assert pack["pack_transformer_steps"] == (STEPS - skipped) * branches == ref["reference_calls"]
    assert result["max_diff"] <= 1e-4 and result["magnitude"] > 1.0


def test_easycache_changes_the_output(measured):
    """EasyCache's skipped steps change the latents (before, its output was bit-identical to no cache)."""
    assert measured["easycache_changes_output"] > 1e-2


@pytest.mark.parametrize("threshold", ["0.2", "0.5"])
def test_the_kvgraph_step_cache_skips_what_core_easycache_skips(measured, threshold):
    """The KV-Graph Step Cache on the KV-Graph Sampler skips as many steps as core's EasyCache on the MODEL with the
    same settings, runs no transformer step for them, and lands where core's does (within the bf16 disagreement the
    two samplers have without any cache, far below what the cache itself changes)."""
    result = measured[f"kv_sampler {threshold}"]
    core = result["core_reported"]
    assert len(core) == 1 and 0 < result["skipped_steps"] == core[0]["skipped"], result
    assert result["decode_steps"] == STEPS - result["skipped_steps"]
    assert result["max_diff_vs_core"] <= 2 * max(result["no_cache_max_diff_vs_core"], 1e-3)
    assert result["changed_by_cache"] > 2 * result["max_diff_vs_core"]


def test_nothing_of_a_run_outlives_it(measured):
    """After the cached runs: none in progress, the engine not busy, no prefix still owning a graph entry, and the
    skipped steps counted in the engine's statistics."""
    after = measured["after"]
    assert after["runs"] == [] and not after["busy"] and after["owned_entries"] == 0
    assert after["skipped_steps_total"] > 0
