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
