"""The FP8 decode path: e4m3 block Linears with per-channel weight scales and per-token activation scales.

`apply_precision(transformer, "fp8")` converts a loaded transformer (see convert.py for the groups and presets, auto.py
for what the default, `auto`, resolves to); the decode step then hands our norm and SwiGLU kernels' outputs to the FP8
GEMMs already quantized.
"""

from .auto import AUTO, ResolvedPrecision, resolve_precision
from .convert import apply_precision, precision_of
from .linear import Fp8Linear, fp8_gemm_reason
from .precisions import DEFAULT_PRECISION, PRECISION_CHOICES, PRECISIONS, check_precision, groups_of

__all__ = ["AUTO", "DEFAULT_PRECISION", "PRECISIONS", "PRECISION_CHOICES", "Fp8Linear", "ResolvedPrecision",
           "apply_precision", "check_precision", "fp8_gemm_reason", "groups_of", "precision_of", "resolve_precision"]
