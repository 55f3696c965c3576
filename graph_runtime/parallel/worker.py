"""A rank other than 0: `python -m graph_runtime.parallel.worker`, one process per device.

Rank 0 (the ComfyUI or command-line process) starts these with PyTorch's elastic launcher, or a user starts them
on other hosts with torch.distributed's environment variables (docs/multi-gpu.md). Each joins the rendezvous store
at MASTER_ADDR:MASTER_PORT as RANK of WORLD_SIZE, makes its process groups, receives the model from rank 0, and
then serves rank 0's commands until told to stop, until rank 0 goes away, or until it fails: a failure is reported
through the store and ends the process, so every collective that waits on it fails at once instead of timing out.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..errors import KVGraphError
from ..sampling.sampler import Cancelled, sample
from .comm import RankGroups, collective_timeout, nccl_process_settings
from .control import Control
from .engine import DeviceWatch, ParallelEngine, PeerLost
from .plan import plan_for
from .transfer import broadcast_storages, loads, receive_model

logger = logging.getLogger("kvgraph")


def worker_device(local_rank: int) -> torch.device:
    """KVGRAPH_DEVICE, else the LOCAL_RANK-th GPU, else the CPU."""
    name = os.environ.get("KVGRAPH_DEVICE")
    if name:
        return torch.device(name)
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


class Worker:
    def __init__(self, store, rank: int, world: int, device: torch.device, timeout_s: float):
        self.rank, self.world, self.device, self.timeout_s = rank, world, device, timeout_s
        self.parent = int(os.environ.get("KVGRAPH_PARENT_PID", "0"))
        store.set(f"ready/{rank}", str(os.getpid()))
        self.groups = RankGroups(store, rank, world, device, timeout_s)
        self.control = Control(store, rank, world)
        self.store = store
        self.model = None
        self.storages = []
        self.engines = {}

    def alive(self) -> bool:
        """Whether rank 0 is still there: the parent process that started this one, when it did."""
        return not self.parent or os.getppid() == self.parent

    def _health(self) -> None:
        if not self.alive():
            raise PeerLost("rank 0 exited")

    def serve(self) -> int:
        seq = 0
        while True:
            seq += 1
            kind, payload = self.control.next_command(seq, self.alive)
            if kind == "stop":
                self.control.answer(seq, ok=True)
                return 0
            try:
                answer = getattr(self, f"_{kind}")(payload)
            except (Cancelled, KVGraphError) as exc:
                # Every rank meets these at the same point of the same request (rank 0 too): the ranks stay in step.
                self.control.answer(seq, ok=False, lockstep=True, error=f"{type(exc).__name__}: {exc}")
                continue
            except BaseException as exc:  # noqa: BLE001 - reported, then this rank ends
                text = f"{type(exc).__name__}: {exc}"
                logger.error("KV-Graph rank %d (%s) failed: %s\n%s", self.rank, self.device, text,
                             traceback.format_exc())
                self.control.report_failure(text)
                self.control.answer(seq, ok=False, error=text)
                self.groups.abort()
                return 1
            self.control.answer(seq, ok=True, **answer)

    def _load(self, skeleton: bytes) -> dict:
        self.engines.clear()
        self.model, self.storages = None, []
        gc.collect()
        model, storages = receive_model(skeleton, self.device)
        moved = broadcast_storages(storages, self.groups.compute, self.device)
        self.model, self.storages = model.eval(), storages
        return {"bytes": moved}

    def _weights(self, _payload: bytes) -> dict:
        """New values for the same storages (a LoRA merged on rank 0): the captured graphs stay valid."""
        return {"bytes": broadcast_storages(self.storages, self.groups.compute, self.device)}

    def _sample(self, payload: bytes) -> dict:
        request = loads(payload, "cpu")
        plan = plan_for(self.world, request.do_cfg)
        engine = self.engines.get(plan)
        if engine is None:
            engine = self.engines[plan] = ParallelEngine(
                self.model, plan, self.rank, self.groups.sp(plan), self.groups.cfg(plan),
                watch=DeviceWatch(self.device, self.timeout_s, self._health))
        result = sample(engine, request, should_stop=self.groups.stop_flag)
        return {"stats": result.stats, "timings": result.timings}


@record
def main() -> int:
    logging.basicConfig(level=os.environ.get("KVGRAPH_LOG_LEVEL", "WARNING"),
                        format=f"%(levelname)s [rank {os.environ.get('RANK', '?')}] %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = worker_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout_s = collective_timeout()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        nccl_process_settings()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          datetime.timedelta(seconds=timeout_s))
    with torch.inference_mode(False), torch.no_grad():
        return Worker(store, rank, world, device, timeout_s).serve()


if __name__ == "__main__":
    sys.exit(main())
