"""Attention `fp8`: graph entries keep e4m3 K/V with per-head scales and the decode step attends with FlashAttention-3's
FP8 forward where it runs; elsewhere the choice falls back to what `auto` picks, logged once and counted. On the
CPU the FP8 forward is emulated (dequantize, then SDPA in fp32) so the runtime's plumbing runs end to end."""

import logging

import pytest
import torch

from graph_runtime.decode import attention, kv_format
from graph_runtime.decode.attention import AttentionChoice, Fa3Attention, Fa3Fp8Attention, choose
from graph_runtime.decode.capture import EntrySpec
from graph_runtime.decode.engine import DecodeEngine
from graph_runtime.decode.graphs import make_key
from graph_runtime.decode.kv_format import Fp8KVStore, v_scales
from graph_runtime.kernels.qk_norm_rope import E4M3_MAX, norm_bound_scale
from graph_runtime.decode.step import FP8_HEAD_DIM
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer
from tests.test_attention_choice import _fa3_on_cpu as fa3_semantics
from tests.test_attention_choice import hopper  # noqa: F401 - a fixture
from tests.test_graph_manager import RecordingBackend, _request


def _fa3_on_cpu(q, k, v, causal=False, q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention-3's forward semantics in plain torch, `[B, S, H, D]`; e4m3 inputs are dequantized with their
    `[B, H]` descales first (what the FP8 kernel's fp32 accumulation computes, up to summation order)."""
    if q.dtype == torch.float8_e4m3fn:
        q, k, v = (t.float() * s[:, None, :, None] for t, s in ((q, q_descale), (k, k_descale), (v, v_descale)))
    return fa3_semantics(q, k, v, causal)


def test_fp8_on_the_cpu_falls_back_to_sdpa_with_its_reason():
    """`fp8` on a CPU device runs what `auto` runs there (SDPA), and the reason says FP8 attention fell back and
    why; an unknown choice is refused naming the four."""
    backend, reason = choose(torch.device("cpu"), torch.bfloat16, "fp8")
    assert backend.name == "sdpa"
    assert reason == f"{attention.FP8_FALLBACK}: {attention.NOT_CUDA}"
    with pytest.raises(ValueError, match="expected one of auto, sdpa, fa3, fp8"):
        AttentionChoice("e4m3")


def test_fp8_without_fa3_falls_back_logged_once_as_a_warning_and_counted(hopper, caplog):
    """On Hopper without FlashAttention-3 installed (this machine), `fp8` becomes SDPA: one warning per process
    however many models ask, each choice counted under the FP8 fallback reason, and the step's entries keep the
    model's dtype (the K/V format is "native")."""
    first, second = AttentionChoice("fp8"), AttentionChoice("fp8")
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        for choice in (first, second):
            assert choice.pick(torch.device("cuda:0"), torch.bfloat16).name == "sdpa"
            choice.pick(torch.device("cuda:0"), torch.bfloat16)
    reason = f"{attention.FP8_FALLBACK}: {attention.NOT_INSTALLED}"
    lines = [r for r in caplog.records if reason in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert first.fallbacks == {reason: 1} and second.fallbacks == {reason: 1}


def test_fp8_with_an_fa3_build_lacking_fp8_runs_fa3_bf16(hopper, monkeypatch):
    """FlashAttention-3 installed but its FP8 forward failing the probe: `fp8` runs FA3's bf16 forward (the bf16
    choice), counted with the probe's reason; with the probe passing it takes the FP8 kernel."""
    monkeypatch.setattr(attention, "probe_fp8", lambda forward, device: f"{attention.NO_FP8_KERNEL}: no kernel")
    choice = AttentionChoice("fp8", loader=lambda: (_fa3_on_cpu, None))
    assert choice.pick(torch.device("cuda:0"), torch.bfloat16).name == "fa3"
    assert choice.fallbacks == {f"{attention.FP8_FALLBACK}: {attention.NO_FP8_KERNEL}: no kernel": 1}
    monkeypatch.setattr(attention, "probe_fp8", lambda forward, device: None)
    choice = AttentionChoice("fp8", loader=lambda: (_fa3_on_cpu, None))
    assert choice.pick(torch.device("cuda:0"), torch.bfloat16).name == "fa3-fp8" and not choice.fallbacks


def test_fp8_graph_keys_and_entry_specs_differ_from_bf16_ones(hopper, monkeypatch):
    """The same request on an `fp8` step and on an `fa3` step gets different graph keys (the kernel's name) and
    entry specs (the K/V format), so e4m3 and bf16 entries never share buffers or graphs; `auto` is FA3 bf16. A
    head width the FP8 kernels lack keeps the model's dtype, the fallback counted."""
    monkeypatch.setattr(attention, "probe_fp8", lambda forward, device: None)
    # FlashAttention-3's FP8 kernels take head widths 64/128/256: the tiny model's 16 keeps bf16 K/V, counted.
    tiny_model = random_tiny_transformer().to(torch.bfloat16)  # the engine holds its model weakly
    tiny = DecodeEngine(tiny_model, attention="fp8").step
    tiny.attention = AttentionChoice("fp8", loader=lambda: (_fa3_on_cpu, None))
    assert tiny.kv_format(torch.device("cuda:0")) == "native"
    assert tiny.attention.fallbacks == {FP8_HEAD_DIM: 1}
    model = random_tiny_transformer(dict(TINY_TRANSFORMER, attention_head_dim=64, axes_dims_rope=(16, 24, 24)))
    model = model.to(torch.bfloat16)
    steps = {}
    for name in ("fp8", "fa3", "auto"):
        engine = DecodeEngine(model, attention=name)
        engine.step.attention = AttentionChoice(name, loader=lambda: (_fa3_on_cpu, None))
        steps[name] = engine.step
    cuda = torch.device("cuda:0")
    assert steps["fp8"].variant(cuda).startswith("fa3-fp8+") and steps["fa3"].variant(cuda).startswith("fa3+")
    assert steps["auto"].variant(cuda) == steps["fa3"].variant(cuda)
    assert (steps["fp8"].kv_format(cuda), steps["fa3"].kv_format(cuda)) == ("fp8", "native")
    layout = type("Layout", (), {"signature": (4, 8, ((1, 2, 4),), ()), "prefix_len": 4, "target_tokens": 8})()
    keys = {n: make_key(steps[n], "cond", 1, layout, torch.bfloat16, cuda) for n in ("fp8", "fa3")}
    assert keys["fp8"] != keys["fa3"]
    specs = {n: EntrySpec.for_request(model, layout, 1, kv_format=steps[n].kv_format(cuda)) for n in ("fp8", "fa3")}
    assert specs["fp8"] != specs["fa3"] and specs["fp8"].static_bytes < specs["fa3"].static_bytes


def test_prefix_quantization_rule_scales_and_saturation():
    """Loading a prefix into an fp8 store: q/k scales are the static bound of the norm weights (the kernel's for the
    target rows), V's per head are the prefix's amax times the headroom over 448 (a zero head gets the floor); the
    prefix rows dequantize to the inputs within e4m3 rounding (relative 2^-4, 3 mantissa bits) and the descales the
    kernel reads equal the scales. A target V beyond the headroom saturates to +-448 instead of overflowing."""
    g = torch.Generator().manual_seed(0)
    heads, dim, prefix, target, blocks = 3, 16, 5, 4, 2
    norms = [(1 + 0.2 * torch.randn(dim, generator=g), 1 + 0.3 * torch.randn(dim, generator=g)) for _ in range(blocks)]
    store = Fp8KVStore(2, prefix, target, heads, dim, blocks, torch.float32, "cpu", norms)
    k = [torch.randn(2, prefix, heads, dim, generator=g) for _ in range(blocks)]
    v = [torch.randn(2, prefix, heads, dim, generator=g) * torch.tensor([1.0, 30.0, 0.0])[:, None]
         for _ in range(blocks)]
    store.load_prefix(k, v)
    for i in range(blocks):
        assert torch.allclose(store.scales[i, 0], torch.tensor(norm_bound_scale(norms[i][0], dim)))
        assert torch.allclose(store.scales[i, 1], torch.tensor(norm_bound_scale(norms[i][1], dim)))
        amax = v[i].abs().amax(dim=(0, 1, 3))
        want_v = (amax * kv_format.V_HEADROOM).clamp_min(kv_format.MIN_V_AMAX) / E4M3_MAX
        assert torch.allclose(store.scales[i, 2], want_v) and torch.equal(store.scales[i, 2], v_scales(v[i]))
        assert store.scales[i, 2, 2].item() == pytest.approx(kv_format.MIN_V_AMAX / E4M3_MAX)
        assert torch.equal(store.descale[i], store.scales[i][:, None, :].expand(3, 2, heads))
        for got, src, which in ((store.k[i], k[i], 1), (store.v[i], v[i], 2)):
            back = got[:, :prefix].float() * store.scales[i, which][:, None]
            assert ((back - src).abs() <= src.abs() * 2 ** -4 + store.scales[i, which][:, None] * 2 ** -9).all()
            assert not got[:, prefix:].float().any()  # the target rows are the decode step's
    # The headroom: a V four times the prefix's amax still fits; beyond it, saturation.
    inverse = store.inverse[0, 2]
    amax = v[0].abs().amax(dim=(0, 1, 3))
    fits = kv_format.quantize_heads_e4m3(amax[None, :, None].expand(1, heads, dim) * 4, inverse).float()
    assert (fits[0, :2] <= E4M3_MAX).all() and (fits[0, :2] >= E4M3_MAX * 0.93).all()
    big = kv_format.quantize_heads_e4m3(torch.full((1, heads, dim), 1e6), inverse).float()
    assert (big == E4M3_MAX).all() and not big.isnan().any()


def test_an_fp8_engine_keeps_e4m3_entries_and_stays_near_the_bf16_step(tiny_models, generator, monkeypatch):
    """Through the whole engine on the CPU (FA3's FP8 forward emulated): an `fp8` engine's graph entry holds e4m3 K/V
    whose prefix rows came from the prefix pass's staging copy, its replay equals its own eager body on those
    buffers, its prediction is the `fa3` engine's within e4m3 rounding (relative error under 1e-2 on the tiny fp32
    model, whose prediction attention moves little; the attention alone is checked below) but not equal to it (the
    FP8 path ran), and a second queued prompt with the same shapes replays without capturing; an eager step of the
    same request attends in the model's dtype (it reads the request's own prefix)."""
    monkeypatch.setattr(attention, "choose", lambda device, dtype, requested, loader: (
        (Fa3Fp8Attention(_fa3_on_cpu) if requested == "fp8" else Fa3Attention(_fa3_on_cpu)), None))
    transformer = tiny_models.transformer
    t = torch.full((1,), 0.6)
    outs = {}
    for name in ("fa3", "fp8"):
        backend = RecordingBackend()
        engine = DecodeEngine(transformer, backend=backend, attention=name)
        prefix, latents = _request(generator, "a red cube", engine=engine)
        outs[name] = engine.decode_step(prefix, latents, t)
        assert outs[name].path == "capture"
        entry = engine.graphs.entries[prefix.graph_key]
        if name == "fp8":
            assert entry.inputs.kv_format == "fp8" and entry.inputs.k[0].dtype == torch.float8_e4m3fn
            assert prefix.k[0].dtype == torch.float32  # the request's prefix: views of the staging copy
            staging = entry.inputs.fp8.prefix_k[0]
            assert prefix.k[0].untyped_storage().data_ptr() == staging.untyped_storage().data_ptr()
            assert torch.equal(engine.step(entry.inputs), outs[name].output)
            eager = engine.decode_step(prefix, latents, t, mode="eager").output
            assert torch.equal(eager, outs["fa3"].output)
            prefix.release()
            second, latents = _request(generator, "a red cube", engine=engine)
            again = engine.decode_step(second, latents, t)
            assert again.path == "replay" and backend.capture_calls == 1
            assert torch.equal(again.output, outs[name].output)
    ref, got = outs["fa3"].output, outs["fp8"].output
    rel = ((got - ref).norm() / ref.norm()).item()
    print(f"fp8 vs fa3 step, relative error {rel:.3e}")
    assert 0 < rel < 1e-2, rel


def test_the_bench_judges_the_runtime_fp8_attention_against_the_int8_bound(tiny_parts, monkeypatch):
    """The bench's `int8-fp8kv` variant runs the engine's own FP8 attention (e4m3 entries) on int8's Linears: its
    per-block and whole-step errors differ from `int8`'s (the FP8 path ran, emulated on the CPU) and get a verdict
    against the INT8 bound. Where FP8 attention falls back (the CPU without the emulation), the variant's errors
    are int8's and its verdict is a failure that says so, never a pass."""
    from bench import fp8_quality
    from bench.paths import ALL_PATHS
    from bench.runner import _bound_variant
    from bench.scenarios import Scenario, build_inputs

    spec = next(s for s in ALL_PATHS if s.name == fp8_quality.ATTENTION_FP8_KV)
    assert (spec.attention, _bound_variant(spec)) == ("fp8", "int8-fp8kv")
    model = tiny_parts["transformer"]
    config = model.config
    inputs = {"s": build_inputs(Scenario("s", 128, quality=True), config.context_in_dim, config.in_channels, "cpu",
                                torch.float32)}
    variants = [fp8_quality.INT8, "int8", fp8_quality.ATTENTION_FP8_KV]
    fallback = fp8_quality.measure(model, inputs, "cpu", variants)
    errs = fallback["scenarios"]["s"]
    assert errs["int8-fp8kv"]["kv_format"] == "native"
    assert errs["int8-fp8kv"]["step_err"] == errs["int8"]["step_err"]
    assert fallback["verdicts"]["int8-fp8kv"]["s"]["pass"] is False and "did not run" in fp8_quality.markdown(fallback)
    monkeypatch.setattr(attention, "choose", lambda device, dtype, requested, loader: (
        (Fa3Fp8Attention(_fa3_on_cpu) if requested == "fp8" else Fa3Attention(_fa3_on_cpu)), None))
    report = fp8_quality.measure(model, inputs, "cpu", variants)
    errs = report["scenarios"]["s"]
    assert errs["int8-fp8kv"]["kv_format"] == "fp8"
    assert errs["int8-fp8kv"]["step_err"] != errs["int8"]["step_err"]
    assert errs["int8-fp8kv"]["block_err"] != errs["int8"]["block_err"]
    assert set(report["verdicts"]["int8-fp8kv"]["s"]) >= {"worst_block_ratio", "step_ratio", "pass"}


def test_the_command_line_takes_attention_fp8_and_reports_its_fallback(tmp_path, capsys):
    """`generate --attention fp8` on the CPU writes the image with attention as `auto` runs it there (SDPA), and the
    graph manager's status names the FP8 fallback and its reason; with `--gpus` above 1 a non-auto attention is
    refused before any model loads (sequence-parallel ranks would ignore it)."""
    import json

    from graph_runtime.cli import main

    out = tmp_path / "x.png"
    assert main(["generate", "--out", str(out), "--width", "256", "--height", "256", "--steps", "2",
                 "--attention", "fp8"]) == 0
    printed = capsys.readouterr().out
    status = json.loads(printed.split("graph manager: ", 1)[1].splitlines()[0])
    assert status["attention"] == {"cpu float32": "sdpa"}
    assert status["attention_fallbacks"] == {f"{attention.FP8_FALLBACK}: {attention.NOT_CUDA}": 1}
    assert out.exists()
    assert main(["generate", "--out", str(tmp_path / "y.png"), "--device", "cpu", "--gpus", "2",
                 "--attention", "fp8"]) == 2
    assert "--attention='fp8' is invalid: expected auto with --gpus above 1" in capsys.readouterr().err


@pytest.mark.parametrize("kernels", [True, False])
def test_one_block_attends_in_fp8_within_e4m3_rounding(tiny_models, kernels):
    """One block's `attend` over e4m3 K/V (a prefix, normed and rotated as the prefix pass writes it, loaded by the
    store's rule; the target rows written by the step)
    against the same block over bf16-format K/V: the attention output differs by e4m3 rounding of q, k and v (3
    mantissa bits, 2^-4 relative each, so a relative error under 0.1, as FA3's FP8 kernel measured 0.055 against fp32
    at the step's shapes) and not by nothing; the K/V rows it wrote dequantize to the bf16 ones within e4m3 rounding.
    The same with our kernels off (the modules' own norms, quantized as the kernel would)."""
    from graph_runtime.decode.step import TargetDecodeBlock, rope_tables

    block = TargetDecodeBlock(tiny_models.transformer.transformer_blocks[0], kernels=kernels)
    block.attention_backend = Fa3Fp8Attention(_fa3_on_cpu)
    heads, dim = block.block.attn.heads, block.block.attn.inner_dim // block.block.attn.heads
    g = torch.Generator().manual_seed(3)
    prefix, tokens = 7, 12
    q, k, v = (torch.randn(1, tokens, heads, dim, generator=g) for _ in range(3))
    cos, sin = rope_tables(torch.polar(torch.ones(tokens, dim // 2), torch.rand(tokens, dim // 2, generator=g) * 6))
    k16 = torch.zeros(1, prefix + tokens, heads, dim)
    v16 = torch.zeros_like(k16)
    # The prefix's K as the prefix pass writes them: through the same q/k norm and RoPE (so within the norm bound).
    cos_p, sin_p = rope_tables(torch.polar(torch.ones(prefix, dim // 2), torch.rand(prefix, dim // 2, generator=g)))
    raw = torch.randn(1, prefix, heads, dim, generator=g)
    k16[:, :prefix] = block.norm_rope(raw, raw, raw, cos_p, sin_p)[1]
    v16[:, :prefix] = torch.randn(1, prefix, heads, dim, generator=g)
    norms = [(block.block.attn.norm_q.weight, block.block.attn.norm_k.weight)]
    store = Fp8KVStore(1, prefix, tokens, heads, dim, 1, torch.float32, "cpu", norms)
    store.load_prefix([k16[:, :prefix]], [v16[:, :prefix]])
    with torch.no_grad():
        want = block.attend(q, k, v, cos, sin, k16, v16, prefix, True, None)
        got = block.attend(q, k, v, cos, sin, store.block(0), None, prefix, True, None)
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 0.1, rel
    for fp8, ref, which in ((store.k[0], k16, 1), (store.v[0], v16, 2)):
        back = fp8.float() * store.scales[0, which][:, None]
        assert ((back - ref).abs() <= ref.abs() * 2 ** -4 + store.scales[0, which][:, None] * 2 ** -9).all()


def test_a_stored_prefix_entry_keeps_native_kv_and_its_own_key(hopper, monkeypatch):
    """An int8 or host prefix's entry reads the store's working buffers in the model's dtype, so on an `fp8` step its
    K/V format is native while a gpu prefix's is fp8; graph keys carry the format and the placement, so the entries
    never share buffers or graphs."""
    from graph_runtime.decode.capture import entry_kv_format

    monkeypatch.setattr(attention, "probe_fp8", lambda forward, device: None)
    model = random_tiny_transformer(dict(TINY_TRANSFORMER, attention_head_dim=64, axes_dims_rope=(16, 24, 24)))
    model = model.to(torch.bfloat16)  # the engine holds its model weakly
    step = DecodeEngine(model, attention="fp8").step
    step.attention = AttentionChoice("fp8", loader=lambda: (_fa3_on_cpu, None))
    cuda = torch.device("cuda:0")
    assert [entry_kv_format(step, p, cuda, torch.bfloat16) for p in ("gpu", "int8", "host")] == [
        "fp8", "native", "native"]
    layout = type("Layout", (), {"signature": (4, 8, ((1, 2, 4),), ()), "prefix_len": 4, "target_tokens": 8})()
    keys = {p: make_key(step, "cond", 1, layout, torch.bfloat16, cuda, placement=p) for p in ("gpu", "host")}
    assert (keys["gpu"].kv_format, keys["host"].kv_format) == ("fp8", "native") and keys["gpu"] != keys["host"]
    assert keys["host"].describe()["kv_format"] == "native"


def _wide_heads(head_dim: int):
    """The tiny architecture with heads of `head_dim` channels (two of them), bf16."""
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    return random_tiny_transformer(dict(TINY_TRANSFORMER, attention_head_dim=head_dim, axes_dims_rope=rope)).to(
        torch.bfloat16)


def test_auto_attends_in_fp8_under_int8_linears_at_128_wide_heads_only(hopper, monkeypatch):
    """`auto` takes FP8 attention (e4m3 entries, the `fa3-fp8` kernel in graph keys) for a model whose block Linears
    are INT8 at 128-wide heads, the case measured within the INT8 ConvRot bound over the whole step; the same model
    with bf16 Linears, or INT8 Linears at 64-wide heads, stays FlashAttention-3 bf16, and none of them counts a
    fallback. `fa3` keeps bf16 under INT8 Linears."""
    from graph_runtime.decode.step import prefers_fp8
    from graph_runtime.fp8.convert import apply_precision

    monkeypatch.setattr(attention, "probe_fp8", lambda forward, device: None)
    cuda = torch.device("cuda:0")

    def step_of(model, name="auto"):
        step = DecodeEngine(model, attention=name).step
        step.attention = AttentionChoice(name, loader=lambda: (_fa3_on_cpu, None),
                                         prefers_fp8=lambda: prefers_fp8(step.model))
        return step

    bf16_128, int8_128, int8_64 = _wide_heads(128), _wide_heads(128), _wide_heads(64)
    apply_precision(int8_128, "int8")
    apply_precision(int8_64, "int8")
    assert not prefers_fp8(bf16_128) and prefers_fp8(int8_128) and not prefers_fp8(int8_64)
    picked = {}
    for label, model, name in (("bf16-128", bf16_128, "auto"), ("int8-128", int8_128, "auto"),
                               ("int8-64", int8_64, "auto"), ("int8-128 fa3", int8_128, "fa3")):
        step = step_of(model, name)
        picked[label] = (step.attention.pick(cuda, torch.bfloat16).name, step.kv_format(cuda))
        assert not step.attention.fallbacks, label
    assert picked == {"bf16-128": ("fa3", "native"), "int8-128": ("fa3-fp8", "fp8"), "int8-64": ("fa3", "native"),
                      "int8-128 fa3": ("fa3", "native")}


def test_auto_fp8_without_its_kernel_runs_what_auto_runs_and_says_why_at_info(hopper, monkeypatch, caplog):
    """INT8 Linears at 128-wide heads under `auto`: without FlashAttention-3 the step runs SDPA with plain `auto`'s
    reason (not an FP8 one); with an FA3 build lacking FP8 kernels it runs FA3 bf16, the FP8 reason counted and logged
    once at info (a warning is for what a user asked for)."""
    from graph_runtime.decode.step import prefers_fp8
    from graph_runtime.fp8.convert import apply_precision

    model = _wide_heads(128)
    apply_precision(model, "int8")
    cuda = torch.device("cuda:0")
    missing = AttentionChoice("auto", loader=lambda: (None, attention.NOT_INSTALLED),
                              prefers_fp8=lambda: prefers_fp8(model))
    assert missing.pick(cuda, torch.bfloat16).name == "sdpa" and missing.fallbacks == {attention.NOT_INSTALLED: 1}
    monkeypatch.setattr(attention, "probe_fp8", lambda forward, device: f"{attention.NO_FP8_KERNEL}: none")
    no_fp8 = AttentionChoice("auto", loader=lambda: (_fa3_on_cpu, None), prefers_fp8=lambda: prefers_fp8(model))
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        assert no_fp8.pick(cuda, torch.bfloat16).name == "fa3"
    reason = f"{attention.FP8_FALLBACK}: {attention.NO_FP8_KERNEL}: none"
    assert no_fp8.fallbacks == {reason: 1}
    assert [r.levelno for r in caplog.records if reason in r.getMessage()] == [logging.INFO]
