"""`precision: auto`, the loaders' default: the fastest block precision that stays within the FP8 quality bound, for
these weights on this device.

The bound (docs/fp8.md) is ComfyUI's INT8 ConvRot W8A8 error on the same weights, per block and over the whole step.
On the H200 `fp8-attn` passes it (0.43x that error) and steps 9-10% faster than bf16, while every precision with an
FP8 MLP fails it (2.5x), so `auto` means:

- `fp8-attn` for bf16 weights from a float checkpoint on a CUDA GPU with FP8 GEMMs (compute capability 8.9+);
- `bf16` (nothing converted) everywhere else: a device without FP8 GEMMs (their fallback runs slower than bf16);
  weights asked for in fp16 or fp32 (the user picked a precision); and an INT8 ConvRot file, whose own int8 path is
  the bound itself and which FP8 would round a second time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .linear import fp8_gemm_reason

AUTO = "auto"
AUTO_FP8 = "fp8-attn"


@dataclass(frozen=True)
class ResolvedPrecision:
    """The precision a load applies, and why (the load's log line and the handle's info say it)."""

    precision: str
    reason: str

    @property
    def converts(self) -> bool:
        """Whether the load converts block Linears to FP8, which quantizes from float weights (so an INT8 file is
        dequantized first)."""
        from .convert import groups_of  # here, not at the top: convert.py imports this module

        return bool(groups_of(self.precision))


def resolve_precision(precision: str, device, *, dtype: torch.dtype, int8_file: bool) -> ResolvedPrecision:
    """`precision` itself unless it is `auto`; see the module docstring for what `auto` picks."""
    if precision != AUTO:
        return ResolvedPrecision(precision, "chosen")
    if int8_file:
        return ResolvedPrecision("bf16", "auto: an INT8 ConvRot file runs its own int8 weights (FP8 would round them "
                                         "twice)")
    reason = fp8_gemm_reason(torch.device(device))
    if reason is not None:
        return ResolvedPrecision("bf16", f"auto: {reason}")
    if dtype != torch.bfloat16:
        return ResolvedPrecision("bf16", f"auto: {str(dtype).removeprefix('torch.')} weights were asked for")
    return ResolvedPrecision(AUTO_FP8, "auto: FP8 attention Linears, within the INT8 ConvRot error bound; the MLP "
                                       "stays bf16")
