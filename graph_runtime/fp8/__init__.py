"""The FP8 decode path: e4m3 block Linears with per-channel weight scales and per-token activation scales.

`apply_precision(transformer, "fp8")` converts a loaded transformer (see convert.py for the groups and presets);
the decode step then hands our norm and SwiGLU kernels' outputs to the FP8 GEMMs already quantized.
"""

from .convert import DEFAULT_PRECISION, PRECISIONS, apply_precision, check_precision, precision_of
from .linear import Fp8Linear, fp8_gemm_reason

__all__ = ["DEFAULT_PRECISION", "PRECISIONS", "Fp8Linear", "apply_precision", "check_precision", "fp8_gemm_reason",
           "precision_of"]
