"""Per-token int8 activations for the INT8 W8A8 decode path, made where the activations are made.

The INT8 GEMM (`int8_gemm.py`) reads its input as int8 values with one fp32 scale per row (token),
`x ~= q * s`, `s = amax(|x_row|) / 127`, rounded half to even as comfy-kitchen's quantizer does. A ConvRot weight
(ComfyUI's INT8 files, and float files quantized at load) was rotated group-wise by a normalized Hadamard matrix, so
its input is rotated the same way before it is quantized (the rotations cancel in the product). Our kernels already
hold a whole row in registers when they produce a Linear's input, so they rotate and quantize it there, with no
pass of its own over the activations:

- `norm_modulate_int8` / `residual_norm_modulate_int8` (norm_modulate.py's kernel with its int8 output on): the
  inputs of q/k/v and of the MLP's gate/up projections;
- `silu_mul_int8`: the SwiGLU product, the input of the MLP's down projection;
- `quantize_rows_int8`: any other input (the attention output into `to_out`, or a Linear called by code that is
  not ours), one small pass.

The CPU (and any non-CUDA) implementation is the same math in PyTorch, the rotation in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import define_once
from .norm_modulate import reference_norm_modulate_fp32
from .preload import wait_for_preload

INT8_MAX = 127.0
MIN_SCALE = 1e-12
CONVROT_GROUP = 256  # the one rotation group the fused kernels implement (what ComfyUI's files use)


class Int8Rows(NamedTuple):
    """An activation `[..., K]` as int8 `data` and fp32 per-row `scale` `[..., 1]`: `value ~= data * scale`;
    `rotated` says whether the rows were rotated group-wise (ConvRot) before quantizing."""

    data: torch.Tensor
    scale: torch.Tensor
    rotated: bool
    dtype: torch.dtype  # the float dtype the rows stand for: the GEMM's output dtype
    # Recognized by this marker, not by class: the pack may be imported twice in one process.
    kvgraph_int8_rows = True

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale).to(dtype)


def is_int8_rows(value) -> bool:
    return getattr(type(value), "kvgraph_int8_rows", False)


def hadamard(group: int = CONVROT_GROUP, device=None) -> torch.Tensor:
    """comfy-kitchen's normalized regular Hadamard matrix (Kronecker powers of its 4x4 block), in fp32."""
    block = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
    h = block
    while h.shape[0] < group:
        h = torch.kron(h, block)
    if h.shape[0] != group:
        raise ValueError(f"ConvRot group {group} is not a power of 4")
    return (h / group ** 0.5).to(device)


def reference_rotate(x: torch.Tensor, group: int = CONVROT_GROUP) -> torch.Tensor:
    """`x` `[..., K]` rotated group-wise in fp32 (K a multiple of `group`)."""
    xf = x.float()
    grouped = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group, group)
    return (grouped @ hadamard(group, x.device)).reshape(xf.shape)


def reference_quantize_rows_int8(x: torch.Tensor, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any float dtype, computed in fp32; rotated first with `rotate`) -> (int8 `[..., K]`, fp32 `[..., 1]`)."""
    xf = reference_rotate(x) if rotate else x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def _on_triton(*tensors) -> bool:
    import os

    on_gpu = all(t.is_cuda and t.is_contiguous() for t in tensors)
    return on_gpu or os.environ.get("TRITON_INTERPRET") == "1"


def _rotatable(cols: int) -> bool:
    return cols % CONVROT_GROUP == 0


def _define_norm_modulate_int8():
    @torch.library.custom_op("kvgraph::norm_modulate_int8", mutates_args=())
    def norm_modulate_int8(x: torch.Tensor, scale: torch.Tensor, eps: float,
                           rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`LayerNorm(x) * (1 + scale)` as per-token int8 + scales (the block's first norm)."""
        if _on_triton(x) and scale.stride(-1) == 1 and (not rotate or _rotatable(x.shape[-1])):
            from .norm_modulate import _triton_norm_modulate

            _, h, h_scale = _triton_norm_modulate(x, None, None, scale, eps, int8=True, rotate=rotate)
            return h, h_scale
        return reference_quantize_rows_int8(reference_norm_modulate_fp32(x, None, None, scale, eps)[1], rotate)

    @norm_modulate_int8.register_fake
    def _(x, scale, eps, rotate):
        return torch.empty_like(x, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)

    return norm_modulate_int8


def _define_residual_norm_modulate_int8():
    @torch.library.custom_op("kvgraph::residual_norm_modulate_int8", mutates_args=())
    def residual_norm_modulate_int8(x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor,
                                    eps: float, rotate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x + tanh(gate) * delta` (in x's dtype) and its `LayerNorm * (1 + scale)` as per-token int8 + scales."""
        if (_on_triton(x, delta) and scale.stride(-1) == gate.stride(-1) == 1
                and (not rotate or _rotatable(x.shape[-1]))):
            from .norm_modulate import _triton_norm_modulate

            return _triton_norm_modulate(x, delta, gate, scale, eps, int8=True, rotate=rotate)
        x_new, h = reference_norm_modulate_fp32(x, delta, gate, scale, eps)
        return (x_new, *reference_quantize_rows_int8(h, rotate))

    @residual_norm_modulate_int8.register_fake
    def _(x, delta, gate, scale, eps, rotate):
        return (torch.empty_like(x), torch.empty_like(x, dtype=torch.int8),
                x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))

    return residual_norm_modulate_int8


def _define_quantize_rows_int8():
    @torch.library.custom_op("kvgraph::quantize_rows_int8", mutates_args=())
    def quantize_rows_int8(x: torch.Tensor, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Any activation `[..., K]` as per-token int8 + scales, rotated first with `rotate`."""
        if _on_triton(x) and (not rotate or _rotatable(x.shape[-1])):
            from .int8_quant_triton import quantize_rows_int8_kernel

            out, scale, rows, cols = _row_outputs(x)
            block = _block(cols, rotate)
            quantize_rows_int8_kernel[(rows,)](x, out, scale, rows, cols, ROTATE=rotate, BLOCK=block,
                                               num_warps=_warps(block))
            return out, scale
        return reference_quantize_rows_int8(x, rotate)

    @quantize_rows_int8.register_fake
    def _(x, rotate):
        return (torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format),
                x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))

    return quantize_rows_int8


def _define_silu_mul_int8():
    @torch.library.custom_op("kvgraph::silu_mul_int8", mutates_args=())
    def silu_mul_int8(gate: torch.Tensor, up: torch.Tensor, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`silu(gate) * up` as per-token int8 + scales, rotated first with `rotate`."""
        if _on_triton(gate, up) and gate.shape == up.shape and (not rotate or _rotatable(gate.shape[-1])):
            from .int8_quant_triton import silu_mul_int8_kernel

            out, scale, rows, cols = _row_outputs(gate)
            part, parts = row_parts(cols, rotate)
            silu_mul_int8_kernel[(rows,)](gate, up, out, scale, rows, cols, ROTATE=rotate, PART=part, PARTS=parts,
                                          num_warps=_warps(part * parts))
            return out, scale
        return reference_quantize_rows_int8(torch.nn.functional.silu(gate.float()) * up.float(), rotate)

    @silu_mul_int8.register_fake
    def _(gate, up, rotate):
        return (torch.empty_like(gate, dtype=torch.int8, memory_format=torch.contiguous_format),
                gate.new_empty((*gate.shape[:-1], 1), dtype=torch.float32))

    return silu_mul_int8


_norm_modulate_int8 = define_once("norm_modulate_int8", _define_norm_modulate_int8)
_residual_norm_modulate_int8 = define_once("residual_norm_modulate_int8", _define_residual_norm_modulate_int8)
_quantize_rows_int8 = define_once("quantize_rows_int8", _define_quantize_rows_int8)
_silu_mul_int8 = define_once("silu_mul_int8", _define_silu_mul_int8)


def norm_modulate_int8(x, scale, eps, rotate: bool) -> Int8Rows:
    return Int8Rows(*_norm_modulate_int8(x, scale, eps, rotate), rotate, x.dtype)


def residual_norm_modulate_int8(x, delta, gate, scale, eps, rotate: bool) -> tuple[torch.Tensor, Int8Rows]:
    x_new, h, h_scale = _residual_norm_modulate_int8(x, delta, gate, scale, eps, rotate)
    return x_new, Int8Rows(h, h_scale, rotate, x.dtype)


def quantize_rows_int8(x, rotate: bool) -> Int8Rows:
    return Int8Rows(*_quantize_rows_int8(x.contiguous(), rotate), rotate, x.dtype)


def silu_mul_int8(gate, up, rotate: bool) -> Int8Rows:
    return Int8Rows(*_silu_mul_int8(gate, up, rotate), rotate, gate.dtype)


def row_parts(cols: int, rotate: bool) -> tuple[int, int]:
    """How a row of `cols` values is held in a program's registers: `(part, parts)`, `parts` power-of-two blocks of
    `part` values. Three exact parts for a row three times a power of two wide (the MLP's), else one block padded
    to a power of two (at least a rotation group when rotating)."""
    third = cols // 3
    if cols % 3 == 0 and third & (third - 1) == 0 and third >= (CONVROT_GROUP if rotate else 16):
        return third, 3
    return _block(cols, rotate), 1


def _block(cols: int, rotate: bool) -> int:
    import triton

    return max(triton.next_power_of_2(cols), CONVROT_GROUP if rotate else 16)


def _warps(values: int) -> int:
    # A whole row per program, in registers: 24 fp32 values per thread at the MLP's 12288-wide rows.
    return 16 if values >= 8192 else 8


def _row_outputs(x):
    """The int8 rows and scales a row kernel writes for `x` `[..., cols]`, and the row and column counts."""
    wait_for_preload()
    cols = x.shape[-1]
    out = torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    return out, scale, x.numel() // cols, cols
