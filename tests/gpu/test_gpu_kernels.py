"""Our hand-written kernels on the GPU in bf16 at the real model's sizes (q/k norm + RoPE + K/V write first).

The kernel keeps the eager body's roundings (normed -> bf16, x weight -> bf16, rotated in fp32 -> bf16), so it
should agree with the PyTorch math except where a different summation order of the 128-term mean moves a value
across a rounding boundary: one bf16 step of a normed channel (<= 2^-7 of its value), which the rotation carries
into both channels of its pair. Rotation preserves a pair's norm, so the bound per element is 2^-6 x the pair's
norm (two channels' worth plus the final rounding), and such flips touch a small fraction of elements.
"""

import pytest
import torch

from graph_runtime.kernels.qk_norm_rope import _triton_qk_norm_rope_write, reference_qk_norm_rope

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch,tokens,prefix", [(1, 1024, 128), (2, 300, 77)])
def test_kernel_matches_pytorch_math_in_bf16(batch, tokens, prefix):
    heads, head_dim, eps = 32, 128, 1e-6
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda")  # noqa: E731
    q, k, v = (rand(batch, tokens, heads * head_dim).bfloat16().unflatten(-1, (-1, head_dim)) for _ in range(3))
    q_weight, k_weight = (1 + 0.2 * rand(head_dim)).bfloat16(), (1 + 0.2 * rand(head_dim)).bfloat16()
    angles = rand(tokens, 1, head_dim // 2) * 10
    cos, sin = angles.cos(), angles.sin()
    k_cache = rand(batch, prefix + tokens, heads, head_dim).bfloat16()
    v_cache = rand(batch, prefix + tokens, heads, head_dim).bfloat16()
    prefix_k, prefix_v = k_cache[:, :prefix].clone(), v_cache[:, :prefix].clone()

    q_out = _triton_qk_norm_rope_write(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, prefix, eps)
    torch.cuda.synchronize()
    for got, want in [(q_out, reference_qk_norm_rope(q, q_weight, cos, sin, eps)),
                      (k_cache[:, prefix:], reference_qk_norm_rope(k, k_weight, cos, sin, eps))]:
        diff = (got.float() - want.float()).abs()
        pair_norm = want.float().unflatten(-1, (-1, 2)).norm(dim=-1).repeat_interleave(2, dim=-1)
        step = pair_norm * 2**-6
        assert bool((diff <= step).all()), f"max diff {diff.max().item()}"
        assert (diff > 0).float().mean().item() < 0.01
    assert torch.equal(v_cache[:, prefix:], v)
    assert torch.equal(k_cache[:, :prefix], prefix_k) and torch.equal(v_cache[:, :prefix], prefix_v)


@pytest.mark.parametrize("residual", [False, True], ids=["norm1", "residual+norm2"])
def test_norm_modulate_kernel_matches_fp32_math(residual):
    """Both roundings happen once, at the stores, so the kernel equals the fp32 math up to one bf16 step."""
    from graph_runtime.kernels.norm_modulate import _triton_norm_modulate, reference_norm_modulate

    g = torch.Generator(device="cuda").manual_seed(1)
    dim = 4096
    x = torch.randn(2, 333, dim, generator=g, device="cuda").bfloat16()
    delta = torch.randn(2, 333, dim, generator=g, device="cuda").bfloat16() if residual else None
    modulation = torch.randn(2, 4 * dim, generator=g, device="cuda").bfloat16()
    gate, scale = modulation[:, dim:2 * dim], modulation[:, 2 * dim:3 * dim]
    if not residual:
        gate = None
    got = _triton_norm_modulate(x, delta, gate, scale, 1e-6)
    want = reference_norm_modulate(x, delta, gate, scale, 1e-6)
    for a, b in zip(got, want):
        if b is None or a is None:
            continue
        diff = (a.float() - b.float()).abs()
        assert bool((diff <= b.float().abs() * 2**-7 + 1e-6).all()), f"max diff {diff.max().item()}"


def test_silu_mul_kernel_matches_fp32_math():
    """One rounding at the store, as the PyTorch fp32 math does: equal up to one bf16 step (exp's last-bit
    differences can move a value across a rounding boundary), over a size with a masked tail."""
    from graph_runtime.kernels.silu_mul import _triton_silu_mul, reference_silu_mul

    g = torch.Generator(device="cuda").manual_seed(2)
    gate = (4 * torch.randn(2, 333, 12288, generator=g, device="cuda")).bfloat16()
    up = torch.randn(2, 333, 12288, generator=g, device="cuda").bfloat16()
    got, want = _triton_silu_mul(gate, up), reference_silu_mul(gate, up)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= want.float().abs() * 2**-7 + 1e-6).all()), f"max diff {diff.max().item()}"
