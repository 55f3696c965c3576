"""Our INT8 GEMM and int8 row kernels on a real GPU (run on the H200: `pytest -m gpu`).

Tolerances: int32 accumulation is exact, so a GEMM result differs from the float64 reference only by its rounding to
bf16 (2^-9 relative to the largest output; 2^-8 allowed). The rotation runs as fp32 adds where the reference rotates
with an fp32 matrix product: the two differ by fp32 rounding (a few 2^-24 relative; 2^-18 allowed). Triton's fp32
division is within 2 ulp, not correctly rounded, and a bf16 input scaled by 127 / amax often lands exactly on a
tie: such values may round to the neighbouring integer, by exactly 1 (about one value in ten thousand; one in a
thousand allowed).
"""

import pytest
import torch

from graph_runtime.kernels.int8_gemm import (DEFAULT_CONFIG, GemmConfig, int8_scaled_mm, launch,
                                             reference_int8_scaled_mm)
from graph_runtime.kernels.int8_quant import quantize_rows_int8, reference_quantize_rows_int8, silu_mul_int8

pytestmark = pytest.mark.gpu


def _operands(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    a_scale = torch.rand(m, device="cuda", generator=g) * 1e-3
    w_scale = torch.rand(n, device="cuda", generator=g) * 1e-3
    return a, a_scale, w, w_scale


@pytest.mark.parametrize("config", [DEFAULT_CONFIG, GemmConfig("tma", 128, 128, 128, 8, 8, 3),
                                    GemmConfig("tile", 128, 256, 64, 8, 8, 4)])
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (1000, 384, 512), (77, 4096, 12288)])
def test_gemm_equals_the_exact_product(config, shape):
    """Every kernel and tile shape, with row counts that are not a multiple of the tile, equals the float64 product
    up to the bf16 rounding of its output."""
    m, n, k = shape
    a, a_scale, w, w_scale = _operands(m, n, k)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    got = launch(a, a_scale, w, w_scale, bias, out, config).float()
    exact = reference_int8_scaled_mm(a.cpu(), a_scale.cpu(), w.cpu(), w_scale.cpu(), bias.cpu(),
                                     torch.float32).cuda()
    assert (got - exact).abs().max().item() <= 2 ** -8 * exact.abs().max().item()


def test_gemm_replays_in_a_cuda_graph_bit_equal():
    """The op is capturable: a replay equals the eager call on the same buffers exactly."""
    a, a_scale, w, w_scale = _operands(512, 1024, 1024)
    eager = int8_scaled_mm(a, a_scale, w, w_scale)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        int8_scaled_mm(a, a_scale, w, w_scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = int8_scaled_mm(a, a_scale, w, w_scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("cols", [4096, 12288])
@pytest.mark.parametrize("rotate", [False, True])
def test_row_quantizer_matches_the_reference(cols, rotate):
    """Scales agree to fp32 rounding; values equal the reference's but for rare neighbours of a rounding boundary."""
    x = torch.randn(333, cols, device="cuda", dtype=torch.bfloat16) * 4
    got = quantize_rows_int8(x, rotate)
    q, s = reference_quantize_rows_int8(x, rotate)
    assert torch.allclose(got.scale, s, rtol=2 ** -18, atol=0)
    diff = (got.data.int() - q.int()).abs()
    assert diff.max().item() <= 1
    assert diff.float().mean().item() < 1e-3


def test_silu_mul_quantizer_matches_the_reference():
    """The same bounds as the row quantizer's, on the MLP's rows (three exact parts of 4096 sharing one scale)."""
    gate = torch.randn(100, 12288, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(100, 12288, device="cuda", dtype=torch.bfloat16)
    got = silu_mul_int8(gate, up, True)
    q, s = reference_quantize_rows_int8(torch.nn.functional.silu(gate.float()) * up.float(), True)
    assert torch.allclose(got.scale, s, rtol=2 ** -18, atol=0)
    diff = (got.data.int() - q.int()).abs()
    assert diff.max().item() <= 1
    assert diff.float().mean().item() < 1e-3


def _convrot_layer(n, k):
    """A ConvRot layer holding comfy-kitchen's own quantization of a weight (what an INT8 file holds)."""
    from graph_runtime.quantized import ConvRotInt8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=0.02)
    layer = ConvRotInt8Linear.from_linear(linear, 256)
    assert layer.our_kernel_reason(torch.device("cuda")) is None
    return linear, layer


SHAPES = [(4096, 4096), (4096, 12288), (12288, 4096)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_on_the_same_int8_rows_our_gemm_equals_comfy_kitchens_up_to_the_output_rounding(n, k):
    """Given the same int8 activation rows and scales (comfy-kitchen's row quantizer) and the same int8 weights and
    scales (its ConvRot weight quantization), our GEMM equals comfy-kitchen's int8 GEMM (`mm_int8`, int32 out) with
    the scales applied: int32 accumulation is exact in both, so only the rounding of the bf16 output differs (2^-9
    relative to the largest output; 2^-8 allowed)."""
    import comfy_kitchen

    _, layer = _convrot_layer(n, k)
    x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    rows, row_scale = comfy_kitchen.quantize_int8_rowwise(x)
    ours = int8_scaled_mm(rows, row_scale.reshape(-1), layer.weight, layer.weight_scale.reshape(-1)).float()
    products = comfy_kitchen.mm_int8(rows, layer.weight.t()).double()
    theirs = (products * row_scale.double() * layer.weight_scale.double().reshape(1, -1)).float()
    assert (ours - theirs).abs().max().item() <= 2 ** -8 * theirs.abs().max().item()


@pytest.mark.parametrize("n,k", SHAPES)
def test_our_int8_linear_is_as_close_to_the_float_product_as_comfy_kitchens(n, k):
    """The whole layer from bf16 input: comfy-kitchen's `int8_linear` on the same int8 weights is ComfyUI's result.
    The two differ where the activation's quantization does: comfy-kitchen rounds the rotated row to bf16 before
    quantizing it, we keep it in fp32, and a bf16 rounding is as large as an int8 step near a row's largest values.
    So the two W8A8 results differ by up to W8A8's own error (their distance to each other is within comfy-kitchen's
    distance to the float product), and ours is no further from the float product than comfy-kitchen's + 2%."""
    linear, layer = _convrot_layer(n, k)
    x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    ours = layer(x).float()
    theirs = torch.ops.comfy_kitchen.int8_linear(x, layer.weight, layer.weight_scale, None, 2, True, 256).float()
    exact = x.float() @ linear.weight.float().t()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    w8a8 = rel(theirs, exact)
    assert rel(ours, theirs) <= w8a8, (rel(ours, theirs), w8a8)
    assert rel(ours, exact) <= w8a8 * 1.02, (rel(ours, exact), w8a8)
