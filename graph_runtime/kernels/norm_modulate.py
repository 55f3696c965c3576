"""Residual add + LayerNorm + modulation in one pass: `x += tanh(gate) * delta; h = LayerNorm(x) * (1 + scale)`.

Inductor's own kernels for these two lines run well below memory bandwidth at the decode shapes (the figures:
docs/performance.md): its looped reduction reads the row twice. Here one program holds a whole 4096-wide row in
registers. Without `delta` it is the block's first norm.

Arithmetic is fp32 with one rounding per stored tensor (like inductor's fused code, not the eager body's
per-op roundings); the CPU implementation is the same math in PyTorch.
"""

from __future__ import annotations

import torch

from . import define_once
from .preload import wait_for_preload


def reference_norm_modulate(x, delta, gate, scale, eps):
    """`x` `[B, T, D]`; `gate`/`scale` `[B, D]` (views into the modulation); returns (x after the residual, h)."""
    x_new, h = reference_norm_modulate_fp32(x, delta, gate, scale, eps)
    return x_new, h.to(x.dtype)


def reference_norm_modulate_fp32(x, delta, gate, scale, eps):
    """As `reference_norm_modulate`, with `h` left in fp32 (what the FP8 variant quantizes)."""
    xf = x.float()
    if delta is not None:
        xf = xf + torch.tanh(gate.float())[:, None] * delta.float()
    h = torch.nn.functional.layer_norm(xf, xf.shape[-1:], eps=eps) * (1 + scale.float()[:, None])
    return xf.to(x.dtype), h


def _define_norm_modulate():
    @torch.library.custom_op("kvgraph::norm_modulate", mutates_args=())
    def norm_modulate(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        """`LayerNorm(x) * (1 + scale)`: the block's first norm."""
        if x.is_cuda and x.is_contiguous() and scale.stride(-1) == 1:
            return _triton_norm_modulate(x, None, None, scale, eps)[1]
        return reference_norm_modulate(x, None, None, scale, eps)[1]

    @norm_modulate.register_fake
    def _(x, scale, eps):
        return torch.empty_like(x)

    return norm_modulate


def _define_residual_norm_modulate():
    @torch.library.custom_op("kvgraph::residual_norm_modulate", mutates_args=())
    def residual_norm_modulate(x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`x + tanh(gate) * delta` and `LayerNorm` of that `* (1 + scale)`: the attention residual and 2nd norm."""
        if x.is_cuda and x.is_contiguous() and delta.is_contiguous() and scale.stride(-1) == gate.stride(-1) == 1:
            return _triton_norm_modulate(x, delta, gate, scale, eps)
        return reference_norm_modulate(x, delta, gate, scale, eps)

    @residual_norm_modulate.register_fake
    def _(x, delta, gate, scale, eps):
        return torch.empty_like(x), torch.empty_like(x)

    return residual_norm_modulate


norm_modulate = define_once("norm_modulate", _define_norm_modulate)
residual_norm_modulate = define_once("residual_norm_modulate", _define_residual_norm_modulate)


def _triton_norm_modulate(x, delta, gate, scale, eps, fp8: bool = False, int8: bool = False, rotate: bool = False):
    """Returns `(x_new or None, h)`, or with `fp8` / `int8` `(x_new or None, h_8bit, h_scale [B, T, 1])` (`rotate`:
    the int8 rows rotated group-wise first, for ConvRot weights)."""
    wait_for_preload()
    import triton

    from .norm_modulate_triton import norm_modulate_kernel

    batch, tokens, dim = x.shape
    has_delta = delta is not None
    quantized = fp8 or int8
    x_new = torch.empty_like(x) if has_delta else None
    h_dtype = torch.float8_e4m3fn if fp8 else torch.int8 if int8 else x.dtype
    h = torch.empty_like(x, dtype=h_dtype)
    h_scale = torch.empty((batch, tokens, 1), dtype=torch.float32, device=x.device) if quantized else None
    block = triton.next_power_of_2(dim)
    if int8 and rotate:
        block = max(block, 256)
    # Without a residual the kernel never reads delta/gate or writes x_out, and without an 8-bit output it never
    # writes h_scale (HAS_DELTA, FP8_OUT and INT8_OUT are compile-time constants); any valid pointers fill those slots.
    norm_modulate_kernel[(batch * tokens,)](
        x, delta if has_delta else x, gate if has_delta else scale, scale, x_new if has_delta else x, h,
        h_scale if quantized else scale, tokens, dim, gate.stride(0) if has_delta else 0, scale.stride(0), eps,
        HAS_DELTA=has_delta, FP8_OUT=fp8, INT8_OUT=int8, ROTATE=int8 and rotate, BLOCK=block, num_warps=8)
    return (x_new, h, h_scale) if quantized else (x_new, h)
