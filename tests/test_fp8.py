"""The FP8 decode path on the CPU: weight quantization, the FP8 Linear's math, conversion by precision, the decode
step handing our kernels' FP8 rows to the Linears, and the benchmark's quality bound against INT8 ConvRot.

No FP8 GEMM kernel runs on a CPU: there `Fp8Linear` computes from the dequantized operands (the GPU path is
`torch._scaled_mm`, tests/gpu/test_gpu_fp8.py). Where this torch has a CPU `torch._scaled_mm`, that product is
compared with ours here too, which pins the operand layout and the scale convention `_scaled_mm` expects.
"""

import copy

import pytest
import torch

from graph_runtime.decode.step import DecodeInputs, DecodeStep
from graph_runtime.errors import InputError
from graph_runtime.fp8 import Fp8Linear, apply_precision, precision_of
from graph_runtime.fp8.convert import linear_names
from graph_runtime.fp8.linear import dequantized_matmul
from graph_runtime.kernels.fp8_quant import Fp8Rows, quantize_rows_fp8, reference_quantize_rows

E4M3_HALF_ULP = 2**-4  # rounding to 3 mantissa bits: at most half a unit in the last place, 2^-4 of the value
E4M3_SUBNORMAL_HALF_STEP = 2**-10  # below 2^-6 the step is 2^-9 (of the row's scale)


def _linear(out_features=48, in_features=64, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.normal_(0, 0.02)
        linear.weight[3, 5] = 0.5  # an outlier: its row's scale is set by it
    return linear


def test_weight_is_quantized_per_output_channel_within_e4m3_rounding():
    linear = _linear()
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and not fp8.weight.requires_grad
    assert fp8.weight_scale.shape == (48, 1) and fp8.weight_scale.dtype == torch.float32
    w = linear.weight.float()
    torch.testing.assert_close(fp8.weight_scale, w.abs().amax(1, keepdim=True) / 448, rtol=1e-6, atol=0)
    err = (fp8.dequantized_weight() - w).abs()
    bound = torch.maximum(w.abs() * E4M3_HALF_ULP, fp8.weight_scale * E4M3_SUBNORMAL_HALF_STEP)
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert fp8.dequantized_weight()[3, 5].item() == pytest.approx(0.5, rel=1e-6)  # the row max maps to 448 exactly


def test_requantize_writes_into_the_same_storages():
    fp8 = Fp8Linear.from_linear(_linear())
    pointers = fp8.weight.data_ptr(), fp8.weight_scale.data_ptr()
    new = _linear(seed=1).weight
    fp8.requantize_(new)
    assert (fp8.weight.data_ptr(), fp8.weight_scale.data_ptr()) == pointers
    torch.testing.assert_close(fp8.dequantized_weight(), new.float(), rtol=E4M3_HALF_ULP, atol=1e-3)
    with pytest.raises(ValueError, match=r"\[48, 64\]"):
        fp8.requantize_(torch.zeros(64, 48))


def test_forward_is_the_dequantized_product_and_takes_fp8_rows():
    """A float input is quantized per row; `Fp8Rows` handed over are used as they are; both equal the product of the
    dequantized operands (the CPU path computes exactly that; fp32 accumulation)."""
    linear = _linear()
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(2, 5, 64)
    q, s = reference_quantize_rows(x)
    expected = ((q.float() * s) @ fp8.dequantized_weight().t())
    torch.testing.assert_close(fp8(x), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fp8(Fp8Rows(q, s)), expected, rtol=1e-6, atol=1e-6)
    # ... and the float product it approximates: FP8 on both operands, ~2^-4 per element, averaged over 64 terms.
    reference = x @ linear.weight.t()
    assert ((fp8(x) - reference).norm() / reference.norm()).item() < 0.05


def test_dequantized_math_matches_torch_scaled_mm_where_the_cpu_has_it():
    """`_scaled_mm(a, w.t(), scale_a=[M, 1], scale_b=[1, N])`, what the GPU runs, is our dequantized product up to
    its bf16 output rounding (2^-8 relative)."""
    fp8 = Fp8Linear.from_linear(_linear())
    a, a_scale = reference_quantize_rows(torch.randn(40, 64))
    try:
        got = torch._scaled_mm(a, fp8.weight.t(), scale_a=a_scale, scale_b=fp8.weight_scale.view(1, -1),
                               out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch has no CPU torch._scaled_mm ({exc}); the dequantized math is tested above")
    want = dequantized_matmul(a, a_scale, fp8.weight, fp8.weight_scale)
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-6)


def test_precisions_convert_their_groups_and_free_the_float_weights(tiny_parts):
    model = copy.deepcopy(tiny_parts["transformer"]).to(torch.bfloat16)
    block = model.transformer_blocks[0]
    before = block.img_mlp.proj.weight
    done = apply_precision(model, "fp8-attn")
    assert precision_of(model) == "fp8-attn" and done["linears"] == 4 * len(model.transformer_blocks)
    assert type(block.attn.to_q) is Fp8Linear and type(block.attn.to_out[0]) is Fp8Linear
    assert type(block.img_mlp.proj) is torch.nn.Linear and block.img_mlp.proj.weight is before  # MLP left bf16
    with pytest.raises(InputError, match="already converted"):
        apply_precision(model, "fp8")
    full = copy.deepcopy(tiny_parts["transformer"]).to(torch.bfloat16)
    done = apply_precision(full, "fp8")
    # bf16 -> e4m3 halves the weights; the per-channel fp32 scales add 4 bytes per output row.
    rows = sum(m.out_features for b in full.transformer_blocks for m in b.modules() if isinstance(m, Fp8Linear))
    assert done["block_linear_bytes_after"] == done["block_linear_bytes_before"] // 2 + 4 * rows
    assert precision_of(full) == "fp8" and precision_of(tiny_parts["transformer"]) == "bf16"
    assert linear_names("fp8:mlp_down") == ["img_mlp.out"]
    for bad in ("fp4", "fp8:everything", "fp8:"):
        with pytest.raises(InputError, match="precision"):
            apply_precision(copy.deepcopy(tiny_parts["transformer"]), bad)


def test_swapped_modules_are_put_back(tiny_parts):
    from bench.swap import quantized_linears, swapped

    model = copy.deepcopy(tiny_parts["transformer"])
    originals = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    modules = quantized_linears(model, "fp8")
    with swapped(model, modules):
        assert precision_of(model) == "fp8"
    assert [m for m in model.modules() if isinstance(m, torch.nn.Linear)] == originals


def _static_inputs(batch=1, tokens=16, prefix=8, heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    angles = rand(tokens, 1, head_dim // 2)
    return DecodeInputs(hidden=rand(batch, tokens, 64), timestep=torch.full((batch,), 0.5),
                        k=[rand(batch, prefix + tokens, heads, head_dim) for _ in range(2)],
                        v=[rand(batch, prefix + tokens, heads, head_dim) for _ in range(2)],
                        cos=angles.cos(), sin=angles.sin(), prefix_len=prefix, static_kv=True)


def test_decode_step_hands_fp8_rows_from_our_kernels_to_the_linears(tiny_parts, monkeypatch):
    """With our kernels the q/k/v, gate/up and down projections get their input as FP8 rows from the norm and SwiGLU
    kernels, to_out quantizes the attention output itself; the result equals the step without our kernels (where
    every FP8 Linear quantizes its own float input): in fp32 both quantize the same values. The graph key says
    fp8."""
    model = copy.deepcopy(tiny_parts["transformer"])
    apply_precision(model, "fp8")
    inputs = []
    real_forward = Fp8Linear.forward

    def recording(self, x):
        inputs.append(type(x).__name__)
        return real_forward(self, x)

    monkeypatch.setattr(Fp8Linear, "forward", recording)
    with torch.no_grad():
        fused = DecodeStep(model)(_static_inputs())
        blocks = len(model.transformer_blocks)
        assert inputs == (["Fp8Rows"] * 3 + ["Tensor"] + ["Fp8Rows"] * 3) * blocks
        unfused = DecodeStep(model, kernels=False)(_static_inputs())
    torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-5)
    assert DecodeStep(model).variant().endswith("+kernels+fp8")


def test_fp8_rows_helpers_quantize_per_token():
    x = torch.randn(3, 7, 40) * torch.logspace(-2, 2, 7)[None, :, None]  # rows of very different magnitudes
    rows = quantize_rows_fp8(x)
    assert rows.scale.shape == (3, 7, 1)
    torch.testing.assert_close(rows.scale, x.abs().amax(-1, keepdim=True) / 448, rtol=1e-6, atol=0)
    err = (rows.dequantize() - x).abs()
    assert bool((err <= torch.maximum(x.abs() * E4M3_HALF_ULP, rows.scale * E4M3_SUBNORMAL_HALF_STEP) * 1.000001).all())
    assert quantize_rows_fp8(torch.zeros(2, 16)).dequantize().abs().max().item() == 0.0  # no division by zero


def test_quality_bound_measures_blocks_and_steps_against_int8_convrot(tiny_parts):
    """The benchmark's bound on the tiny model (fp32 on the CPU): bf16 is the model itself here (zero error), INT8
    ConvRot and FP8 have errors of their formats' size, every variant gets one error per block and one per step,
    and the verdicts compare them with INT8's; the 8-bit attention variant is measured on int8's Linears."""
    from bench import fp8_quality
    from bench.scenarios import Scenario, build_inputs

    model = tiny_parts["transformer"]
    config = model.config
    inputs = {"s": build_inputs(Scenario("s", 128, quality=True), config.context_in_dim, config.in_channels, "cpu",
                                torch.float32)}
    variants = ["bf16", fp8_quality.INT8, "fp8", "fp8:mlp_down", fp8_quality.ROTATED, "int8",
                fp8_quality.ATTENTION_8BIT]
    before = [id(m) for m in model.modules()]
    report = fp8_quality.measure(model, inputs, "cpu", variants)
    assert [id(m) for m in model.modules()] == before  # every variant swapped back out
    errs = report["scenarios"]["s"]
    assert all(len(errs[v]["block_err"]) == len(model.transformer_blocks) for v in variants)
    assert errs["bf16"]["step_err"] < 1e-6 and max(errs["bf16"]["block_err"]) < 1e-6
    for variant in (fp8_quality.INT8, "fp8", fp8_quality.ROTATED):
        assert 1e-3 < min(errs[variant]["block_err"]) and max(errs[variant]["block_err"]) < 0.2
    assert errs["fp8:mlp_down"]["step_err"] < errs["fp8"]["step_err"]  # one group of four costs less than all
    # 8-bit attention runs on the int8 variant's Linears; off CUDA its attention is SDPA, so its errors are int8's.
    assert errs[fp8_quality.ATTENTION_8BIT] == errs["int8"] and errs["int8"]["step_err"] > 0
    verdict = report["verdicts"]["fp8"]["s"]
    ratios = [e / b for e, b in zip(errs["fp8"]["block_err"], errs[fp8_quality.INT8]["block_err"])]
    assert verdict["worst_block_ratio"] == pytest.approx(max(ratios))
    assert verdict["pass"] == (max(ratios) <= 1 and verdict["step_ratio"] <= 1)
    assert report["verdicts"]["bf16"]["s"]["pass"] is True
    assert "| s | int8-convrot |" in fp8_quality.markdown(report)
    assert fp8_quality.passes(report, "bf16") is True and fp8_quality.passes(report, "fp8-attn") is None


def test_rotation_leaves_the_product_unchanged_before_quantization():
    """`(x H)(W H)^T = x W^T` for the orthonormal block Hadamard the rotated variant uses."""
    from bench.fp8_quality import hadamard

    h = hadamard(16)
    torch.testing.assert_close(h @ h.t(), torch.eye(16), atol=1e-6, rtol=0)
    x, w = torch.randn(5, 32), torch.randn(8, 32)
    rotate = lambda t: (t.reshape(*t.shape[:-1], -1, 16) @ h).reshape(t.shape)  # noqa: E731
    torch.testing.assert_close(rotate(x) @ rotate(w).t(), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_auto_picks_int8_where_our_int8_gemm_runs_else_fp8_attn_else_bf16(monkeypatch):
    """`auto` picks the fastest precision within the INT8 bound: int8 where our INT8 GEMM runs (int8 tensor cores),
    else fp8-attn where FP8 GEMMs run, for bf16 weights of a float file; an INT8 file runs its own int8 weights
    (never rounded twice) and is dequantized only when the user asked; fp16/fp32 weights or a device with neither
    convert nothing, with the reason said; an explicit precision is taken as it is."""
    from graph_runtime.fp8 import auto

    bf16 = torch.bfloat16
    assert auto.resolve_precision("auto", "cpu", dtype=bf16, int8_file=False) == auto.ResolvedPrecision(
        "bf16", "auto: no INT8 or FP8 path on this device (the INT8 GEMM kernel needs a"
                " CUDA device (this one is cpu); FP8 GEMMs need a CUDA device (this one is cpu))")
    cpu_int8 = auto.resolve_precision("auto", "cpu", dtype=bf16, int8_file=True)
    assert cpu_int8.precision == "int8" and "through comfy-kitchen" in cpu_int8.reason and not cpu_int8.converts
    monkeypatch.setattr(auto, "fp8_gemm_reason", lambda device: None)  # a device with FP8 tensor cores
    monkeypatch.setattr(auto, "int8_tensor_core_reason", lambda device: "no int8 tensor cores here")
    assert auto.resolve_precision("auto", "cuda", dtype=bf16, int8_file=False).precision == "fp8-attn"
    monkeypatch.setattr(auto, "int8_tensor_core_reason", lambda device: None)  # ... and int8 ones
    float_file = auto.resolve_precision("auto", "cuda", dtype=bf16, int8_file=False)
    assert float_file.precision == "int8" and float_file.converts and "quantized at load" in float_file.reason
    int8 = auto.resolve_precision("auto", "cuda", dtype=bf16, int8_file=True)
    assert int8.precision == "int8" and "INT8 ConvRot file" in int8.reason and not int8.converts
    dequantized = auto.resolve_precision("auto", "cuda", dtype=bf16, int8_file=False, dequantized=True)
    assert dequantized.precision == "bf16" and "dequantize" in dequantized.reason
    fp32 = auto.resolve_precision("auto", "cuda", dtype=torch.float32, int8_file=False)
    assert fp32.precision == "bf16" and "float32 weights were asked for" in fp32.reason
    assert auto.resolve_precision("fp8", "cpu", dtype=torch.float32, int8_file=True).precision == "fp8"
    assert auto.resolve_precision("int8", "cpu", dtype=bf16, int8_file=True).converts is False
    assert auto.resolve_precision("int8", "cpu", dtype=bf16, int8_file=False).converts is True


def test_auto_must_be_resolved_before_converting(tiny_parts):
    with pytest.raises(InputError, match="precision='auto' is invalid: expected a precision resolved"):
        apply_precision(copy.deepcopy(tiny_parts["transformer"]), "auto")


def test_cli_precision_auto_on_the_cpu_converts_nothing_and_says_why(tmp_path, capsys):
    """It says what runs: fp32 on the CPU, not "bf16", the name of "as loaded"."""
    from graph_runtime.cli import main

    out = tmp_path / "x.png"
    assert main(["generate", "--out", str(out), "--width", "64", "--height", "64", "--steps", "1",
                 "--device", "cpu"]) == 0
    # the CPU line says why nothing is converted: neither INT8 nor FP8 GEMMs run there
    assert ("precision: as loaded (fp32 weights, fp32 compute; auto: no INT8 or FP8 path on this device (the INT8"
            " GEMM kernel needs a CUDA device (this one is cpu); FP8 GEMMs need a CUDA device (this one is cpu)))" in capsys.readouterr().out)


def test_cli_generates_with_an_fp8_transformer_and_names_a_wrong_precision(tmp_path, capsys):
    from graph_runtime.cli import main

    out = tmp_path / "x.png"
    assert main(["generate", "--out", str(out), "--width", "128", "--height", "128", "--steps", "2",
                 "--precision", "fp8"]) == 0
    printed = capsys.readouterr().out
    assert "precision: fp8 (chosen): 14 block Linears in FP8" in printed and out.is_file()
    assert main(["generate", "--out", str(out), "--steps", "1", "--precision", "fp4"]) == 2
    assert "precision='fp4' is invalid" in capsys.readouterr().err
