"""How a graph entry keeps its blocks' K/V: the *K/V format*, named in the entry's spec and, through the attention
kernel's name, in its graph key, so entries of two formats never mix.

- `native`: the model's dtype. The prefill writes the prefix rows straight into the `[B, P + T, H, D]` buffers and
  the decode step writes the target rows after them.
- `fp8`: e4m3 buffers for FlashAttention-3's FP8 forward (attention `fp8`, attention.py). The prefix pass still
  attends in the model's dtype (it runs once per prompt): it writes the prefix rows into a model-dtype staging copy
  (`prefix_k`/`prefix_v`, `[B, P, H, D]`; the request's prefix tensors are views of it), and loading the prefix into
  the entry quantizes them into rows `:P` of the e4m3 buffers. Each decode step's q/k norm + RoPE kernel writes
  e4m3 q (returned) and the target's e4m3 K/V rows itself (`qk_norm_rope_write_fp8`), so no quantization pass runs.

The per-head scales (fp32 device tensors in the entry, which the captured graph reads where they are), set each
time a prefix is loaded:
- q and k: the static bound of the block's RMSNorm weight (`norm_bound`: a normed head has 2-norm sqrt(D), RoPE only
  rotates pairs, so no channel exceeds sqrt(D) * max|weight|): nothing saturates, prefix and target rows alike.
- v: per head, the prefix's largest |v| over batch, rows and channels, times `V_HEADROOM`, over e4m3's largest value
  (448). The target's V rows are not known when the prefix is loaded (they change every step), so the headroom
  leaves them room: e4m3 is a float format, so the headroom costs precision only in values below 1/28672 of the
  scale's range (its subnormals). A target value beyond it saturates to +-448 times the scale rather than overflow.
  A head whose prefix V are all zero gets the scale of `MIN_V_AMAX`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.qk_norm_rope import E4M3_MAX, norm_bound, quantize_heads_e4m3

NATIVE = "native"
FP8 = "fp8"
KV_FORMATS = (NATIVE, FP8)

V_HEADROOM = 4.0
MIN_V_AMAX = 1e-3


class Fp8KV(NamedTuple):
    """One block's e4m3 K/V as the decode step reads them (the step's `k_cache` argument in the `fp8` format)."""

    k: torch.Tensor  # [B, P + T, H, D] e4m3
    v: torch.Tensor
    inverse: torch.Tensor  # [3, H] fp32: 1 / scale of q, k, v (what the kernel multiplies by)
    descale: torch.Tensor  # [3, B, H] fp32: the scales, as FlashAttention-3's descale arguments


def v_scales(v: torch.Tensor) -> torch.Tensor:
    """Per-head e4m3 scales `[H]` of a block's V from its prefix rows `[B, P, H, D]` (the rule above)."""
    amax = v.detach().float().abs().amax(dim=(0, 1, 3))
    return (amax * V_HEADROOM).clamp_min(MIN_V_AMAX) / E4M3_MAX


def fp8_bytes(batch: int, prefix_len: int, target_tokens: int, heads: int, head_dim: int, num_blocks: int,
              dtype: torch.dtype) -> int:
    """What an `fp8` entry's K/V take: e4m3 buffers, the model-dtype prefix staging, and the scales."""
    row = batch * heads * head_dim * 2 * num_blocks
    return row * (prefix_len + target_tokens) + row * prefix_len * dtype.itemsize + num_blocks * 3 * heads * (
        2 + batch) * 4


class Fp8KVStore:
    """An `fp8` entry's K/V: the e4m3 buffers, the prefix staging, the scales, and the norm weights that bound q/k.

    `norms`: per block, `(norm_q.weight, norm_k.weight)`, the parameters themselves, so a LoRA merged into them in
    place is seen the next time a prefix is loaded.
    """

    def __init__(self, batch: int, prefix_len: int, target_tokens: int, heads: int, head_dim: int, num_blocks: int,
                 dtype: torch.dtype, device, norms):
        if len(norms) != num_blocks:
            raise ValueError(f"fp8 K/V: {len(norms)} norm weight pairs for {num_blocks} blocks")
        shape = (batch, prefix_len + target_tokens, heads, head_dim)
        staging = (batch, prefix_len, heads, head_dim)
        self.prefix_len, self.head_dim, self.norms = prefix_len, head_dim, tuple(norms)
        self.k = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device) for _ in range(num_blocks)]
        self.v = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device) for _ in range(num_blocks)]
        self.prefix_k = [torch.zeros(staging, dtype=dtype, device=device) for _ in range(num_blocks)]
        self.prefix_v = [torch.zeros(staging, dtype=dtype, device=device) for _ in range(num_blocks)]
        self.scales = torch.ones((num_blocks, 3, heads), dtype=torch.float32, device=device)
        self.inverse = torch.ones_like(self.scales)
        self.descale = torch.ones((num_blocks, 3, batch, heads), dtype=torch.float32, device=device)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v, *self.prefix_k, *self.prefix_v, self.scales, self.inverse, self.descale]

    def block(self, i: int) -> Fp8KV:
        return Fp8KV(self.k[i], self.v[i], self.inverse[i], self.descale[i])

    @torch.no_grad()
    def load_prefix(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Set the scales from the norm weights and the prefix's V, and quantize the prefix rows `k`/`v` (per block,
        `[B, P, H, D]` in the model's dtype) into rows `:P`. On the device, no host sync."""
        prefix_len = self.prefix_len
        for i, ((q_weight, k_weight), k_rows, v_rows) in enumerate(zip(self.norms, k, v)):
            scales = self.scales[i]
            scales[0].copy_(norm_bound(q_weight, self.head_dim).expand_as(scales[0]))
            scales[1].copy_(norm_bound(k_weight, self.head_dim).expand_as(scales[1]))
            scales[2].copy_(v_scales(v_rows))
            torch.reciprocal(scales, out=self.inverse[i])
            self.descale[i].copy_(scales[:, None, :].expand_as(self.descale[i]))
            self.k[i][:, :prefix_len].copy_(quantize_heads_e4m3(k_rows, self.inverse[i, 1]))
            self.v[i][:, :prefix_len].copy_(quantize_heads_e4m3(v_rows, self.inverse[i, 2]))
