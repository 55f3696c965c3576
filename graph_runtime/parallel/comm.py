"""The process groups of one rank and the few collectives the parallel decode uses, with their timeouts.

Groups are torch.distributed backends built straight from the rendezvous store (`ProcessGroupGloo` on CPUs,
`ProcessGroupNCCL` on GPUs), not through `init_process_group`: the process that hosts rank 0 is ComfyUI's own, and
a default process group there would be global state that other packs (and our own eligibility check, which reads
any initialized default group as someone else's parallelism) would see. Every group carries the collective
timeout, so a peer that stops answering fails the collective instead of hanging it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .plan import ParallelPlan

# A collective that waits longer than this for a peer fails (seconds; KVGRAPH_PARALLEL_TIMEOUT overrides). Long
# enough for a first prompt's captures and compiles on the other ranks, short enough that a lost GPU does not
# leave a prompt waiting for ComfyUI's whole session.
DEFAULT_TIMEOUT_S = 300.0


def collective_timeout() -> float:
    value = os.environ.get("KVGRAPH_PARALLEL_TIMEOUT")
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        from ..errors import InputError

        raise InputError("KVGRAPH_PARALLEL_TIMEOUT", value, "a positive number of seconds")
    return seconds


def backend_for(device: torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def nccl_process_settings() -> None:
    """NCCL's error handling for a process that must outlive its peers: on a failed or timed-out collective the
    communicator is aborted and the error raised to the caller (2, clean-up only), never the whole process torn
    down (its default): rank 0 is ComfyUI's own process. A user's own setting wins."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")


@dataclass
class Comm:
    """One process group and this process's place in it. Collectives run synchronously on the caller's stream
    (asyncOp off), so a CUDA graph captures them in order with the step's kernels."""

    pg: object
    rank: int
    size: int
    name: str

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        opts = dist.AllToAllOptions()
        opts.asyncOp = False
        self.pg.alltoall_base(out, inp, out_splits, in_splits, opts).wait()

    def all_gather(self, inp: torch.Tensor) -> list[torch.Tensor]:
        outs = [torch.empty_like(inp) for _ in range(self.size)]
        self.pg.allgather([outs], [inp]).wait()
        return outs

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.asyncOp = False
        self.pg.broadcast([tensor], opts).wait()

    def abort(self) -> None:
        """End the group now (peers that still wait get an error, not a hang)."""
        for method in ("abort", "shutdown"):
            with contextlib.suppress(Exception):
                getattr(self.pg, method)()
                return


def make_group(store, name: str, ranks: list[int], rank: int, backend: str, device: torch.device,
               timeout_s: float) -> Comm:
    """The group of `ranks` (global ranks, in order) as seen by `rank`; blocks until every member has joined."""
    prefixed = dist.PrefixStore(f"kvgraph/{name}/", store)
    index, size = ranks.index(rank), len(ranks)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, index, size, options)
        # The communicator is made now, not inside a first collective (which a CUDA graph may be capturing).
        pg.eager_connect_single_device(torch.device(device))
    else:
        pg = dist.ProcessGroupGloo(prefixed, index, size, timeout)
    return Comm(pg=pg, rank=index, size=size, name=name)


def plans_for(world: int) -> list[ParallelPlan]:
    """Every plan a request can run under on `world` ranks (see plan.plan_for)."""
    return [ParallelPlan(world, 1)] + ([ParallelPlan(world, 2)] if world % 2 == 0 else [])


class RankGroups:
    """Every group rank `rank` of `world` belongs to, made once when the ranks start.

    `control`: gloo over all ranks on CPU tensors (the per-step stop flag), whatever the compute backend;
    `world`: the compute backend over all ranks (weights, and the sequence group of a plan without CFG groups);
    per plan, the rank's sequence-parallel group and its CFG pair. Groups are made in one global order, so ranks
    that share several never wait on each other crosswise.
    """

    def __init__(self, store, rank: int, world: int, device: torch.device, timeout_s: float):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.backend = backend_for(self.device)
        self.timeout_s = timeout_s
        everyone = list(range(world))
        self.control = make_group(store, "control", everyone, rank, "gloo", torch.device("cpu"), timeout_s)
        self.compute = make_group(store, "world", everyone, rank, self.backend, self.device, timeout_s)
        self._sp: dict[ParallelPlan, Comm | None] = {}
        self._cfg: dict[ParallelPlan, Comm | None] = {}
        for plan in plans_for(world):
            self._sp[plan] = self.compute if plan.cfg_groups == 1 else None
            self._cfg[plan] = None
            if plan.cfg_groups == 1:
                continue
            for group in range(plan.cfg_groups):
                ranks = plan.sp_ranks(group)
                if rank in ranks and len(ranks) > 1:
                    self._sp[plan] = self._make(store, f"sp{plan.cfg_groups}.{group}", ranks)
            for position in range(plan.sp):
                pair = [g * plan.sp + position for g in range(plan.cfg_groups)]
                if rank in pair:
                    self._cfg[plan] = self._make(store, f"cfg.{position}", pair)

        self._connect()

    def _connect(self) -> None:
        """One small all-to-all and all-gather on every compute group, now: NCCL connects peers on their first
        exchange, and a connection made inside a graph capture (its buffers allocated there) would fail it."""
        for comm in self.all():
            if comm is self.control:
                continue
            probe = torch.arange(comm.size, dtype=torch.float32, device=self.device)
            comm.all_to_all(torch.empty_like(probe), probe, [1] * comm.size, [1] * comm.size)
            comm.all_gather(probe)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _make(self, store, name, ranks) -> Comm:
        return make_group(store, name, ranks, self.rank, self.backend, self.device, self.timeout_s)

    def sp(self, plan: ParallelPlan) -> Comm | None:
        """The rank's sequence-parallel group under `plan` (None when it is the rank alone)."""
        return self._sp[plan]

    def cfg(self, plan: ParallelPlan) -> Comm | None:
        """The rank's CFG pair under `plan` (None without CFG groups)."""
        return self._cfg[plan]

    def all(self) -> list[Comm]:
        groups = [self.control, self.compute, *self._sp.values(), *self._cfg.values()]
        unique = []
        for comm in groups:
            if comm is not None and all(comm is not seen for seen in unique):
                unique.append(comm)
        return unique

    def abort(self) -> None:
        for comm in self.all():
            comm.abort()

    def stop_flag(self, stop: bool | None = None) -> bool:
        """Rank 0 says (`stop`), every rank hears, whether the sampling loop stops before its next step."""
        flag = torch.tensor([1 if stop else 0], dtype=torch.int32)
        self.control.broadcast(flag, 0)
        return bool(flag.item())
