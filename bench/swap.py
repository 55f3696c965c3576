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


def _kitchen_int8_attention(q, keys, values, attn_mask):
    """comfy-kitchen's `int8_attention` (INT8 Q.K^T and P.V, Hadamard-rotated Q/K) in the step's `[B, S, H, D]`
    layout; a masked call (the eager padded-text path) keeps SDPA."""
    from comfy_kitchen.sage_attention import int8_attention

    from graph_runtime.decode.step import TargetDecodeBlock

    if attn_mask is not None or not q.is_cuda:
        return TargetDecodeBlock.sdpa_attention(q, keys, values, attn_mask)
    out = int8_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
    return out.transpose(1, 2).type_as(q)


@contextlib.contextmanager
def attention_swapped(kind: str):
    """Every decode block's attention replaced while inside: `"int8"` runs comfy-kitchen's 8-bit attention, `"sdpa"`
    changes nothing."""
    from graph_runtime.decode.step import TargetDecodeBlock

    if kind == "sdpa":
        yield
        return
    if kind != "int8":
        raise ValueError(f"attention {kind!r}: expected 'sdpa' or 'int8'")
    # The class's own attribute is put back as it was (a swap inside a swap restores the outer one).
    before = TargetDecodeBlock.__dict__["attention"]
    TargetDecodeBlock.attention = staticmethod(_kitchen_int8_attention)
    try:
        yield
    finally:
        TargetDecodeBlock.attention = before
