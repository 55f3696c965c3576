"""Per-token FP8 (e4m3) activations for the FP8 decode path, made where the activations are made.

An FP8 GEMM (`fp8/linear.py`) reads its input as e4m3 values with one fp32 scale per row (token): `x ~= q * s`,
`s = amax(|x_row|) / 448`. Our kernels already hold a whole row in registers when they produce a Linear's input,
so they quantize it there, from fp32, with no pass of its own over the activations:

- `norm_modulate_fp8` / `residual_norm_modulate_fp8`: the block's two LayerNorm + modulation passes (inputs of
  q/k/v and of the MLP's gate/up projections), `norm_modulate.py`'s kernel with its FP8 output on;
- `silu_mul_fp8`: the SwiGLU product (input of the MLP's down projection), one row per program;
- `quantize_rows_fp8`: any other input (the attention output into `to_out`, or a Linear called by code that is not
  ours), one small pass.

The CPU (and any non-CUDA) implementation is the same math in PyTorch (`torch.Tensor.to(float8_e4m3fn)` rounds to
nearest even, as the GPU's conversion does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import define_once
from .fp8_format import FP8_MAX, MIN_SCALE  # noqa: F401 - the quantization's constants, read here and by callers
from .norm_modulate import reference_norm_modulate_fp32
from .preload import wait_for_preload

FP8_DTYPE = torch.float8_e4m3fn
# The Triton launchers (the first-prompt profile times their first calls).
TRITON_LAUNCHERS = ("_triton_silu_mul_fp8", "_triton_quantize_rows")


class Fp8Rows(NamedTuple):
    """An activation `[..., K]` as e4m3 `data` and fp32 per-row `scale` `[..., 1]`: `value ~= data * scale`."""

    data: torch.Tensor
    scale: torch.Tensor
    # Recognized by this marker, not by class: a caller need not import this module to tell.
    kvgraph_fp8_rows = True

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale).to(dtype)


def reference_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any float dtype, computed in fp32) -> (e4m3 `[..., K]`, fp32 scales `[..., 1]`)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).to(FP8_DTYPE), scale


def _cuda_rows(*tensors) -> bool:
    return all(t.is_cuda and t.is_contiguous() for t in tensors)


def _define_norm_modulate_fp8():
    @torch.library.custom_op("kvgraph::norm_modulate_fp8", mutates_args=())
    def norm_modulate_fp8(x: torch.Tensor, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`LayerNorm(x) * (1 + scale)` as per-token e4m3 + scales (the block's first norm)."""
        if _cuda_rows(x) and scale.stride(-1) == 1:
            from .norm_modulate import _triton_norm_modulate

            _, h, h_scale = _triton_norm_modulate(x, None, None, scale, eps, fp8=True)
            return h, h_scale
        return reference_quantize_rows(reference_norm_modulate_fp32(x, None, None, scale, eps)[1])

    @norm_modulate_fp8.register_fake
    def _(x, scale, eps):
        return torch.empty_like(x, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)

    return norm_modulate_fp8


def _define_residual_norm_modulate_fp8():
    @torch.library.custom_op("kvgraph::residual_norm_modulate_fp8", mutates_args=())
    def residual_norm_modulate_fp8(x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
                                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x + tanh(gate) * delta` (in x's dtype) and its `LayerNorm * (1 + scale)` as per-token e4m3 + scales."""
        if _cuda_rows(x, delta) and scale.stride(-1) == gate.stride(-1) == 1:
            from .norm_modulate import _triton_norm_modulate

            return _triton_norm_modulate(x, delta, gate, scale, eps, fp8=True)
        x_new, h = reference_norm_modulate_fp32(x, delta, gate, scale, eps)
        return (x_new, *reference_quantize_rows(h))

    @residual_norm_modulate_fp8.register_fake
    def _(x, delta, gate, scale, eps):
        return (torch.empty_like(x), torch.empty_like(x, dtype=FP8_DTYPE),
                x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))

    return residual_norm_modulate_fp8


def _define_silu_mul_fp8():
    @torch.library.custom_op("kvgraph::silu_mul_fp8", mutates_args=())
    def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`silu(gate) * up` as per-token e4m3 + scales."""
        if _cuda_rows(gate, up) and gate.shape == up.shape:
            return _triton_silu_mul_fp8(gate, up)
        return reference_quantize_rows(torch.nn.functional.silu(gate.float()) * up.float())

    @silu_mul_fp8.register_fake
    def _(gate, up):
        return (torch.empty_like(gate, dtype=FP8_DTYPE, memory_format=torch.contiguous_format),
                gate.new_empty((*gate.shape[:-1], 1), dtype=torch.float32))

    return silu_mul_fp8


def _define_quantize_rows_fp8():
    @torch.library.custom_op("kvgraph::quantize_rows_fp8", mutates_args=())
    def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Any activation `[..., K]` as per-token e4m3 + scales."""
        if _cuda_rows(x):
            return _triton_quantize_rows(x)
        return reference_quantize_rows(x)

    @quantize_rows_fp8.register_fake
    def _(x):
        return (torch.empty_like(x, dtype=FP8_DTYPE, memory_format=torch.contiguous_format),
                x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))

    return quantize_rows_fp8


_norm_modulate_fp8 = define_once("norm_modulate_fp8", _define_norm_modulate_fp8)
_residual_norm_modulate_fp8 = define_once("residual_norm_modulate_fp8", _define_residual_norm_modulate_fp8)
_silu_mul_fp8 = define_once("silu_mul_fp8", _define_silu_mul_fp8)
_quantize_rows_fp8 = define_once("quantize_rows_fp8", _define_quantize_rows_fp8)


def norm_modulate_fp8(x, scale, eps) -> Fp8Rows:
    return Fp8Rows(*_norm_modulate_fp8(x, scale, eps))


def residual_norm_modulate_fp8(x, delta, gate, scale, eps) -> tuple[torch.Tensor, Fp8Rows]:
    x_new, h, h_scale = _residual_norm_modulate_fp8(x, delta, gate, scale, eps)
    return x_new, Fp8Rows(h, h_scale)


def silu_mul_fp8(gate, up) -> Fp8Rows:
    return Fp8Rows(*_silu_mul_fp8(gate, up))


def quantize_rows_fp8(x) -> Fp8Rows:
    return Fp8Rows(*_quantize_rows_fp8(x.contiguous()))


def _rows_launch(kernel, x, *others):
    wait_for_preload()
    import triton

    cols = x.shape[-1]
    rows = x.numel() // cols
    out = torch.empty_like(x, dtype=FP8_DTYPE)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols)
    # A whole row per program, in registers: ~32 fp32 values per thread at the MLP's 12288 wide rows.
    kernel[(rows,)](x, *others, out, scale, rows, cols, BLOCK=block, num_warps=16 if block >= 8192 else 8)
    return out, scale


def _triton_silu_mul_fp8(gate, up):
    from .fp8_quant_triton import silu_mul_fp8_kernel

    return _rows_launch(silu_mul_fp8_kernel, gate, up)


def _triton_quantize_rows(x):
    from .fp8_quant_triton import quantize_rows_kernel

    return _rows_launch(quantize_rows_kernel, x)
