"""The FP8 decode path on the GPU (run on the H200: `pytest -m gpu`; FP8 GEMMs need compute capability 8.9+).

- Our kernels' FP8 outputs at the real model's widths against PyTorch's math and PyTorch's own e4m3 conversion
  (round to nearest even on both sides; a reduction summed in another order may move a value across a rounding
  boundary: at most one e4m3 step, on under 1% of the values).
- `Fp8Linear` runs `torch._scaled_mm`, equal to the product of the dequantized operands up to its bf16 output
  (2^-7 relative, plus fp32 accumulation-order noise far below that).
- The captured FP8 decode graph replays exactly what its own body computes eagerly on the same static buffers under
  the capture's settings (max abs difference 0); a second prompt with the same shapes captures nothing.
"""

import copy

import pytest
import torch

from graph_runtime.decode import DecodeEngine
from graph_runtime.fp8 import apply_precision, fp8_gemm_reason
from graph_runtime.fp8.linear import Fp8Linear, dequantized_matmul
from graph_runtime.kernels import fp8_quant
from graph_runtime.kernels.norm_modulate import _triton_norm_modulate, reference_norm_modulate_fp32

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def needs_fp8_gemms():
    if torch.cuda.is_available() and fp8_gemm_reason(torch.device("cuda")) is not None:
        pytest.skip(fp8_gemm_reason(torch.device("cuda")))


def _check_rows(name, data, scale, want):
    want_scale = (want.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=0, msg=name)
    got, expected = data.float(), (want / scale).to(torch.float8_e4m3fn).float()
    step = torch.maximum(expected.abs() * 2**-3, torch.full_like(expected, 2**-9))
    assert bool(((got - expected).abs() <= step * 1.0001).all()), name
    assert (got == expected).float().mean().item() > 0.99, name


def test_fp8_kernels_match_pytorch_at_the_model_widths():
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = (torch.randn(1, 333, 4096, generator=g, device="cuda") * 3).bfloat16()
    delta = torch.randn(1, 333, 4096, generator=g, device="cuda").bfloat16()
    modulation = torch.randn(1, 4 * 4096, generator=g, device="cuda").bfloat16()
    scale, gate = modulation[:, :4096], modulation[:, 4096:8192]
    _, h, h_scale = _triton_norm_modulate(x, None, None, scale, 1e-6, fp8=True)
    _check_rows("norm", h, h_scale, reference_norm_modulate_fp32(x, None, None, scale, 1e-6)[1])
    x_new, h, h_scale = _triton_norm_modulate(x, delta, gate, scale, 1e-6, fp8=True)
    want_x, want_h = reference_norm_modulate_fp32(x, delta, gate, scale, 1e-6)
    # One bf16 rounding of the same fp32 sum (tanh written out in the kernel may differ in its last bit).
    torch.testing.assert_close(x_new.float(), want_x.float(), rtol=2**-7, atol=1e-6)
    _check_rows("residual norm", h, h_scale, want_h)
    up = torch.randn(1, 333, 12288, **bf16)
    gate_mlp = (4 * torch.randn(1, 333, 12288, generator=g, device="cuda")).bfloat16()
    _check_rows("silu_mul", *fp8_quant._triton_silu_mul_fp8(gate_mlp, up),
                torch.nn.functional.silu(gate_mlp.float()) * up.float())
    attention_out = torch.randn(1, 333, 4096, **bf16)
    _check_rows("quantize rows", *fp8_quant._triton_quantize_rows(attention_out), attention_out.float())


@pytest.mark.parametrize("rows", [128, 137, 4096])
def test_fp8_linear_runs_scaled_mm_equal_to_the_dequantized_product(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(4096, 12288, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.normal_(0, 0.02)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(1, rows, 4096, device="cuda", dtype=torch.bfloat16)
    quantized = fp8_quant.quantize_rows_fp8(x)
    got = fp8(quantized)
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 12288)
    want = dequantized_matmul(quantized.data.reshape(rows, -1), quantized.scale.reshape(rows, 1), fp8.weight,
                              fp8.weight_scale).reshape(1, rows, -1)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=want.abs().max().item() * 2**-10)


@pytest.fixture(scope="module")
def fp8_transformer(tiny_parts):
    model = copy.deepcopy(tiny_parts["transformer"]).to("cuda", torch.bfloat16)
    apply_precision(model, "fp8")
    return model


def _request(generator, prompt, seed):
    from graph_runtime.sampling.sampler import SamplingRequest

    return SamplingRequest(positive=generator.encoder.encode(prompt), latent_height=8, latent_width=8, steps=4,
                           seed=seed, decode_mode="graph")


def test_fp8_graph_replays_its_own_eager_body_exactly(fp8_transformer, generator):
    from graph_runtime.sampling.sampler import sample

    engine = DecodeEngine(fp8_transformer)
    result = sample(engine, _request(generator, "a red cube", 0))
    assert result.paths[0] == "capture" and set(result.paths[1:]) == {"replay"}
    assert torch.isfinite(result.latents).all()
    (entry,) = engine.graphs.entries.values()
    assert "+fp8" in entry.key.backend
    entry.inputs.timestep.fill_(0.5)
    replayed = engine.graphs.backend.replay(entry)
    with torch.no_grad(), engine.graphs.backend.capture_settings():
        body = engine.step(entry.inputs)
    assert (replayed - body).abs().max().item() == 0.0


def test_second_fp8_prompt_captures_nothing(fp8_transformer, generator):
    from graph_runtime.sampling.sampler import sample

    engine = DecodeEngine(fp8_transformer)
    first = sample(engine, _request(generator, "a red cube", 0))
    second = sample(engine, _request(generator, "a red cube", 1))
    assert first.stats["captures"] == 1 and first.stats["prefill_captures"] == 1
    assert second.stats["captures"] == 0 and second.stats["prefill_captures"] == 0
    assert second.stats["replays"] == 4 and second.stats["prefill_replays"] == 1 and not second.stats["eager_steps"]


@pytest.mark.parametrize("precision", ["auto", "fp8-attn"])
def test_the_default_and_fp8_attn_graphs_replay_their_own_body(tiny_parts, generator, precision):
    """On a GPU with INT8 tensor cores the loaders' default (`auto`) quantizes a bf16 float model to int8 (our INT8
    GEMM); `fp8-attn` stays one setting away. Each converted model's captured graph replays exactly what its body
    computes (max abs difference 0) and its second prompt captures nothing."""
    from graph_runtime.fp8 import precision_of, resolve_precision
    from graph_runtime.sampling.sampler import sample

    resolved = resolve_precision(precision, "cuda", dtype=torch.bfloat16, int8_file=False)
    assert resolved.precision == ("int8" if precision == "auto" else precision), resolved.reason
    model = copy.deepcopy(tiny_parts["transformer"]).to("cuda", torch.bfloat16)
    apply_precision(model, resolved.precision)
    assert precision_of(model) == resolved.precision
    engine = DecodeEngine(model)
    first = sample(engine, _request(generator, "a red cube", 0))
    second = sample(engine, _request(generator, "a red cube", 1))
    assert first.paths[0] == "capture" and second.stats["captures"] == 0 and not second.stats["eager_steps"]
    (entry,) = engine.graphs.entries.values()
    assert entry.key.backend.endswith("+" + resolved.precision)
    replayed = engine.graphs.backend.replay(entry)
    with torch.no_grad(), engine.graphs.backend.capture_settings():
        body = engine.step(entry.inputs)
    assert (replayed - body).abs().max().item() == 0.0
