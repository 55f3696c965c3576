"""Prefix K/V kept as int8 with one fp32 scale per token and head, and read back as the model's dtype.

Quantized once per block after the prefill (PyTorch ops: it runs once per prompt), dequantized before every decode
step's attention of that block into a working buffer: on CUDA by one Triton pass (a handful of rows per program,
each row one token of one head), elsewhere by the same math in PyTorch. Both compute `int8 * scale` in fp32 and
round once to the destination dtype, so the two give the same values. Rounding: each value is off by at most half
its row's scale, `amax / 254`, plus the destination dtype's rounding.
"""

from __future__ import annotations

import torch

from .preload import wait_for_preload

QMAX = 127
# Rows per program of the dequantize kernel (ROWS x head_dim values).
ROWS = 16


def quantize_rows(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    """Write `x` `[..., D]` as int8 into `out` and its per-row scales (`amax / 127`, fp32) into `scale` `[..., 1]`."""
    values = x.float()
    step = values.abs().amax(dim=-1, keepdim=True).div_(QMAX)
    # An all-zero row keeps a zero scale: its int8 values are 0 and it dequantizes to 0 exactly.
    scale.copy_(step)
    # Not in place: `x.float()` is `x` itself for fp32 rows.
    out.copy_((values / step.clamp_min(torch.finfo(torch.float32).tiny)).round_().clamp_(-QMAX, QMAX))


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dst: torch.Tensor) -> None:
    """`dst[...] = q * scale` in `dst`'s dtype. `q` `[B, P, H, D]` int8 and `scale` `[B, P, H, 1]` are contiguous;
    `dst` is `[B, P, H, D]` with each batch contiguous (the prefix rows of a `[B, P + T, H, D]` buffer)."""
    batch = q.shape[0]
    rows_per_batch = q[0].numel() // q.shape[-1]
    head_dim = q.shape[-1]
    fits = head_dim & (head_dim - 1) == 0 and q.is_contiguous() and scale.is_contiguous()
    if q.is_cuda and fits and all(dst[b].is_contiguous() for b in range(batch)):
        wait_for_preload()
        import triton

        from .kv_int8_triton import dequantize_rows_kernel

        rows = batch * rows_per_batch
        dequantize_rows_kernel[(triton.cdiv(rows, ROWS),)](q, scale, dst, rows, rows_per_batch, dst.stride(0),
                                                            D=head_dim, ROWS=ROWS, num_warps=4)
        return
    dst.copy_(reference_dequantize(q, scale, dst.dtype))
