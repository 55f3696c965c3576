"""`Fp8Linear`: a Linear whose weight is e4m3 with one fp32 scale per output channel, run as an FP8 GEMM.

The weight is quantized once from the float weight, `w ~= q * s` with `s = amax(|w_row|) / 448` per output row,
and replaces it (the float weight is freed: a 7 B-parameter DiT's block Linears take 7.0 GB instead of 14.0). The
input is e4m3 with one scale per row (token): either handed over already quantized (`Fp8Rows`, from our norm and
SwiGLU kernels, see kernels/fp8_quant.py) or quantized here by one small kernel. On CUDA devices with FP8 tensor
cores (compute capability 8.9+: Ada, Hopper, Blackwell) the product is `torch._scaled_mm` with row-wise scales
(`out = (q_x @ q_w^T) * s_x * s_w^T`, fp32 accumulation, bf16 out); elsewhere the same product is computed from
the dequantized operands (logged once: correct, not fast). Scales are buffers, so a captured graph reads them
where they are, and `requantize_` rewrites weight and scale in place (LoRA merging keeps captured graphs valid).
"""

from __future__ import annotations

import functools
import logging

import torch

from ..kernels.fp8_quant import FP8_DTYPE, Fp8Rows, quantize_rows_fp8, reference_quantize_rows

logger = logging.getLogger("kvgraph")
_warned: set[str] = set()


@functools.cache
def fp8_gemm_reason(device: torch.device) -> str | None:
    """Why `torch._scaled_mm` cannot run FP8 GEMMs on `device` (None when it can)."""
    if device.type != "cuda":
        return f"FP8 GEMMs need a CUDA device (this one is {device.type})"
    if torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"{name} has no FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    return None


def fp8_matmul(rows: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype) -> torch.Tensor:
    """`rows` `[..., K]` times `weight^T` (`[N, K]` e4m3, scales `[N, 1]`) -> `[..., N]` in `out_dtype`."""
    lead = rows.data.shape[:-1]
    a = rows.data.reshape(-1, rows.data.shape[-1])
    a_scale = rows.scale.reshape(-1, 1)
    reason = fp8_gemm_reason(a.device)
    if reason is None:
        # Row-wise scaled FP8 GEMMs write bf16 (the model's dtype); another dtype is a cast of that.
        out = torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=weight_scale.view(1, -1),
                               out_dtype=torch.bfloat16).to(out_dtype)
    else:
        if reason not in _warned:
            _warned.add(reason)
            logger.warning("KV-Graph: %s; the FP8 Linears run from dequantized weights (slow).", reason)
        out = dequantized_matmul(a, a_scale, weight, weight_scale).to(out_dtype)
    return out.reshape(*lead, weight.shape[0])


def dequantized_matmul(a, a_scale, weight, weight_scale) -> torch.Tensor:
    """The FP8 GEMM's math on dequantized operands, in fp32: `(a * s_a) @ (w * s_w)^T`."""
    return (a.float() * a_scale) @ (weight.float() * weight_scale).t()


def is_fp8_linear(module) -> bool:
    """Whether `module` is an `Fp8Linear` of any copy of the pack (see `Fp8Rows.kvgraph_fp8_rows`)."""
    return getattr(type(module), "kvgraph_fp8_linear", False)


def is_fp8_rows(value) -> bool:
    return getattr(type(value), "kvgraph_fp8_rows", False)


class Fp8Linear(torch.nn.Linear):
    """A Linear with an e4m3 `weight` `[out, in]` (requires_grad False) and an fp32 `weight_scale` buffer `[out, 1]`.

    `forward` takes a float tensor or an `Fp8Rows`; it returns `out_dtype` (the dtype the Linear ran in before, or
    the input's when it is a float tensor)."""

    kvgraph_fp8_linear = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 out_dtype: torch.dtype = torch.bfloat16):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype = out_dtype
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                         requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=out_dtype, device=device),
                                        requires_grad=False) if bias else None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Fp8Linear":
        """A new module holding `linear`'s weight quantized (`linear` itself is left as it is)."""
        weight = linear.weight.detach()
        out_dtype = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=weight.device,
                     out_dtype=out_dtype)
        module.requantize_(weight)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    @torch.no_grad()
    def requantize_(self, weight: torch.Tensor) -> None:
        """Quantize a float `weight` `[out, in]` into the existing weight and scale storages (same addresses)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a Linear of "
                             f"[{self.out_features}, {self.in_features}]")
        q, scale = reference_quantize_rows(weight.to(self.weight.device))
        self.weight.data.copy_(q)
        self.weight_scale.copy_(scale)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale).to(dtype)

    def forward(self, x):
        if is_fp8_rows(x):
            rows, out_dtype = x, self.out_dtype
        else:
            rows, out_dtype = quantize_rows_fp8(x), x.dtype
        out = fp8_matmul(rows, self.weight, self.weight_scale, out_dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel scales"
