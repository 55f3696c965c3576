"""FlashAttention-3 as the decode step's attention on Hopper (run on an H100/H200: `pytest -m gpu`).

The model is the full-width architecture with two blocks (32 heads x 128, bf16, the benchmark's random weights as the
loader would build them): FlashAttention-3 has kernels for head widths of 64 and up, not the tiny model's 16.
Skipped, saying why, off Hopper or where the `fa3` extra is not installed.
"""

import pytest
import torch

from bench.model import build_transformer
from bench.runner import body_as_captured
from bench.scenarios import Scenario, build_inputs
from graph_runtime.decode import DecodeEngine
from graph_runtime.decode import attention

pytestmark = pytest.mark.gpu

# FA3 and cuDNN's flash kernel both accumulate in fp32 and round the output once to bf16, but tile the softmax
# differently; on unit-scale attention outputs they differ by a few bf16 ulps. Over two blocks (each block's output
# feeds the next through GEMMs of width 4096) the step outputs then differ by bf16 rounding of values ~1: relative
# Frobenius error under 1e-2 (bf16's epsilon is 7.8e-3), and a single attention call under 2 ulps at 1.
ATTENTION_ATOL = 2 * 2 ** -8
STEP_REL = 1e-2


@pytest.fixture(scope="module")
def fa3():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(attention.NOT_HOPPER)
    forward, reason = attention._load_fa3()
    if forward is None:
        pytest.skip(reason)
    return forward


@pytest.fixture(scope="module")
def model(fa3):
    return build_transformer(layers=2)


def _inputs(model, references=1):
    config = model.config
    return build_inputs(Scenario("fa3", 512, references=references), config.context_in_dim, config.in_channels,
                        "cuda", torch.bfloat16)


def _prefill(engine, inputs, mode="auto"):
    branch = inputs.branches[0]
    _, prefix = engine.prefill(branch.layout, inputs.hidden_all, branch.embeds, inputs.timestep, mode=mode,
                               with_target=False)
    return prefix


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_one_attention_call_matches_sdpa_within_bf16_rounding(fa3):
    """FA3 on the decode step's layout (`[B, S, H, D]`, queries against prefix + target keys) equals SDPA's bf16
    result to 2 bf16 ulps at unit scale, and both are within bf16 rounding of an fp32 attention."""
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, 1024, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024 + 200, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    ours = attention.Fa3Attention(fa3)(q, k, v, None)
    sdpa = attention.sdpa(q, k, v, None)
    exact = attention.sdpa(q.float(), k.float(), v.float(), None)
    assert (ours.float() - sdpa.float()).abs().max().item() <= ATTENTION_ATOL
    assert _rel(ours, exact) < 8e-3 and _rel(sdpa, exact) < 8e-3


def test_fa3_decode_replay_equals_its_eager_body_and_a_second_prompt_captures_nothing(model):
    """On Hopper with FA3 installed, `auto` picks it (the stats say so, no fallback counted), the graph key names
    it, the replayed step equals its own eager body on the same static buffers exactly (same kernels, same inputs),
    and a second queued prompt with the same shapes replays without capturing."""
    engine = DecodeEngine(model)
    inputs = _inputs(model)
    prefix = _prefill(engine, inputs)
    first = engine.decode_step(prefix, inputs.latents, inputs.timestep, "graph")
    assert prefix.graph_key.backend.startswith("fa3")
    replayed = engine.decode_step(prefix, inputs.latents, inputs.timestep, "graph")
    assert (first.path, replayed.path) == ("capture", "replay")
    body = body_as_captured(engine, prefix)
    assert torch.equal(body, replayed.output)
    prefix.release()
    stats = engine.stats.snapshot()
    assert set(stats["attention"].values()) == {"fa3"} and stats["attention_fallbacks"] == {}
    captures = engine.stats.captures
    second = _prefill(engine, _inputs(model))
    outcome = engine.decode_step(second, inputs.latents, inputs.timestep, "graph")
    assert outcome.path == "replay" and engine.stats.captures == captures
    second.release()


@pytest.mark.parametrize("references", [0, 1])
def test_fa3_step_matches_sdpa_step_within_bf16_rounding(model, references):
    """The same request through an FA3 engine and an SDPA engine: prefix K/V (the prefix pass, FA3 segment by
    segment under the block-causal rule) and the replayed step agree within bf16 rounding (relative error < 1e-2),
    with and without a reference image in the prefix."""
    inputs = _inputs(model, references)
    outs, kv = {}, {}
    for choice in ("fa3", "sdpa"):
        engine = DecodeEngine(model, attention=choice)
        prefix = _prefill(engine, inputs)
        engine.decode_step(prefix, inputs.latents, inputs.timestep, "graph")
        outs[choice] = engine.decode_step(prefix, inputs.latents, inputs.timestep, "graph").output
        kv[choice] = torch.cat([prefix.k[-1], prefix.v[-1]]).clone()
        assert engine.step.variant().startswith(choice)
        prefix.release()
        engine.release()
    print(f"FA3 vs SDPA, {references} reference(s): step rel. error {_rel(outs['fa3'], outs['sdpa']):.2e}, "
          f"last block's prefix K/V rel. error {_rel(kv['fa3'], kv['sdpa']):.2e}")
    assert _rel(kv["fa3"], kv["sdpa"]) < STEP_REL
    assert _rel(outs["fa3"], outs["sdpa"]) < STEP_REL


def test_a_controlled_fa3_step_matches_sdpa_and_its_control_blocks_run_fa3(model):
    """A Fun ControlNet's controlled prefix pass and replayed step on an FA3 engine agree with an SDPA engine's
    within bf16 rounding (relative error < 1e-2), and the control blocks run the engine's kernel (the control stream
    runs the kernel the step chose, as the base blocks do)."""
    from graph_runtime.controlnet.stream import ControlledPrefix
    from graph_runtime.controlnet.tiny import random_tiny_controlnet

    net = random_tiny_controlnet(seed=5, num_blocks=1, config=dict(model.config), scale=2.0).to("cuda", torch.bfloat16)
    inputs = _inputs(model, references=0)
    branch = inputs.branches[0]
    tokens = torch.randn(1, inputs.latents.shape[1], 129, generator=torch.Generator().manual_seed(11))
    tokens = tokens.to("cuda", torch.bfloat16)
    outs = {}
    for choice in ("fa3", "sdpa"):
        engine = DecodeEngine(model, attention=choice)
        control = ControlledPrefix(net, (0,), tokens, 0.8)
        _, prefix = engine.prefill(branch.layout, inputs.hidden_all, branch.embeds, inputs.timestep,
                                   with_target=False, control=control)
        engine.decode_step(prefix, inputs.latents, inputs.timestep, "graph")
        outs[choice] = engine.decode_step(prefix, inputs.latents, inputs.timestep, "graph").output
        wrappers = [b for blocks in net.__dict__["_decode_blocks"].values() for b in blocks]
        assert wrappers and {b.attention_backend.name for b in wrappers} == {choice}
        prefix.release()
        engine.release()
    print(f"controlled FA3 vs SDPA: step rel. error {_rel(outs['fa3'], outs['sdpa']):.2e}")
    assert _rel(outs["fa3"], outs["sdpa"]) < STEP_REL


def test_fp8_norm_rope_kernel_writes_e4m3_within_its_rounding():
    """The q/k norm + RoPE + K/V write kernel in its e4m3 form: q and k (normed, rotated) and v, each over its
    per-head scale, equal the bf16 kernel's values to e4m3 rounding (3 mantissa bits: half a step is 2^-4 of the
    value, plus the bf16 rounding the reference carries, 2^-8), never NaN, saturated rather than overflowed where a
    scale is too small; the prefix rows are untouched. The q/k scale is the static norm-weight bound, so nothing
    saturates there."""
    from graph_runtime.kernels.qk_norm_rope import (E4M3_MAX, norm_bound_scale, qk_norm_rope_write,
                                                    qk_norm_rope_write_fp8)

    batch, tokens, prefix, heads, head_dim, eps = 1, 300, 77, 32, 128, 1e-6
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda")  # noqa: E731
    q, k, v = (rand(batch, tokens, heads * head_dim).bfloat16().unflatten(-1, (-1, head_dim)) for _ in range(3))
    v[:, :, 0] *= 100  # head 0's values outgrow its scale below: they must saturate, not become NaN
    q_weight, k_weight = (1 + 0.2 * rand(head_dim)).bfloat16(), (1 + 0.2 * rand(head_dim)).bfloat16()
    angles = rand(tokens, 1, head_dim // 2) * 10
    cos, sin = angles.cos(), angles.sin()
    shape = (batch, prefix + tokens, heads, head_dim)
    k16, v16 = torch.zeros(shape, device="cuda", dtype=torch.bfloat16), torch.zeros(shape, device="cuda",
                                                                                      dtype=torch.bfloat16)
    q16 = qk_norm_rope_write(q, k, v, q_weight, k_weight, cos, sin, k16, v16, prefix, eps)
    k8 = torch.full(shape, 1.0, device="cuda").to(torch.float8_e4m3fn)
    v8 = k8.clone()
    q_scale = torch.full((heads,), norm_bound_scale(q_weight, head_dim), device="cuda")
    k_scale = torch.full((heads,), norm_bound_scale(k_weight, head_dim), device="cuda")
    v_scale = v[:, :, 1:].float().abs().amax() / E4M3_MAX * torch.ones(heads, device="cuda")
    q8 = qk_norm_rope_write_fp8(q, k, v, q_weight, k_weight, cos, sin, k8, v8, prefix, eps, 1 / q_scale,
                                1 / k_scale, 1 / v_scale)
    for got, scale, want in [(q8, q_scale, q16), (k8[:, prefix:], k_scale, k16[:, prefix:]),
                             (v8[:, prefix:, 1:], v_scale[1:], v16[:, prefix:, 1:])]:
        value = got.float() * scale[:, None]
        assert not value.isnan().any()
        tolerance = want.float().abs() * (2 ** -4 + 2 ** -8) + scale[:, None] * 2 ** -9  # subnormal step
        assert bool(((value - want.float()).abs() <= tolerance).all())
    saturated = v8[:, prefix:, 0].float()
    assert not saturated.isnan().any() and saturated.abs().max().item() == E4M3_MAX
    assert bool((k8[:, :prefix].float() == 1).all()) and bool((v8[:, :prefix].float() == 1).all())
