"""Our kernels (`graph_runtime/kernels`) against the eager body's own modules.

On CPU the op runs its PyTorch math; the Triton kernel itself is run here through Triton's interpreter (fp32, so
the comparison is about indexing: which head, which channel pair, which cache row), and on the GPU in bf16 by
tests/gpu. fp32 tolerance 1e-5: the two sides differ only in summation order of a 16-128 term mean; a wrong
pair, head or row is off by O(1).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from diffusers.models.normalization import RMSNorm

from graph_runtime.decode.step import TargetDecodeBlock, apply_rope, rope_tables
from graph_runtime.kernels.qk_norm_rope import qk_norm_rope_write

ATOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


def _run_interpreted(script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter with Triton's interpreter on (it must be set before triton is imported),
    from the repository root."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _inputs(batch=2, tokens=5, heads=3, head_dim=16, prefix=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, tokens, heads * head_dim, generator=g).unflatten(-1, (-1, head_dim))
               for _ in range(3))
    angles = torch.randn(tokens, head_dim // 2, generator=g)
    cos, sin = rope_tables(torch.polar(torch.ones_like(angles), angles))
    norm_q, norm_k = RMSNorm(head_dim, eps=1e-6), RMSNorm(head_dim, eps=1e-6)
    with torch.no_grad():
        norm_q.weight.normal_(1.0, 0.2, generator=g)
        norm_k.weight.normal_(1.0, 0.2, generator=g)
    k_cache = torch.randn(batch, prefix + tokens, heads, head_dim, generator=g)
    v_cache = torch.randn(batch, prefix + tokens, heads, head_dim, generator=g)
    return q, k, v, norm_q, norm_k, cos, sin, k_cache, v_cache, prefix


def test_op_equals_eager_modules_and_writes_only_target_rows():
    """q out == RoPE(norm_q(q)); cache rows P: == RoPE(norm_k(k)) and v; prefix rows 0:P unchanged."""
    q, k, v, norm_q, norm_k, cos, sin, k_cache, v_cache, prefix = _inputs()
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with torch.no_grad():
        q_out = qk_norm_rope_write(q, k, v, norm_q.weight, norm_k.weight, cos, sin, k_cache, v_cache, prefix, 1e-6)
        expected_q = apply_rope(norm_q(q), cos, sin)
        expected_k = apply_rope(norm_k(k), cos, sin)
    torch.testing.assert_close(q_out, expected_q, atol=ATOL, rtol=0)
    torch.testing.assert_close(k_cache[:, prefix:], expected_k, atol=ATOL, rtol=0)
    torch.testing.assert_close(v_cache[:, prefix:], v, atol=0, rtol=0)
    assert torch.equal(k_cache[:, :prefix], k_before[:, :prefix])
    assert torch.equal(v_cache[:, :prefix], v_before[:, :prefix])


def test_triton_kernel_through_interpreter():
    """The Triton kernel's indexing (heads, channel pairs, batch and cache rows) equals the PyTorch math."""
    pytest.importorskip("triton", reason="triton is not installed with this torch build")
    script = textwrap.dedent("""
        import torch
        from graph_runtime.kernels import qk_norm_rope as m
        from tests.test_kernels import _inputs
        for head_dim, heads in [(16, 3), (128, 9)]:
            q, k, v, nq, nk, cos, sin, kc, vc, p = _inputs(heads=heads, head_dim=head_dim, seed=head_dim)
            kc2, vc2 = kc.clone(), vc.clone()
            with torch.no_grad():
                got = m._triton_qk_norm_rope_write(q, k, v, nq.weight, nk.weight, cos, sin, kc, vc, p, 1e-6)
                want = m.qk_norm_rope_write(q, k, v, nq.weight, nk.weight, cos, sin, kc2, vc2, p, 1e-6)
            for a, b in [(got, want), (kc, kc2), (vc, vc2)]:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        print("ok")
    """)
    done = _run_interpreted(script)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_norm_modulate_kernel_through_interpreter():
    """The residual + LayerNorm + modulation kernel (rows, batch-strided gate/scale, a non-power-of-two width)
    equals its PyTorch math, with and without the residual."""
    pytest.importorskip("triton", reason="triton is not installed with this torch build")
    script = textwrap.dedent("""
        import torch
        from graph_runtime.kernels import norm_modulate as m
        g = torch.Generator().manual_seed(0)
        for dim in (32, 100):
            x, d = torch.randn(2, 5, dim, generator=g), torch.randn(2, 5, dim, generator=g)
            mod = torch.randn(2, 4 * dim, generator=g)
            gate, scale = mod[:, dim:2 * dim], mod[:, 2 * dim:3 * dim]
            for got, want in zip(m._triton_norm_modulate(x, d, gate, scale, 1e-6),
                                 m.reference_norm_modulate(x, d, gate, scale, 1e-6)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            got = m._triton_norm_modulate(x, None, None, scale, 1e-6)[1]
            torch.testing.assert_close(got, m.reference_norm_modulate(x, None, None, scale, 1e-6)[1], atol=1e-5,
                                       rtol=0)
        print("ok")
    """)
    done = _run_interpreted(script)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_silu_mul_kernel_through_interpreter():
    """The SwiGLU product kernel equals its PyTorch math over a size that is not a multiple of its block (the
    masked tail) and for a batch of rows."""
    pytest.importorskip("triton", reason="triton is not installed with this torch build")
    script = textwrap.dedent("""
        import torch
        from graph_runtime.kernels import silu_mul as m
        g = torch.Generator().manual_seed(0)
        for shape in [(3, 700), (2, 5, 48)]:
            gate, up = torch.randn(*shape, generator=g) * 4, torch.randn(*shape, generator=g)
            torch.testing.assert_close(m._triton_silu_mul(gate, up), m.reference_silu_mul(gate, up), atol=1e-6,
                                       rtol=1e-6)
        print("ok")
    """)
    done = _run_interpreted(script)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_silu_mul_fp8_kernel_through_interpreter():
    """The SwiGLU product quantized per row to e4m3 (the FP8 MLP's down-projection input): its row scales, the
    product's row maximum / 448, equal the PyTorch math's to fp32 rounding (the kernel's exp may differ from torch's in
    the last bit: 1e-6 relative). The e4m3 values themselves are compared on the GPU
    (tests/gpu/test_gpu_fp8.py): the interpreter casts to e4m3 through its own software conversion, which rounds some
    values (powers of two, values near zero) differently from the GPU and torch."""
    pytest.importorskip("triton", reason="triton is not installed with this torch build")
    script = textwrap.dedent("""
        import torch
        from graph_runtime.kernels import fp8_quant as m
        g = torch.Generator().manual_seed(0)
        for shape in [(3, 700), (2, 5, 48)]:
            gate, up = torch.randn(*shape, generator=g) * 4, torch.randn(*shape, generator=g)
            values, scale = m._triton_silu_mul_fp8(gate, up)
            _, ref_scale = m.reference_quantize_rows(torch.nn.functional.silu(gate) * up)
            torch.testing.assert_close(scale, ref_scale, atol=0, rtol=1e-6)
            assert values.dtype == torch.float8_e4m3fn and values.shape == gate.shape
        print("ok")
    """)
    done = _run_interpreted(script)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


class _Doubled(torch.nn.Module):
    """A stand-in for a patched module (a norm, an MLP): not diffusers' own class, so the block must call it rather
    than fuse; its x2 shows in the output."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2.0


def test_block_mlp_equals_the_module_and_calls_a_replaced_one(tiny_models):
    """With our kernels the block's MLP (its projections, then the one-pass SwiGLU product) equals diffusers'
    module; a replaced MLP module is called as itself."""
    import copy

    block = copy.deepcopy(tiny_models.transformer.transformer_blocks[0])
    wrapped = TargetDecodeBlock(block)
    h = torch.randn(2, 5, block.attn.inner_dim, generator=torch.Generator().manual_seed(3))
    assert wrapped._can_fuse_mlp() and not TargetDecodeBlock(block, kernels=False)._can_fuse_mlp()
    with torch.no_grad():
        torch.testing.assert_close(wrapped.mlp(h), block.img_mlp(h), atol=ATOL, rtol=0)

    block.img_mlp = _Doubled(block.img_mlp)
    assert not wrapped._can_fuse_mlp()
    with torch.no_grad():
        torch.testing.assert_close(wrapped.mlp(h), 2.0 * block.img_mlp.inner(h), atol=ATOL, rtol=0)


def _block_inputs(block, batch, seed, tokens=4, prefix=3):
    """x, modulation, RoPE tables and prefix K/V for one block call of `tokens` targets after `prefix` keys."""
    heads, head_dim = block.attn.heads, block.attn.inner_dim // block.attn.heads
    dim = block.attn.inner_dim
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, dim, generator=g)
    modulation = torch.randn(batch, 4 * dim, generator=g) * 0.3
    angles = torch.randn(tokens, head_dim // 2, generator=g)
    cos, sin = rope_tables(torch.polar(torch.ones_like(angles), angles))
    prefix_k = torch.randn(batch, prefix, heads, head_dim, generator=g)
    prefix_v = torch.randn(batch, prefix, heads, head_dim, generator=g)
    return x, modulation, cos, sin, prefix_k, prefix_v


def _finish(x, pending):
    """The residual stream after a block: its handed-on MLP residual added as the reference adds it."""
    delta, gate = pending
    return x + gate.tanh() * delta


def test_block_norms_equal_the_modules(tiny_models):
    """The block's fused residual + norm path (the CPU op) equals running diffusers' LayerNorm modules, for a first
    block (no residual handed in) and for a later one (the previous block's MLP residual added in its first norm)."""
    import copy

    block = copy.deepcopy(tiny_models.transformer.transformer_blocks[0])
    fused, plain = TargetDecodeBlock(block), TargetDecodeBlock(block, kernels=False)
    assert fused._can_fuse_norms() and not plain._can_fuse_norms()
    x, modulation, cos, sin, prefix_k, prefix_v = _block_inputs(block, batch=2, seed=2)
    handed_in = (torch.randn_like(x), modulation[:, None, :x.shape[-1]].flip(-1))
    for pending in (None, handed_in):
        with torch.no_grad():
            a = fused(x, pending, modulation, cos, sin, prefix_k, prefix_v, 3, False, None)
            b = plain(x, pending, modulation, cos, sin, prefix_k, prefix_v, 3, False, None)
        torch.testing.assert_close(a[0], b[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(_finish(*a), _finish(*b), atol=ATOL, rtol=0)


def test_handed_on_residual_equals_the_reference_blocks(tiny_models):
    """Two blocks chained through their handed-on MLP residual give diffusers' blocks' residual stream: the add
    moved into the next block's norm, not changed. In fp16 the add stays unfused and keeps the reference's clip to
    fp16's range (a stream past 65504 would otherwise reach the next norm as inf)."""
    import copy

    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVLayerCache

    blocks = [copy.deepcopy(b) for b in tiny_models.transformer.transformer_blocks[:2]]
    x, modulation, cos, sin, _, _ = _block_inputs(blocks[0], batch=1, seed=5)
    tokens, heads = x.shape[1], blocks[0].attn.heads
    empty = x.new_zeros(1, 0, heads, blocks[0].attn.inner_dim // heads)
    rotary = torch.polar(torch.ones_like(cos[:, 0]), torch.atan2(sin[:, 0], cos[:, 0]))
    with torch.no_grad():
        expected = x
        for block in blocks:
            expected = block(expected, modulation, rotary_emb=rotary,
                             layer_cache=QwenImage21KVLayerCache(), kv_cache_mode=None)
        for kernels in (True, False):
            stream, pending = x, None
            for block in blocks:
                stream, pending = TargetDecodeBlock(block, kernels)(stream, pending, modulation, cos, sin, empty,
                                                                     empty, 0, False, None)
            torch.testing.assert_close(_finish(stream, pending), expected, atol=ATOL, rtol=1e-4)

        half = TargetDecodeBlock(copy.deepcopy(blocks[0]).half())
        big = torch.full((1, tokens, x.shape[-1]), 60000.0, dtype=torch.float16)
        gate = torch.full((1, 1, x.shape[-1]), 10.0, dtype=torch.float16)
        stream, _ = half(big, (big, gate), modulation.half(), cos, sin, empty.half(), empty.half(), 0, False, None)
        assert torch.isfinite(stream).all() and stream.max() == 65504


def test_block_calls_a_replaced_norm_instead_of_fusing(tiny_models):
    """A block whose norm_q was replaced by another module runs that module (its x2 shows in the output)."""
    import copy

    block = copy.deepcopy(tiny_models.transformer.transformer_blocks[0])
    wrapped = TargetDecodeBlock(block)
    assert wrapped._can_fuse_qk()
    block.attn.norm_q = _Doubled(block.attn.norm_q)
    assert not wrapped._can_fuse_qk()
    x, modulation, cos, sin, prefix_k, prefix_v = _block_inputs(block, batch=1, seed=1)
    with torch.no_grad():
        target_rows = torch.zeros_like(prefix_k[:, :1]).expand(-1, x.shape[1], -1, -1)
        k_cache, v_cache = torch.cat([prefix_k, target_rows], dim=1), torch.cat([prefix_v, target_rows], dim=1)
        static = _finish(*wrapped(x, None, modulation, cos, sin, k_cache, v_cache, 3, True, None))
        concat = _finish(*wrapped(x, None, modulation, cos, sin, prefix_k, prefix_v, 3, False, None))
        block.attn.norm_q = block.attn.norm_q.inner
        unpatched = _finish(*wrapped(x, None, modulation, cos, sin, prefix_k, prefix_v, 3, False, None))
    torch.testing.assert_close(static, concat, atol=ATOL, rtol=0)
    assert (static - unpatched).abs().max() > 1e-3


_FORCED_KERNELS_SCRIPT = textwrap.dedent("""
    import torch
    from graph_runtime.kernels import norm_modulate as nm, qk_norm_rope as qm, silu_mul as sm
    from graph_runtime.decode import DecodeEngine, TokenLayout
    from graph_runtime.sampling.sampler import initial_noise, pack
    from graph_runtime.tiny import build_tiny_components
    from tests.test_graph_manager import RecordingBackend

    calls = []
    def qk(q, k, v, qw, kw, cos, sin, kc, vc, p, eps):
        calls.append("qk")
        assert qm._triton_ok(q, k, v, kc, vc)
        return qm._triton_qk_norm_rope_write(q, k, v, qw, kw, cos, sin, kc, vc, p, eps)
    def norm(x, scale, eps):
        calls.append("norm")
        return nm._triton_norm_modulate(x, None, None, scale, eps)[1]
    def residual(x, delta, gate, scale, eps):
        calls.append("residual")
        return nm._triton_norm_modulate(x, delta, gate, scale, eps)
    def product(gate, up):
        calls.append("silu_mul")
        return sm._triton_silu_mul(gate, up)
    qm.qk_norm_rope_write.register_kernel("cpu")(qk)
    sm.silu_mul.register_kernel("cpu")(product)
    nm.norm_modulate.register_kernel("cpu")(norm)
    nm.residual_norm_modulate.register_kernel("cpu")(residual)

    transformer = build_tiny_components(seed=0)["transformer"]
    torch.manual_seed(0)
    text = torch.randn(2, 20, transformer.config.context_in_dim)
    slots = torch.zeros(1, 20, dtype=torch.bool)
    slots[0, 6:10] = True  # a reference image between two text runs
    layout = TokenLayout.build(slots, [(1, 4, 4), (1, 8, 6)], "cpu")
    latents = pack(initial_noise(3, 2, 64, 8, 6, torch.float32))
    hidden = torch.cat([torch.randn(2, 16, 64), latents], 1)
    t = torch.full((2,), 0.7)
    with torch.no_grad():
        pred, joint = DecodeEngine(transformer).prefill(layout, hidden, text, t)
        engine = DecodeEngine(transformer, backend=RecordingBackend())
        _, alone = engine.prefill(layout, hidden, text, t, with_target=False)
        out = engine.decode_step(alone, latents, t)
    assert out.path == "capture" and {"qk", "norm", "residual", "silu_mul"} <= set(calls)
    for a, b in zip(alone.k + alone.v, joint.k + joint.v):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.output, pred, atol=1e-4, rtol=0)
    print("ok")
""")


def test_prefix_pass_and_decode_with_the_triton_kernels():
    """The sampler's prefix pass and a captured decode step, with every kernel call forced onto the Triton code
    (through the interpreter): batch 2, a text/image/text prefix, the t = 0 modulation row broadcast over the
    batch, K/V written into a claimed entry's static buffers. The prefix K/V and the step-1 prediction equal the
    joint forward's (1e-4, as in test_cached_decode.py)."""
    pytest.importorskip("triton", reason="triton is not installed with this torch build")
    done = _run_interpreted(_FORCED_KERNELS_SCRIPT, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_FP8_KERNELS_SCRIPT = textwrap.dedent("""
    import torch
    import triton
    import triton.language as tl

    from graph_runtime.kernels import fp8_quant as q
    from graph_runtime.kernels.norm_modulate import _triton_norm_modulate, reference_norm_modulate_fp32

    @triton.jit
    def cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask).to(tl.float8e4nv), mask=mask)

    def interpreter_e4m3(values):
        # The interpreter's own fp32 -> e4m3 conversion (it loses the carry when rounding overflows the mantissa,
        # which the GPU's does not): the kernels' values are compared with the reference through the same one.
        flat = values.contiguous().reshape(-1)
        out = torch.empty(flat.shape, dtype=torch.float8_e4m3fn)
        cast_kernel[(1,)](flat, out, flat.numel(), BLOCK=triton.next_power_of_2(flat.numel()))
        return out.reshape(values.shape)

    def check(name, data, scale, want):
        want_scale = (want.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
        torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=0, msg=name)
        got, expected = data.float(), interpreter_e4m3(want / scale).float()
        step = torch.maximum(expected.abs() * 2**-3, torch.full_like(expected, 2**-9))  # one e4m3 step
        assert bool(((got - expected).abs() <= step * 1.0001).all()), name
        same = (got == expected).float().mean().item()
        assert same > 0.99, (name, same)

    g = torch.Generator().manual_seed(0)
    for dim in (64, 40):  # a power of two and a masked row tail
        x = torch.randn(2, 5, dim, generator=g) * 3
        delta = torch.randn(2, 5, dim, generator=g)
        modulation = torch.randn(2, 4 * dim, generator=g)
        scale, gate = modulation[:, :dim], modulation[:, dim:2 * dim]
        _, h, h_scale = _triton_norm_modulate(x, None, None, scale, 1e-6, fp8=True)
        check(f"norm {dim}", h, h_scale, reference_norm_modulate_fp32(x, None, None, scale, 1e-6)[1])
        x_new, h, h_scale = _triton_norm_modulate(x, delta, gate, scale, 1e-6, fp8=True)
        want_x, want_h = reference_norm_modulate_fp32(x, delta, gate, scale, 1e-6)
        torch.testing.assert_close(x_new, want_x, atol=1e-5, rtol=0)
        check(f"residual norm {dim}", h, h_scale, want_h)
    gate, up = torch.randn(6, 96, generator=g) * 4, torch.randn(6, 96, generator=g)
    check("silu_mul", *q._triton_silu_mul_fp8(gate, up), torch.nn.functional.silu(gate) * up)
    rows = torch.randn(3, 4, 80, generator=g) * torch.logspace(-3, 3, 4)[None, :, None]
    check("quantize rows", *q._triton_quantize_rows(rows), rows)
    print("ok")
""")


def test_fp8_kernels_through_interpreter():
    """Our kernels' FP8 outputs (the norm, the residual + norm, SwiGLU, and the row quantizer): per-row scales equal
    amax / 448 of the PyTorch math, the x output of the residual form its fp32 sum, and the e4m3 values the
    reference's scaled by those scales. Rounding itself goes through the interpreter's conversion on both sides (its
    own, which differs from the GPU's; tests/gpu compares with torch's there); a reduction summed in another order
    can move a value across a rounding boundary, so up to 1% may differ, by one e4m3 step at most."""
    pytest.importorskip("triton", reason="triton is not installed with this torch build")
    done = _run_interpreted(_FP8_KERNELS_SCRIPT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
