"""`precision: auto`, the loaders' default: the fastest block precision that stays within the quality bound, for
these weights on this device.

The bound (docs/fp8.md) is ComfyUI's INT8 ConvRot W8A8 error on the same weights, per block and over the whole step.
`int8` *is* that quantization (run on our INT8 GEMM at the 8-bit tensor-core rate), `fp8-attn` stays within it and
every precision with an FP8 MLP fails it, so `auto` means:

- `int8` for an INT8 ConvRot file kept int8 (its own weights, never rounded a second time), and for bf16 weights of a
  float file on a CUDA GPU where our INT8 GEMM runs (int8 tensor cores: compute capability 8.0+, and Triton);
- `fp8-attn` for bf16 weights of a float file on a CUDA GPU with FP8 GEMMs but no INT8 path;
- `bf16` (nothing converted) everywhere else: a device without either (their fallbacks run slower than bf16), weights
  asked for in fp16 or fp32 (the user picked a precision), and an INT8 file the user asked to dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.int8_gemm import int8_tensor_core_reason
from .linear import fp8_gemm_reason
from .precisions import AUTO, INT8, groups_of

AUTO_FP8 = "fp8-attn"


@dataclass(frozen=True)
class ResolvedPrecision:
    """The precision a load applies, and why (the load's log line and the handle's info say it); `int8_file`: the
    weights come from an INT8 ConvRot file kept int8."""

    precision: str
    reason: str
    int8_file: bool = False

    @property
    def converts(self) -> bool:
        """Whether the load converts block Linears (to FP8, or to int8 from float weights). A conversion quantizes
        from float weights, so an INT8 file is dequantized first, except for `int8`, which keeps the file's own."""
        if self.precision == INT8 and self.int8_file:
            return False
        return bool(groups_of(self.precision))

    def describe(self, transformer) -> str:
        """What runs, for a log line: the precision the Linears are converted to, or, when nothing is converted, the
        precision (`bf16` there means "as loaded") with the loaded weights' real storage and compute dtype, e.g.
        fp32 on the CPU or an INT8 file's int8 ConvRot weights."""
        if self.converts:
            return f"{self.precision} ({self.reason})"
        from ..report import storage_text

        name = "as loaded" if self.precision == "bf16" else self.precision
        return f"{name} ({storage_text(transformer)}; {self.reason})"


def resolve_precision(precision: str, device, *, dtype: torch.dtype, int8_file: bool,
                      dequantized: bool = False) -> ResolvedPrecision:
    """`precision` itself unless it is `auto`; see the module docstring for what `auto` picks. `int8_file`: an INT8
    ConvRot file kept int8; `dequantized`: an INT8 file the user asked to expand to float weights at load."""
    if precision != AUTO:
        return ResolvedPrecision(precision, "chosen", int8_file)
    if dequantized:
        return ResolvedPrecision("bf16", "auto: int8_weights dequantize asks for the INT8 file's weights in float")
    device = torch.device(device)
    int8_reason = int8_tensor_core_reason(device)
    if int8_file:
        how = "on our INT8 GEMM" if int8_reason is None else f"through comfy-kitchen ({int8_reason})"
        return ResolvedPrecision(INT8, f"auto: an INT8 ConvRot file runs its own int8 weights, {how}", True)
    fp8_reason = fp8_gemm_reason(device)
    if int8_reason is not None and fp8_reason is not None:
        return ResolvedPrecision("bf16", f"auto: no INT8 or FP8 path on this device ({int8_reason}; {fp8_reason})")
    if dtype != torch.bfloat16:
        return ResolvedPrecision("bf16", f"auto: {str(dtype).removeprefix('torch.')} weights were asked for")
    if int8_reason is None:
        return ResolvedPrecision(INT8, "auto: INT8 ConvRot W8A8 on our INT8 GEMM, quantized at load (the quality "
                                       "bound itself, at the 8-bit tensor-core rate)")
    return ResolvedPrecision(AUTO_FP8, "auto: FP8 attention Linears, within the INT8 ConvRot error bound; the MLP "
                                       "stays bf16")
