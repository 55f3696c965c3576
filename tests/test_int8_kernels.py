"""Our INT8 W8A8 kernels on the CPU, through Triton's interpreter (the GPU runs the same kernels compiled).

- The GEMM accumulates int8 products in int32, which is exact: its output equals the float64 product up to the
  final rounding to the output dtype (fp32 here: 2^-23 relative; 2^-20 allowed for the scale multiplications).
- The rotation is comfy-kitchen's ConvRot one (its normalized regular Hadamard matrix of 256): rotating our way and
  comfy-kitchen's way gives the same values to fp32 rounding, and int8 rows equal the PyTorch reference's.
- The norm and SwiGLU kernels' int8 outputs equal the reference quantizer applied to the fp32 values they compute.

Each check runs in a fresh Python with TRITON_INTERPRET=1 (it must be set before triton is imported, and kernels
keep the mode they were defined under).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interpreted import interpreted  # noqa: E402

pytest.importorskip("triton")


def check_gemm(shapes):
    from graph_runtime.kernels.int8_gemm import int8_scaled_mm, reference_int8_scaled_mm

    for m, n, k in shapes:
        g = torch.Generator().manual_seed(m * n * k)
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        a_scale, w_scale = torch.rand(m, 1, generator=g) * 1e-2, torch.rand(n, 1, generator=g) * 1e-2
        bias = torch.randn(n, generator=g)
        got = int8_scaled_mm(a, a_scale, w, w_scale, bias, torch.float32)
        exact = reference_int8_scaled_mm(a, a_scale, w, w_scale, bias, torch.float64)
        torch.testing.assert_close(got.double(), exact, rtol=2 ** -20, atol=2 ** -20 * exact.abs().max().item())
    # The MLP's down projection sums 12288 products of up to 127 x 127: 1.98e8 < 2^31, exact in int32.
    k = 12288
    a, w = torch.full((16, k), 127, dtype=torch.int8), torch.full((16, k), -127, dtype=torch.int8)
    assert torch.all(int8_scaled_mm(a, torch.ones(16, 1), w, torch.ones(16, 1), None, torch.float32) == -127 * 127 * k)


def test_gemm_equals_the_exact_int32_product():
    """Uneven rows and columns and an inner size that is not a multiple of the tile all give the exact product; the
    widest inner size of the model does not overflow int32."""
    interpreted(check_gemm, [(50, 48, 64), (33, 80, 48), (64, 64, 256)])


def test_hadamard_is_comfy_kitchens():
    """The rotation our kernels apply is the matrix comfy-kitchen rotates ConvRot weights with."""
    from comfy_kitchen.tensor.int8_utils import _build_hadamard

    from graph_runtime.kernels.int8_quant import hadamard

    assert torch.equal(hadamard(256), _build_hadamard(256, dtype=torch.float32))


def check_rotation(widths):
    from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_activation

    from graph_runtime.kernels.int8_quant import quantize_rows_int8, reference_quantize_rows_int8

    for cols in widths:
        x = torch.randn(6, cols, generator=torch.Generator().manual_seed(cols)) * 3
        rotated = _rotate_activation(x, _build_hadamard(256, dtype=torch.float32), 256)
        scale = rotated.abs().amax(-1, keepdim=True) / 127
        rows = quantize_rows_int8(x, rotate=True)
        torch.testing.assert_close(rows.scale, scale, rtol=1e-6, atol=0)
        # Dequantized rows are within half an int8 step of comfy-kitchen's rotated values.
        assert bool(((rows.dequantize() - rotated).abs() <= scale * 0.5 * (1 + 1e-5)).all())
        assert torch.equal(rows.data, reference_quantize_rows_int8(x, rotate=True)[0])
        assert rows.rotated and rows.dtype == x.dtype
        plain = quantize_rows_int8(x, rotate=False)
        assert torch.equal(plain.data, reference_quantize_rows_int8(x, rotate=False)[0]) and not plain.rotated
    # Halfway values round to the even neighbour (comfy-kitchen rounds with torch.round).
    halves = quantize_rows_int8(torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 10]), rotate=False)
    assert halves.scale.item() == 1.0 and halves.data[0, :6].tolist() == [127, 0, 2, 2, 0, -2]


def test_rotated_rows_equal_comfy_kitchens_rotation():
    """Our kernel's group-wise rotation (a fast transform: four stages of 4-point sums) equals comfy-kitchen's
    `_rotate_activation` (one 256x256 product) in fp32; the int8 rows equal the reference quantizer's (rounding half to even), padded
    widths (768 in a 1024 block) included."""
    interpreted(check_rotation, [256, 768, 4096])


def check_norm_and_swiglu():
    from graph_runtime.kernels.int8_quant import (norm_modulate_int8, reference_quantize_rows_int8,
                                                  residual_norm_modulate_int8, silu_mul_int8)
    from graph_runtime.kernels.norm_modulate import reference_norm_modulate_fp32

    g = torch.Generator().manual_seed(0)
    x, delta, up = (torch.randn(2, 5, 512, generator=g) for _ in range(3))
    gate, scale = torch.randn(2, 512, generator=g) * 0.3, torch.randn(2, 512, generator=g) * 0.2
    for rotate in (False, True):
        rows = norm_modulate_int8(x, scale, 1e-6, rotate)
        q, s = reference_quantize_rows_int8(reference_norm_modulate_fp32(x, None, None, scale, 1e-6)[1], rotate)
        assert torch.equal(rows.data, q)
        torch.testing.assert_close(rows.scale, s, rtol=1e-5, atol=0)
        x_new, rows = residual_norm_modulate_int8(x, delta, gate, scale, 1e-6, rotate)
        x_ref, h = reference_norm_modulate_fp32(x, delta, gate, scale, 1e-6)
        torch.testing.assert_close(x_new, x_ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(rows.data, reference_quantize_rows_int8(h, rotate)[0])
    # SwiGLU rows one power of two wide, three times one (held as three exact parts) and neither (padded).
    for cols in (512, 768, 48, 320):
        gate_rows, up_rows = (torch.randn(3, 2, cols, generator=g) * 2 for _ in range(2))
        for rotate in (False, True) if cols % 256 == 0 else (False,):
            rows = silu_mul_int8(gate_rows, up_rows, rotate)
            q, s = reference_quantize_rows_int8(torch.nn.functional.silu(gate_rows) * up_rows, rotate)
            assert torch.equal(rows.data, q), (cols, rotate)
            torch.testing.assert_close(rows.scale, s, rtol=1e-5, atol=0)


def test_norm_and_swiglu_kernels_write_the_reference_int8_rows():
    """The block's two norm kernels and its SwiGLU kernel, with their int8 output on (rotated or not), write the
    reference quantizer's rows of the fp32 values they compute; the residual stream is unchanged by the int8 mode.
    SwiGLU rows three times a power of two wide (the MLP's) share one scale over their three parts."""
    interpreted(check_norm_and_swiglu)


def test_rows_are_held_as_exact_parts_where_they_can_be():
    """A row three times a power of two wide is three exact parts (a rotated part holds whole rotation groups);
    any other row is one power-of-two block, padded."""
    from graph_runtime.kernels.int8_quant import row_parts

    assert row_parts(12288, rotate=True) == (4096, 3)
    assert row_parts(4096, rotate=True) == (4096, 1)
    assert row_parts(768, rotate=True) == (256, 3)
    assert row_parts(384, rotate=True) == (512, 1)  # a third of 128 would split a rotation group
    assert row_parts(384, rotate=False) == (128, 3)
    assert row_parts(320, rotate=False) == (512, 1)
    assert row_parts(12, rotate=False) == (16, 1)


def test_tile_configs_are_looked_up_by_shape_and_the_nearest_measured_token_count(monkeypatch):
    """A first prompt never autotunes: configs come from the table the GEMM benchmark writes, by (N, K) and the
    token count's power-of-two bucket, the nearest measured bucket for an unmeasured size, none for an unknown
    shape (the kernel's default then runs)."""
    from graph_runtime.kernels import int8_gemm_configs as configs

    monkeypatch.setattr(configs, "TABLE", {(9, 0): {(4096, 4096, 4096): {"kernel": "tma", "block_m": 128},
                                                    (4096, 4096, 16384): {"kernel": "tile", "block_m": 256}}})
    assert configs.lookup((9, 0), 4096, 4096, 4096)["kernel"] == "tma"
    assert configs.lookup((9, 0), 3000, 4096, 4096)["kernel"] == "tma"  # 1024x1024 with fewer tokens
    assert configs.lookup((9, 0), 16384, 4096, 4096)["kernel"] == "tile"
    assert configs.lookup((9, 0), 40000, 4096, 4096)["kernel"] == "tile"  # past the largest measured size
    assert configs.lookup((9, 0), 4096, 12288, 4096) is None
    assert configs.lookup((8, 9), 4096, 4096, 4096) is None
