"""The SwiGLU product `silu(gate) * up` of the block's MLP, between its gate/up and down projections.

Inductor's kernel for this line runs at about half of memory bandwidth at the decode shapes; a flat
one-dimensional kernel moving 1024 elements per program moves the same bytes in about two thirds of its time
(docs/performance.md). Arithmetic is fp32 with one rounding, like inductor's fused code (equal outputs: max abs 0
against it); the CPU implementation is the same math in PyTorch.
"""

from __future__ import annotations

import torch

from . import define_once
from .preload import wait_for_preload


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def _define_silu_mul():
    @torch.library.custom_op("kvgraph::silu_mul", mutates_args=())
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up`, both `[..., N]` of one shape."""
        if gate.is_cuda and gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape:
            return _triton_silu_mul(gate, up)
        return reference_silu_mul(gate, up)

    @silu_mul.register_fake
    def _(gate, up):
        return torch.empty_like(gate, memory_format=torch.contiguous_format)

    return silu_mul


silu_mul = define_once("silu_mul", _define_silu_mul)

# Elements per program: 1024 with 4 warps was the fastest of 1024-8192 at both decode shapes (see the log above).
BLOCK = 1024


def _triton_silu_mul(gate, up):
    wait_for_preload()
    import triton

    from .silu_mul_triton import silu_mul_kernel

    out = torch.empty_like(gate)
    n = gate.numel()
    silu_mul_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK, num_warps=4)
    return out
