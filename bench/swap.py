"""Quantized copies of the transformer's block Linears, built beside the float ones and swapped in for a measurement:
the benchmark compares precisions on the same weights without converting the model (`apply_precision` does that)."""

from __future__ import annotations

import contextlib

from graph_runtime.fp8.convert import block_linears, install
from graph_runtime.fp8.linear import Fp8Linear


def quantized_linears(transformer, precision: str, factory=Fp8Linear.from_linear) -> dict[tuple[int, str], object]:
    """`factory(linear)` (an FP8 copy by default) of each Linear `precision` converts, by (block index, dotted
    name); the model is not changed."""
    return {key: factory(linear) for key, linear in block_linears(transformer, precision).items()}


@contextlib.contextmanager
def swapped(transformer, modules: dict):
    """`modules` installed while inside, the originals back afterwards."""
    replaced = install(transformer, modules)
    try:
        yield transformer
    finally:
        install(transformer, replaced)


# The step's attention in 8 bits, measured over whole steps against SDPA and against the INT8 bound; the attention
# kernel alone is `bench/attention8.py`'s.
ATTENTION_8BIT = "int8-attn8"
# The same with FlashAttention-3's FP8 forward (e4m3 q/k/v, per-head scales found by a pass over them each call:
# the error a fused quantization would give, not its speed, which `bench/attention8.py` measures).
ATTENTION_FP8 = "int8-fp8attn"
ATTENTION_VARIANTS = {ATTENTION_8BIT: "int8", ATTENTION_FP8: "fp8-pass"}  # path / variant name -> swapped kind
# The runtime's own FP8 attention (the engine's `attention="fp8"`: e4m3 K/V in the graph entries, q/k/v written e4m3
# by the q/k norm + RoPE kernel, FlashAttention-3's FP8 forward): its speed and its error against the INT8 bound.
ATTENTION_FP8_KV = "int8-fp8kv"
RUNTIME_ATTENTION = {ATTENTION_FP8_KV: "fp8"}  # path / variant name -> the engine's attention


def _kitchen_int8_attention(q, keys, values, attn_mask):
    """comfy-kitchen's `int8_attention` (INT8 Q.K^T and P.V, Hadamard-rotated Q/K) in the step's `[B, S, H, D]`
    layout; a masked call (the eager padded-text path) keeps SDPA."""
    from comfy_kitchen.sage_attention import int8_attention

    from graph_runtime.decode.step import TargetDecodeBlock

    if attn_mask is not None or not q.is_cuda:
        return TargetDecodeBlock.sdpa_attention(q, keys, values, attn_mask)
    out = int8_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
    return out.transpose(1, 2).type_as(q)


def _fa3_fp8_attention(q, keys, values, attn_mask):
    """FlashAttention-3's FP8 forward on q/k/v quantized to e4m3 with per-head amax scales; a masked call (the
    prefix pass, the eager padded-text path) keeps SDPA."""
    from graph_runtime.decode.attention import _load_fa3
    from graph_runtime.decode.step import TargetDecodeBlock

    from .attention8 import head_scales, quantize

    forward, reason = _load_fa3()
    if forward is None:
        raise RuntimeError(f"FP8 attention needs FlashAttention-3: {reason}")
    if attn_mask is not None or not q.is_cuda:
        return TargetDecodeBlock.sdpa_attention(q, keys, values, attn_mask)
    scales = [head_scales(t) for t in (q, keys, values)]
    q8, k8, v8 = (quantize(t, s) for t, s in zip((q, keys, values), scales))
    batch = q.shape[0]
    descale = [s[None].expand(batch, -1).contiguous() for s in scales]
    return forward(q8, k8, v8, q_descale=descale[0], k_descale=descale[1], v_descale=descale[2])[0].type_as(q)


_SWAPS = {"int8": _kitchen_int8_attention, "fp8-pass": _fa3_fp8_attention}


@contextlib.contextmanager
def attention_swapped(kind: str):
    """Every decode block's attention replaced while inside: `"int8"` runs comfy-kitchen's 8-bit attention,
    `"fp8-pass"` FlashAttention-3's FP8 forward on q/k/v quantized by a pass, `"sdpa"` changes nothing (the
    engine's own choice runs)."""
    from graph_runtime.decode.step import TargetDecodeBlock

    if kind == "sdpa":
        yield
        return
    if kind not in _SWAPS:
        raise ValueError(f"attention {kind!r}: expected 'sdpa', 'int8' or 'fp8-pass'")
    # The class's own attribute is put back as it was (a swap inside a swap restores the outer one).
    before = TargetDecodeBlock.__dict__["attention"]
    TargetDecodeBlock.attention = staticmethod(_SWAPS[kind])
    try:
        yield
    finally:
        TargetDecodeBlock.attention = before
