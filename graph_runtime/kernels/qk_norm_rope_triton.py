"""The Triton side of `qk_norm_rope.py` (imported on first CUDA use; see that file for what and why)."""

import triton
import triton.language as tl


@triton.jit
def rotated_heads(src, w_ptr, cols, d, mask, cos, sin, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """`BLOCK_H` heads of one token RMS-normed, weighted and rotated: fp32 values, the eager body's roundings."""
    x = tl.load(src + cols, mask=mask).to(tl.float32)
    rrms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
    weight_dtype = w_ptr.dtype.element_ty
    w = tl.load(w_ptr + d).to(tl.float32)[None, :]
    normed = (x * rrms[:, None]).to(weight_dtype).to(tl.float32) * w
    normed = normed.to(weight_dtype).to(tl.float32)
    real, imag = tl.split(tl.reshape(normed, (BLOCK_H, HEAD_DIM // 2, 2)))
    return tl.interleave(real * cos - imag * sin, real * sin + imag * cos)


@triton.jit
def norm_rope_heads(src, dst, w_ptr, cols, d, mask, cos, sin, eps, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    out = rotated_heads(src, w_ptr, cols, d, mask, cos, sin, eps, HEAD_DIM, BLOCK_H)
    tl.store(dst + cols, out.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def to_e4m3(x, inv_scale):
    """`x / scale` saturated to e4m3's finite range (a value past it would otherwise become NaN)."""
    return tl.clamp(x * inv_scale, -448.0, 448.0).to(tl.float8e4nv)

# Token count and prefix length vary with the prompt: not specialized (one variant for every length; see
# kernels/__init__.py). The strides are multiples of heads x head_dim whatever the lengths, so theirs is stable.
@triton.jit(do_not_specialize=["tokens", "prefix_len"])
def qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr,
                        v_cache_ptr, tokens, heads, q_sb, q_st, k_sb, k_st, v_sb, v_st, kc_sb, kc_st, vc_sb,
                        vc_st, prefix_len, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    b = row // tokens
    t = row % tokens
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < heads)[:, None]
    cols = h[:, None] * HEAD_DIM + d[None, :]
    half = tl.arange(0, HEAD_DIM // 2)
    cos = tl.load(cos_ptr + t * (HEAD_DIM // 2) + half)[None, :]
    sin = tl.load(sin_ptr + t * (HEAD_DIM // 2) + half)[None, :]
    cache_row = prefix_len + t

    v = tl.load(v_ptr + b * v_sb + t * v_st + cols, mask=mask)
    tl.store(v_cache_ptr + b * vc_sb + cache_row * vc_st + cols, v, mask=mask)
    norm_rope_heads(q_ptr + b * q_sb + t * q_st, q_out_ptr + row * heads * HEAD_DIM, qw_ptr, cols, d, mask,
                    cos, sin, eps, HEAD_DIM, BLOCK_H)
    norm_rope_heads(k_ptr + b * k_sb + t * k_st, k_cache_ptr + b * kc_sb + cache_row * kc_st, kw_ptr, cols, d,
                    mask, cos, sin, eps, HEAD_DIM, BLOCK_H)


# The same pass writing e4m3: q and k (normed, rotated) and v each scaled by one inverse scale per head (`*_inv`,
# `[heads]` fp32), for FlashAttention-3's FP8 forward.
@triton.jit(do_not_specialize=["tokens", "prefix_len"])
def qk_norm_rope_fp8_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr,
                            v_cache_ptr, q_inv_ptr, k_inv_ptr, v_inv_ptr, tokens, heads, q_sb, q_st, k_sb, k_st,
                            v_sb, v_st, kc_sb, kc_st, vc_sb, vc_st, prefix_len, eps, HEAD_DIM: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    b = row // tokens
    t = row % tokens
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    live = h < heads
    mask = live[:, None]
    cols = h[:, None] * HEAD_DIM + d[None, :]
    half = tl.arange(0, HEAD_DIM // 2)
    cos = tl.load(cos_ptr + t * (HEAD_DIM // 2) + half)[None, :]
    sin = tl.load(sin_ptr + t * (HEAD_DIM // 2) + half)[None, :]
    cache_row = prefix_len + t
    q_inv = tl.load(q_inv_ptr + h, mask=live, other=1.0)[:, None]
    k_inv = tl.load(k_inv_ptr + h, mask=live, other=1.0)[:, None]
    v_inv = tl.load(v_inv_ptr + h, mask=live, other=1.0)[:, None]

    v = tl.load(v_ptr + b * v_sb + t * v_st + cols, mask=mask).to(tl.float32)
    tl.store(v_cache_ptr + b * vc_sb + cache_row * vc_st + cols, to_e4m3(v, v_inv), mask=mask)
    q = rotated_heads(q_ptr + b * q_sb + t * q_st, qw_ptr, cols, d, mask, cos, sin, eps, HEAD_DIM, BLOCK_H)
    tl.store(q_out_ptr + row * heads * HEAD_DIM + cols, to_e4m3(q, q_inv), mask=mask)
    k = rotated_heads(k_ptr + b * k_sb + t * k_st, kw_ptr, cols, d, mask, cos, sin, eps, HEAD_DIM, BLOCK_H)
    tl.store(k_cache_ptr + b * kc_sb + cache_row * kc_st + cols, to_e4m3(k, k_inv), mask=mask)
