"""Independent projections of one input (a block's q/k/v, its MLP's gate/up) run side by side on CUDA streams.

At 512x512 each 4096x4096 projection of the 1024 target rows is one wave of 128 output tiles on the H200's 132 SMs,
and a lone wave pays its kernel's ramp-up and tail in full: 69 us where the same tiles cost ~54 us inside a
three-wave GEMM (bench/results/step-breakdown-20261202T1708.log). Launched on their own streams, the next projection's
tiles start on the SMs the previous one frees, and in a captured graph the streams become parallel branches.
Each projection is still its own `F.linear` call (the same cuBLAS kernel on the same operands), so the results are
bit-identical to running them one after another; fusing the weights into one GEMM would need a second copy of them
or re-homing the model's parameters.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from . import define_once

_streams: dict = {}
_streams_lock = threading.Lock()


def _side_streams(device: torch.device, count: int) -> list:
    """The process's side streams for `device`, made on first use and kept (a stream used in a captured graph must
    outlive it, and cuBLAS keeps a workspace per stream)."""
    with _streams_lock:
        streams = _streams.setdefault(device.index, [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device))
        return streams[:count]


def _define_concurrent_linears():
    @torch.library.custom_op("kvgraph::concurrent_linears", mutates_args=())
    def concurrent_linears(x: torch.Tensor, weights: list[torch.Tensor],
                           biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """`[F.linear(x, w, b) for w, b in zip(weights, biases)]`, the first on the current stream, the others on
        side streams that fork from it and join it again before returning."""
        if not x.is_cuda or len(weights) < 2:
            return [F.linear(x, w, b) for w, b in zip(weights, biases)]
        main = torch.cuda.current_stream(x.device)
        sides = _side_streams(x.device, len(weights) - 1)
        for side in sides:
            side.wait_stream(main)
        outs = [F.linear(x, weights[0], biases[0])]
        for side, w, b in zip(sides, weights[1:], biases[1:]):
            with torch.cuda.stream(side):
                outs.append(F.linear(x, w, b))
        for side in sides:
            main.wait_stream(side)
        # No record_stream: an output made on a side stream is freed back to that stream's memory, which its next
        # use only reaches after forking from the main stream again, so after every main-stream read of it; and the
        # input's memory is only reused by main-stream work after the join above. (record_stream during a capture
        # would keep every block's outputs alive until the capture ends.)
        return outs

    @concurrent_linears.register_fake
    def _(x, weights, biases):
        return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]

    return concurrent_linears


concurrent_linears = define_once("concurrent_linears", _define_concurrent_linears)


def plain_linears(*modules) -> bool:
    """Whether every module is a bare `torch.nn.Linear` (no subclass, adapter or hook), whose forward is exactly
    `F.linear(x, weight, bias)`; anything else must be called as itself."""
    return all(type(m) is torch.nn.Linear and not (m._forward_hooks or m._forward_pre_hooks) for m in modules)
