"""Helpers of the parallel tests: ranks of a gloo group as threads of the test process (the parallel decode's
collectives run for real over TCP, on one shared tiny model, without the seconds each worker process takes to import
torch), and a progress callback that kills a worker."""

from __future__ import annotations

import datetime
import os
import signal
import threading

import torch.distributed as dist

from graph_runtime.parallel.comm import RankGroups

TIMEOUT_S = 60.0


def run_ranks(world: int, fn, timeout_s: float = TIMEOUT_S) -> list:
    """`fn(rank, groups)` on `world` threads, each a rank with its own `RankGroups`; returns the results in rank
    order, or raises the first rank's exception."""
    master = dist.TCPStore("127.0.0.1", 0, world, True, datetime.timedelta(seconds=timeout_s),
                           wait_for_workers=False)
    results, errors = [None] * world, [None] * world

    def rank_main(rank):
        try:
            store = master if rank == 0 else dist.TCPStore("127.0.0.1", master.port, world, False,
                                                           datetime.timedelta(seconds=timeout_s))
            groups = RankGroups(store, rank, world, "cpu", timeout_s)
            results[rank] = fn(rank, groups)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 2)
    for exc in errors:
        if exc is not None:
            raise exc
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a rank thread did not finish")
    return results


def kill_at_step(pid: int, step: int):
    """An `on_step` callback that kills process `pid` (SIGKILL) once sampling reaches `step`."""

    def on_step(done, total, latents):
        if done == step:
            os.kill(pid, signal.SIGKILL)

    return on_step
