"""The Triton side of `fp8_quant.py` (imported on first CUDA use; see that file for what and why)."""

import triton
import triton.language as tl

from . import fp8_format
from .silu_mul_triton import silu_mul_fp32

# Kernels read module globals only as constexprs.
FP8_MAX = tl.constexpr(fp8_format.FP8_MAX)
MIN_SCALE = tl.constexpr(fp8_format.MIN_SCALE)


# Row counts vary with the prompt and image size: not specialized (see kernels/__init__.py).
@triton.jit(do_not_specialize=["rows"])
def silu_mul_fp8_kernel(gate_ptr, up_ptr, out_ptr, scale_ptr, rows, cols, BLOCK: tl.constexpr):
    """`silu(gate) * up` of one row (one token's MLP hidden state), stored as e4m3 with the row's scale."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    y = silu_mul_fp32(gate_ptr, up_ptr, row * cols + offsets, mask)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * cols + offsets, (y / scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, rows, cols, BLOCK: tl.constexpr):
    """One row of `x` as e4m3 with its scale (for a Linear whose input no kernel of ours produced)."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    x = tl.load(x_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * cols + offsets, (x / scale).to(out_ptr.dtype.element_ty), mask=mask)
