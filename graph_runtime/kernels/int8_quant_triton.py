"""The Triton side of `int8_quant.py`: per-token int8 rows, rotated group-wise first for ConvRot weights.

The rotation is ComfyUI's ConvRot one: comfy-kitchen's regular Hadamard of 256, the Kronecker product of four copies
of the 4x4 block `B` (1 everywhere but -1 where row + column = 3), normalized. It runs as a fast transform, one stage
per base-4 digit of a value's index in its group: `B x = sum(x) - 2 * reversed(x)` for each 4 values that differ only
in that digit, halved. That is adds in fp32 (exact but for fp32's own rounding) on values a thread mostly holds
already, where matrix products of 16x16 tiles need shared-memory transposes that made these kernels run at half
the memory rate.
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
def _hadamard4_stage(x, OUTER: tl.constexpr, INNER: tl.constexpr):
    """`B / 2` applied along the digit whose stride is `INNER` (`x` read as `[OUTER, 4, INNER]`)."""
    x3 = tl.reshape(x, (OUTER, 4, INNER))
    total = tl.sum(x3, axis=1)
    y = (total[:, None, :] - 2.0 * tl.flip(x3, 1)) * 0.5
    return tl.reshape(y, (OUTER * 4 * INNER,))


@triton.jit
def rotate_row(x, BLOCK: tl.constexpr):
    """`x` `[BLOCK]` fp32 (BLOCK a multiple of 256; padding columns zero) rotated group-wise by the 256 Hadamard."""
    groups: tl.constexpr = BLOCK // 256
    x = _hadamard4_stage(x, groups * 64, 1)
    x = _hadamard4_stage(x, groups * 16, 4)
    x = _hadamard4_stage(x, groups * 4, 16)
    return _hadamard4_stage(x, groups, 64)


@triton.jit
def row_scale(amax):
    """The int8 scale of a row whose largest magnitude is `amax`."""
    return tl.maximum(amax / INT8_MAX, MIN_SCALE)


@triton.jit
def quantize(y, scale):
    """fp32 values -> int8 values (as fp32 integers) at `scale`, rounded half to even."""
    q = (y / scale + ROUND_MAGIC) - ROUND_MAGIC
    return tl.minimum(tl.maximum(q, -INT8_MAX), INT8_MAX)


@triton.jit
def quantize_row(y):
    """fp32 row -> (int8 values as fp32 integers, scale): `scale = amax(|y|) / 127`."""
    scale = row_scale(tl.max(tl.abs(y), axis=0))
    return quantize(y, scale), scale


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


@triton.jit
def _swiglu_part(gate_ptr, up_ptr, offsets, mask, ROTATE: tl.constexpr, PART: tl.constexpr):
    y = silu_mul_fp32(gate_ptr, up_ptr, offsets, mask)
    if ROTATE:
        y = rotate_row(y, PART)
    return y


@triton.jit(do_not_specialize=["rows"])
def silu_mul_int8_kernel(gate_ptr, up_ptr, out_ptr, scale_ptr, rows, cols, ROTATE: tl.constexpr,
                         PART: tl.constexpr, PARTS: tl.constexpr):
    """`silu(gate) * up` of one row (one token's MLP hidden state) as int8 with the row's scale.

    The row is held in registers as `PARTS` (1 or 3) power-of-two parts of `PART` values: the MLP's rows are three
    times a power of two wide, which three parts fill exactly where one block would be padded by a third."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, PART)
    mask = offsets < cols  # all true unless one part is padded to a power of two
    start = row * cols + offsets
    y0 = _swiglu_part(gate_ptr, up_ptr, start, mask, ROTATE, PART)
    amax = tl.max(tl.abs(y0), axis=0)
    if PARTS == 3:
        y1 = _swiglu_part(gate_ptr, up_ptr, start + PART, mask, ROTATE, PART)
        y2 = _swiglu_part(gate_ptr, up_ptr, start + 2 * PART, mask, ROTATE, PART)
        amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(y1), axis=0), tl.max(tl.abs(y2), axis=0)))
    scale = row_scale(amax)
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + start, quantize(y0, scale).to(tl.int8), mask=mask)
    if PARTS == 3:
        tl.store(out_ptr + start + PART, quantize(y1, scale).to(tl.int8), mask=mask)
        tl.store(out_ptr + start + 2 * PART, quantize(y2, scale).to(tl.int8), mask=mask)
