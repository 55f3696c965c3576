"""The Triton side of `norm_modulate.py` (imported on first CUDA use; see that file for what and why)."""

import triton
import triton.language as tl

from . import fp8_format
from .int8_quant_triton import quantize_row, rotate_row

# Kernels read module globals only as constexprs.
FP8_MAX = tl.constexpr(fp8_format.FP8_MAX)
MIN_SCALE = tl.constexpr(fp8_format.MIN_SCALE)


# The token count varies with every prompt length (prefix passes) and image size: not specialized, so one compiled
# variant serves them all and a restart finds it in Triton's on-disk cache (see kernels/__init__.py).
@triton.jit(do_not_specialize=["tokens"])
def norm_modulate_kernel(x_ptr, delta_ptr, gate_ptr, scale_ptr, x_out_ptr, h_ptr, h_scale_ptr, tokens, dim,
                         gate_sb, scale_sb, eps, HAS_DELTA: tl.constexpr, FP8_OUT: tl.constexpr,
                         INT8_OUT: tl.constexpr, ROTATE: tl.constexpr, BLOCK: tl.constexpr):
    """`FP8_OUT`: `h` is stored as e4m3 scaled per row (token) by `h_scale = amax(|h|) / 448`, straight from the fp32
    values (the row is in registers already, so the FP8 GEMM that reads it needs no pass of its own). `INT8_OUT`:
    likewise as int8 with `h_scale = amax(|h|) / 127`, rotated group-wise first with `ROTATE` (ConvRot weights)."""
    row = tl.program_id(0)
    b = row // tokens
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        gate = tl.load(gate_ptr + b * gate_sb + cols, mask=mask, other=0.0).to(tl.float32)
        delta = tl.load(delta_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        # tanh(g) = 2 / (1 + exp(-2g)) - 1, written out: tl has no tanh on every backend.
        x = x + (2.0 / (1.0 + tl.exp(-2.0 * gate)) - 1.0) * delta
        tl.store(x_out_ptr + row * dim + cols, x.to(x_out_ptr.dtype.element_ty), mask=mask)
    mean = tl.sum(x, axis=0) / dim
    centered = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / dim + eps)
    scale = tl.load(scale_ptr + b * scale_sb + cols, mask=mask, other=0.0).to(tl.float32)
    h = centered * rstd * (1.0 + scale)
    if FP8_OUT:
        h_scale = tl.maximum(tl.max(tl.abs(h), axis=0) / FP8_MAX, MIN_SCALE)
        tl.store(h_scale_ptr + row, h_scale)
        h = h / h_scale
    if INT8_OUT:
        if ROTATE:
            h = rotate_row(h, BLOCK)
        h, h_scale = quantize_row(h)
        tl.store(h_scale_ptr + row, h_scale)
    tl.store(h_ptr + row * dim + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
