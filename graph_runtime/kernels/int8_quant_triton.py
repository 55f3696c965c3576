"""The Triton side of `int8_quant.py`: per-token int8 rows, rotated group-wise first for ConvRot weights.

The rotation is ComfyUI's ConvRot one (comfy-kitchen's regular Hadamard of 256 = the Kronecker product of four 4x4
blocks, normalized): a group `x` of 256 values read as a 16x16 matrix `X[a, b] = x[16 a + b]` rotates to
`H16 X H16` (`H16` = two of the 4x4 blocks, normalized, symmetric), two small matrix products per group instead of
one 256-wide one. The products run on the tensor cores in tf32: its rounding (2^-11) is far below the int8 step.
"""

import triton
import triton.language as tl

from .silu_mul_triton import silu_mul_fp32

INT8_MAX = tl.constexpr(127.0)
MIN_SCALE = tl.constexpr(1e-12)  # an all-zero row quantizes to zeros instead of dividing by zero
# Adding and subtracting 1.5 * 2^23 rounds an fp32 of magnitude below 2^22 to the nearest integer, ties to even
# (what torch.round, and so comfy-kitchen's quantizer, does) on every backend, the interpreter included.
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _hadamard16():
    """The normalized 16x16 regular Hadamard matrix: the Kronecker square of comfy-kitchen's 4x4 block, / 4."""
    i = tl.arange(0, 16)[:, None]
    j = tl.arange(0, 16)[None, :]
    # The 4x4 block is 1 everywhere but -1 where the row and column indices add up to 3.
    outer = tl.where(i // 4 + j // 4 == 3, -1.0, 1.0)
    inner = tl.where(i % 4 + j % 4 == 3, -1.0, 1.0)
    return outer * inner * 0.25


@triton.jit
def rotate_row(x, BLOCK: tl.constexpr):
    """`x` `[BLOCK]` fp32 (BLOCK a multiple of 256; padding columns zero) rotated group-wise by the 256 Hadamard."""
    h = _hadamard16()
    groups: tl.constexpr = BLOCK // 256
    # X H16 over b (the fast index), then H16 over a: transpose each group's 16x16, multiply, transpose back.
    y = tl.dot(tl.reshape(x, (BLOCK // 16, 16)), h, input_precision="tf32")
    y = tl.reshape(tl.permute(tl.reshape(y, (groups, 16, 16)), (0, 2, 1)), (BLOCK // 16, 16))
    y = tl.dot(y, h, input_precision="tf32")
    return tl.reshape(tl.permute(tl.reshape(y, (groups, 16, 16)), (0, 2, 1)), (BLOCK,))


@triton.jit
def quantize_row(y):
    """fp32 row -> (int8 values as fp32 integers, scale): `scale = amax(|y|) / 127`, rounded half to even."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / INT8_MAX, MIN_SCALE)
    q = (y / scale + ROUND_MAGIC) - ROUND_MAGIC
    return tl.minimum(tl.maximum(q, -INT8_MAX), INT8_MAX), scale


@triton.jit(do_not_specialize=["rows"])
def quantize_rows_int8_kernel(x_ptr, out_ptr, scale_ptr, rows, cols, ROTATE: tl.constexpr, BLOCK: tl.constexpr):
    """One row of `x` as int8 with its scale (rotated first with `ROTATE`), for a Linear whose input no kernel of
    ours produced."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    x = tl.load(x_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        x = rotate_row(x, BLOCK)
    q, scale = quantize_row(x)
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * cols + offsets, q.to(tl.int8), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def silu_mul_int8_kernel(gate_ptr, up_ptr, out_ptr, scale_ptr, rows, cols, ROTATE: tl.constexpr,
                         BLOCK: tl.constexpr):
    """`silu(gate) * up` of one row (one token's MLP hidden state) as int8 with the row's scale."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    y = silu_mul_fp32(gate_ptr, up_ptr, row * cols + offsets, mask)
    if ROTATE:
        y = rotate_row(y, BLOCK)
    q, scale = quantize_row(y)
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * cols + offsets, q.to(tl.int8), mask=mask)
