"""INT8 W8A8 GEMM at the 8-bit tensor-core rate: `out = (a @ w^T) * a_scale * w_scale^T (+ bias)`.

`a` is an activation `[M, K]` quantized per row (token) to int8 with an fp32 scale per row, `w` a weight `[N, K]`
quantized per output channel (ComfyUI's INT8 ConvRot files, or a float file quantized at load). The product
accumulates in int32, which is exact, so the result differs from any other correct INT8 GEMM only by the epilogue's
rounding. On Hopper the 8-bit tensor-core peak is twice bf16's; cuBLAS's int8 (`torch._int_mm`) and comfy-kitchen's
`int8_linear` reach far less of it on the decode step's shapes, which is why this kernel exists.

Tile configurations are looked up, never autotuned at run time (a first prompt must not wait for a sweep): the
table in `int8_gemm_configs.py` holds what the GEMM benchmark (`python -m bench.int8_gemm`) found per device and
shape; an unknown shape takes the default of its kernel. The op is a `torch.library` custom op, opaque to
torch.compile and capturable in a CUDA graph (no host syncs, no allocations besides its output).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import define_once
from .preload import wait_for_preload


class GemmConfig(NamedTuple):
    """One launch's tiles: `kernel` is "tile" (a program per output tile) or "tma" (persistent, TMA loads)."""

    kernel: str = "tile"
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4


DEFAULT_CONFIG = GemmConfig()
# Under Triton's interpreter (CPU tests) small tiles keep the NumPy emulation quick; dot tiles need 16+ per side.
INTERPRETER_CONFIG = GemmConfig("tile", 32, 32, 32, 4, 4, 1)


def reference_int8_scaled_mm(a, a_scale, w, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The exact math in float64 (int8 products summed over K up to 2^53 are exact): what every kernel must give,
    up to the final rounding to `out_dtype`."""
    acc = a.to(torch.float64) @ w.to(torch.float64).t()
    out = acc * a_scale.reshape(-1, 1).to(torch.float64) * w_scale.reshape(1, -1).to(torch.float64)
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(torch.float32).to(out_dtype)


@functools.cache
def int8_tensor_core_reason(device: torch.device) -> str | None:
    """Why our Triton INT8 GEMM should not run on `device` (None when it should)."""
    if device.type != "cuda":
        return f"the INT8 GEMM kernel needs a CUDA device (this one is {device.type})"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"{torch.cuda.get_device_name(device)} has no int8 tensor-core path in Triton (compute capability 8.0+)"
    return None


def select_config(device: torch.device, m: int, n: int, k: int) -> GemmConfig:
    """The table's configuration for this device and shape (M taken to its bucket), else the default."""
    from .int8_gemm_configs import lookup

    found = lookup(_capability(device), m, n, k)
    if found is None:
        return DEFAULT_CONFIG
    config = GemmConfig(**found)
    if config.kernel == "tma" and not _tma_ok(device):
        return DEFAULT_CONFIG
    return config


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def _tma_ok(device: torch.device) -> bool:
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(a, a_scale, w, w_scale, bias, out, config: GemmConfig) -> torch.Tensor:
    """Run one kernel of `int8_gemm_triton.py` into `out` `[M, N]` (contiguous) with `config`'s tiles."""
    import triton

    from .int8_gemm_triton import int8_gemm_kernel, int8_gemm_tma_kernel

    m, k = a.shape
    n = w.shape[0]
    bias_arg = bias if bias is not None else w_scale
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if config.kernel == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        programs = min(_multiprocessors(a.device), tiles)
        a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
        w_desc = TensorDescriptor.from_tensor(w, [config.block_n, config.block_k])
        c_desc = TensorDescriptor.from_tensor(out, [config.block_m, config.block_n])
        int8_gemm_tma_kernel[(programs,)](
            a_desc, w_desc, c_desc, a_scale, w_scale, bias_arg, m, n, k, HAS_BIAS=bias is not None,
            BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP_M=config.group_m, NUM_PROGRAMS=programs,
            num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        int8_gemm_kernel[(tiles,)](
            a, w, out, a_scale, w_scale, bias_arg, m, n, k, a.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BM=config.block_m, BN=config.block_n, BK=config.block_k,
            GROUP_M=config.group_m, EVEN_K=k % config.block_k == 0, num_warps=config.num_warps,
            num_stages=config.num_stages)
    return out


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _define_int8_scaled_mm():
    @torch.library.custom_op("kvgraph::int8_scaled_mm", mutates_args=())
    def int8_scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """`a` int8 `[M, K]`, `a_scale` fp32 `[M]`/`[M, 1]`, `w` int8 `[N, K]`, `w_scale` fp32 `[N]`/`[N, 1]`."""
        m, n = a.shape[0], w.shape[0]
        if a.is_cuda and int8_tensor_core_reason(a.device) is None:
            wait_for_preload()
            out = torch.empty((m, n), dtype=out_dtype, device=a.device)
            return launch(a, a_scale, w, w_scale, bias, out, select_config(a.device, m, n, a.shape[1]))
        if _interpreting():
            out = torch.empty((m, n), dtype=out_dtype, device=a.device)
            return launch(a, a_scale, w, w_scale, bias, out, INTERPRETER_CONFIG)
        return reference_int8_scaled_mm(a, a_scale, w, w_scale, bias, out_dtype)

    @int8_scaled_mm.register_fake
    def _(a, a_scale, w, w_scale, bias, out_dtype):
        return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)

    return int8_scaled_mm


_int8_scaled_mm = define_once("int8_scaled_mm", _define_int8_scaled_mm)


def int8_scaled_mm(a, a_scale, w, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """`a` `[..., K]` int8 (rows scaled by `a_scale` `[..., 1]`) times `w^T` (`[N, K]` int8, `w_scale` `[N, 1]`)
    -> `[..., N]` in `out_dtype`."""
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])
    if not a2.is_contiguous():
        a2 = a2.contiguous()
    out = _int8_scaled_mm(a2, a_scale.reshape(-1).float(), w, w_scale.reshape(-1).float(), bias, out_dtype)
    return out.reshape(*lead, w.shape[0])
