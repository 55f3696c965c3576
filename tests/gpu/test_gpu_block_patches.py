"""Other nodes' block and attention patches on the pack's model on a CUDA GPU (graph_runtime/core_model/patches.py).

Run on the H200:

    python -m pytest -m gpu tests/gpu/test_gpu_block_patches.py

What runs here is core's skip-layer guidance as its nodes drive the model (every step a normal call and a call with
blocks skipped) and a step with a Python patch: the skipped-block calls replay a graph of their own (a second
capture, then replays; a second run captures nothing), Python-patched steps run eagerly and are counted, and replayed
steps equal eager ones.

Tolerances: in fp32 a replayed step against an eager one differs by fp32 round-off (1e-5 on predictions of magnitude
~1-5, as tests/gpu/test_gpu_decode.py); in bf16 the replayed step runs the fused q/k-norm + RoPE kernel into the static
K/V buffer while the eager one runs the modules' own code over concatenated K/V, so they differ by bf16 rounding of a
few operations per block: 3e-2 on predictions of magnitude ~1-5 (bf16 keeps 8 bits: 2^-8 relative is 0.004-0.02 there).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.gpu
STEPS = 5
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def skip(args, extra_args):  # what core's SkipLayerGuidance nodes put in for each skipped layer
    return args


def slg_euler(fn, noise, sigmas, source, run, layers=(1,), scale=3.0):
    """Core's Euler with SkipLayerGuidanceDiT's post-CFG term at every step: `denoised + (cond - slg) * scale`, the
    `slg` prediction from a call with `layers` skipped (as its node makes it through calc_cond_batch)."""
    from graph_runtime.core_model.patches import read_patches

    plain = read_patches(None, 2)
    skipped = read_patches({"patches_replace": {"dit": {("single_block", i): skip for i in layers}}}, 2)
    x = sigmas[0] * noise
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i]
        s = torch.full((1,), float(sigma), device=x.device)
        cond = x - fn(x, s, source, run=run, roles=[0], patches=plain).float() * sigma
        slg = x - fn(x, s, source, run=run, roles=[0], patches=skipped).float() * sigma
        denoised = cond + (cond - slg) * scale
        x = x + (x - denoised) / sigma * (sigmas[i + 1] - sigma)
    return x


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request, cuda_models):
    from graph_runtime.core_model import ModelFunction
    from graph_runtime.decode import DecodeEngine
    from tests.gpu.core_calls import core_call_inputs

    dtype = request.param
    transformer = copy.deepcopy(cuda_models.transformer).to(dtype)
    engine = DecodeEngine(transformer)
    source, sigmas, noise = core_call_inputs(cuda_models, STEPS)
    # The transformer rides along: the engine holds it weakly.
    return engine, ModelFunction(engine), source, sigmas, noise, dtype, transformer


def test_skip_layer_guidance_replays_a_second_graph_and_equals_eager(setup):
    """Each SLG step is a normal call and a skipped-block call: the first run captures two graphs (the normal key
    and the key of the skipped blocks) and replays every call; a second run captures nothing; an eager run gives
    the same latents."""
    from graph_runtime.core_model import SamplingRun

    engine, fn, source, sigmas, noise, dtype, _ = setup

    def run(mode):
        before = engine.stats.snapshot()
        with SamplingRun(engine, mode) as sampling:
            out = slg_euler(fn, noise, sigmas, source, sampling)
        return out, engine.stats.delta(before), sampling.counts

    first, stats, counts = run("auto")
    assert stats["captures"] == 2 and stats["replays"] == 2 * STEPS and stats["eager_steps"] == {}
    assert counts.prefills == 2
    assert sorted(e.key.skip for e in engine.graphs.entries.values() if hasattr(e, "key")) == [(), (1,)]
    _, stats, _ = run("auto")
    assert stats["captures"] == 0 and stats["prefill_captures"] == 0 and stats["replays"] == 2 * STEPS
    eager, stats, _ = run("eager")
    assert stats["eager_steps"] == {"decode mode is eager": 2 * STEPS}
    assert (first - eager).abs().max().item() <= ATOL[dtype]


def test_python_patches_run_eagerly_counted_while_plain_steps_replay(setup):
    """A step with a Python patch (a single_block patch here) runs eagerly, counted under its reason; the plain
    steps of the same run still replay; with a patch that changes nothing the latents equal the plain run's."""
    from graph_runtime.core_model import SamplingRun
    from graph_runtime.core_model.patches import ARBITRARY, read_patches

    engine, fn, source, sigmas, noise, dtype, _ = setup
    patched = read_patches({"patches": {"single_block": [lambda a: {"img": a["img"]}]}}, 2)
    plain = read_patches(None, 2)

    def run(patch_even_steps):
        before = engine.stats.snapshot()
        x = sigmas[0] * noise
        with SamplingRun(engine) as sampling:
            for i in range(STEPS):
                s = torch.full((1,), float(sigmas[i]), device="cuda")
                patches = patched if patch_even_steps and i % 2 == 0 else plain
                v = fn(x, s, source, run=sampling, roles=[0], patches=patches).float()
                x = x + v * (sigmas[i + 1] - sigmas[i])
        return x, engine.stats.delta(before)

    reference, _ = run(False)
    out, stats = run(True)
    eager_steps = (STEPS + 1) // 2
    assert stats["eager_steps"] == {ARBITRARY: eager_steps} and stats["replays"] == STEPS - eager_steps
    assert (out - reference).abs().max().item() <= ATOL[dtype]
