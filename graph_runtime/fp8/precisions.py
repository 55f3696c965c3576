"""The names of the block precisions and the Linear groups each converts (what they mean: convert.py, and auto.py
for `auto`); below both, which use them."""

from __future__ import annotations

from ..errors import InputError

AUTO = "auto"
INT8 = "int8"

GROUPS = {
    "qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "out": ("attn.to_out.0",),
    "mlp_in": ("img_mlp.gate_layer", "img_mlp.proj"),
    "mlp_down": ("img_mlp.out",),
}
PRECISIONS = {
    "bf16": (),
    "fp8": ("qkv", "out", "mlp_in", "mlp_down"),
    "fp8-attn": ("qkv", "out"),
    "fp8-no-out": ("qkv", "mlp_in", "mlp_down"),
    INT8: ("qkv", "out", "mlp_in", "mlp_down"),
}
# What the loaders and the command line apply when no precision is given (see auto.py).
DEFAULT_PRECISION = AUTO
PRECISION_CHOICES = (AUTO, *PRECISIONS)


def groups_of(precision: str) -> tuple[str, ...]:
    """The groups a precision converts; an InputError names the value and what is accepted (`auto` is resolved
    first, by `resolve_precision`)."""
    if precision in PRECISIONS:
        return PRECISIONS[precision]
    if isinstance(precision, str) and precision.startswith("fp8:"):
        groups = tuple(g.strip() for g in precision[4:].split(",") if g.strip())
        if groups and all(g in GROUPS for g in groups):
            return groups
    raise InputError("precision", precision, f"one of {', '.join(PRECISION_CHOICES)}, or fp8:<comma list of "
                                             f"{', '.join(GROUPS)}>")


def check_precision(precision: str) -> str:
    if precision != AUTO:
        groups_of(precision)
    return precision
