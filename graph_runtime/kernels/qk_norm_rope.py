"""One pass over a block's fresh q/k/v: q/k RMSNorm, RoPE, and the target K/V written into the static buffer.

Inductor fuses these into a single reduction kernel too, but at the decode shapes that kernel runs at a quarter of
memory bandwidth: it reads the interleaved (real, imag) RoPE pairs with strided gathers and re-reads its input
across a looped reduction. Here each program owns whole 128-wide heads of one token, so the head's norm is a
register reduction and each byte moves once (the timings are in docs/performance.md).

Rounding follows the eager body (diffusers' `RMSNorm` then `apply_rotary_emb_qwen`): normed values are rounded
to the model dtype, scaled by the bf16/fp16 weight and rounded again, then rotated in fp32 and rounded once more.
The op is registered with `torch.library` so compiled blocks call it as one opaque kernel; the CPU (and any
non-CUDA) implementation is the plain PyTorch math, which the tests compare against.
"""

from __future__ import annotations

import torch

from . import define_once
from .preload import wait_for_preload


def reference_qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """`RMSNorm(x) -> RoPE` with the eager body's roundings; `x` `[B, T, H, D]`, `cos`/`sin` `[T, 1, D/2]`."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x * torch.rsqrt(variance + eps)).to(weight.dtype) * weight
    return rotate_pairs(normed, cos, sin).to(x.dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in real arithmetic (fp32 result): rotate the interleaved (real, imag) channel pairs of `x` `[..., D]`
    by `cos`/`sin` `[..., D/2]`, the products the reference's complex multiply computes."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2)


def _define_qk_norm_rope_write():
    @torch.library.custom_op("kvgraph::qk_norm_rope_write", mutates_args=("k_cache", "v_cache"))
    def qk_norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, prefix_len: int, eps: float) -> torch.Tensor:
        """q/k/v `[B, T, H, D]` (views of the projections) -> normed, rotated q `[B, T, H, D]`; the normed,
        rotated k and the plain v land in rows `prefix_len:` of `k_cache`/`v_cache` `[B, P + T, H, D]`."""
        if q.is_cuda and _triton_ok(q, k, v, k_cache, v_cache):
            return _triton_qk_norm_rope_write(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, prefix_len,
                                              eps)
        tokens = q.shape[1]
        k_cache[:, prefix_len:prefix_len + tokens].copy_(reference_qk_norm_rope(k, k_weight, cos, sin, eps))
        v_cache[:, prefix_len:prefix_len + tokens].copy_(v)
        return reference_qk_norm_rope(q, q_weight, cos, sin, eps)

    @qk_norm_rope_write.register_fake
    def _(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, prefix_len, eps):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    return qk_norm_rope_write


qk_norm_rope_write = define_once("qk_norm_rope_write", _define_qk_norm_rope_write)


def _triton_ok(*tensors) -> bool:
    # The kernel indexes heads and channels densely: the last two dims of every tensor must be packed.
    # tl.arange needs a power-of-two head size.
    head_dim = tensors[0].shape[-1]
    packed = all(t.stride(-1) == 1 and t.stride(-2) == head_dim for t in tensors)
    return packed and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _triton_qk_norm_rope_write(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, prefix_len, eps):
    wait_for_preload()
    batch, tokens, heads, head_dim = q.shape
    q_out = torch.empty((batch, tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    from .qk_norm_rope_triton import qk_norm_rope_kernel

    block_h = 8
    grid = (batch * tokens, -(-heads // block_h))
    qk_norm_rope_kernel[grid](
        q, k, v, q_weight, k_weight, cos.contiguous(), sin.contiguous(), q_out, k_cache, v_cache, tokens, heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), prefix_len, eps, HEAD_DIM=head_dim,
        BLOCK_H=block_h, num_warps=4)
    return q_out


# e4m3's largest finite value: a scale maps a tensor's bound onto it.
E4M3_MAX = 448.0


def norm_bound_scale(weight: torch.Tensor, head_dim: int) -> float:
    """A scale under which RMS-normed, weighted, rotated rows never leave e4m3's range: a normed head has 2-norm
    sqrt(head_dim), so no channel exceeds sqrt(head_dim) * max|weight|, and RoPE only rotates pairs. Static (it
    depends on the weights alone), so the kernel needs no pass over the rows to find it."""
    return float(norm_bound(weight, head_dim))


def norm_bound(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`norm_bound_scale` as a 0-d fp32 tensor on the weight's device (no host sync: a graph entry computes it on
    the device when it loads a prefix)."""
    return weight.detach().float().abs().amax() * (head_dim ** 0.5 * 1.01 / E4M3_MAX)


def quantize_heads_e4m3(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`[..., H, D]` times its per-head inverse scale `[H]`, saturated to e4m3's range, as e4m3 (the kernel's
    rounding: fp32 product, clamp, one rounding to e4m3)."""
    return (x.float() * inverse.float()[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _define_qk_norm_rope_write_fp8():
    @torch.library.custom_op("kvgraph::qk_norm_rope_write_fp8", mutates_args=("k_cache", "v_cache"))
    def qk_norm_rope_write_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                               k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, prefix_len: int, eps: float, q_inv: torch.Tensor,
                               k_inv: torch.Tensor, v_inv: torch.Tensor) -> torch.Tensor:
        """`qk_norm_rope_write` with e4m3 outputs: q `[B, T, H, D]` e4m3 returned, k and v written e4m3 into rows
        `prefix_len:` of `k_cache`/`v_cache`; each times its per-head inverse scale (`*_inv`: `[H]` fp32) and
        saturated to e4m3's range. The Triton kernel on CUDA; elsewhere the same math in PyTorch (the tests'
        reference)."""
        if q.is_cuda and _triton_ok(q, k, v, k_cache, v_cache):
            return _triton_qk_norm_rope_write_fp8(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache,
                                                  prefix_len, eps, q_inv, k_inv, v_inv)
        tokens = q.shape[1]
        rows = slice(prefix_len, prefix_len + tokens)
        k_cache[:, rows].copy_(quantize_heads_e4m3(reference_qk_norm_rope(k, k_weight, cos, sin, eps), k_inv))
        v_cache[:, rows].copy_(quantize_heads_e4m3(v, v_inv))
        return quantize_heads_e4m3(reference_qk_norm_rope(q, q_weight, cos, sin, eps), q_inv)

    @qk_norm_rope_write_fp8.register_fake
    def _(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, prefix_len, eps, q_inv, k_inv, v_inv):
        return torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)

    return qk_norm_rope_write_fp8


qk_norm_rope_write_fp8 = define_once("qk_norm_rope_write_fp8", _define_qk_norm_rope_write_fp8)


def _triton_qk_norm_rope_write_fp8(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, prefix_len, eps,
                                   q_inv, k_inv, v_inv):
    wait_for_preload()
    batch, tokens, heads, head_dim = q.shape
    q_out = torch.empty((batch, tokens, heads, head_dim), dtype=torch.float8_e4m3fn, device=q.device)
    from .qk_norm_rope_triton import qk_norm_rope_fp8_kernel

    block_h = 8
    grid = (batch * tokens, -(-heads // block_h))
    qk_norm_rope_fp8_kernel[grid](
        q, k, v, q_weight, k_weight, cos.contiguous(), sin.contiguous(), q_out, k_cache, v_cache, q_inv, k_inv, v_inv,
        tokens, heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), prefix_len, eps,
        HEAD_DIM=head_dim, BLOCK_H=block_h, num_warps=4)
    return q_out
