"""The Triton side of `norm_modulate.py` (imported on first CUDA use; see that file for what and why)."""

import triton
import triton.language as tl


# The token count varies with every prompt length (prefix passes) and image size: not specialized, so one compiled
# variant serves them all and a restart finds it in Triton's on-disk cache (see kernels/__init__.py).
@triton.jit(do_not_specialize=["tokens"])
def norm_modulate_kernel(x_ptr, delta_ptr, gate_ptr, scale_ptr, x_out_ptr, h_ptr, tokens, dim, gate_sb, scale_sb,
                         eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(h_ptr + row * dim + cols, (centered * rstd * (1.0 + scale)).to(h_ptr.dtype.element_ty), mask=mask)
