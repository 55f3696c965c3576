"""Rank 0's side: the worker processes of one loaded transformer, started on its first parallel prompt, kept for
the next ones (with their graphs), stopped with the model.

Rank 0 is the process that loaded the model (ComfyUI's, or the command line's): it computes as one of the ranks on
its own device. The others are `python -m graph_runtime.parallel.worker` processes, one per further device, started
with PyTorch's elastic launcher; they receive the weights from rank 0 (the files are read once), and each prompt
as a command through the rendezvous store. Every rank then runs the same sampling loop on the same request.

Failures: a rank that dies or fails (out of memory included) fails the prompt with a message naming the rank and
what happened; the others are shut down, and the next prompt starts them again. Should that start fail, prompts
run on rank 0's device alone, with the reason logged, until the model is loaded again. Nothing waits longer than
the collective timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import InputError, KVGraphError
from ..sampling.sampler import Cancelled, SampleResult, SamplingRequest, sample
from .comm import RankGroups, backend_for, collective_timeout, nccl_process_settings
from .control import Control
from .engine import DeviceWatch, ParallelEngine, PeerLost
from .plan import check_heads, plan_for
from .transfer import broadcast_storages, dumps, model_skeleton, weights_version

logger = logging.getLogger("kvgraph")

# The pack's folder: on the workers' import path, so they import the very files rank 0 runs.
PACK_ROOT = Path(__file__).resolve().parents[2]
MAX_DEVICES = 16


class ParallelFailure(RuntimeError):
    """A prompt failed because a rank did; every rank was shut down."""


class ParallelStartError(RuntimeError):
    """The ranks could not be started."""


class StoppedInStep(Exception):
    """Carries what ended a prompt on every rank at the same point (a cancel, a bad input, a NaN, or rank 0's
    progress callback raising): the ranks are idle and in step, ready for the next prompt."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def rank_devices(device: torch.device, world: int, local: int) -> list[torch.device | None]:
    """Rank 0's device, then one device per further local rank (None for ranks on other hosts)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [device] * local + [None] * (world - local)
    count = torch.cuda.device_count()
    others = [torch.device("cuda", i) for i in range(count) if i != (device.index or 0)]
    if len(others) < local - 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise InputError("gpus", world, f"at most {count}: the number of CUDA GPUs this process sees{seen}")
    return [device, *others[:local - 1]] + [None] * (world - local)


def local_ranks(world: int) -> int:
    """How many of the ranks this host starts (KVGRAPH_LOCAL_RANKS; the rest join from other hosts)."""
    value = os.environ.get("KVGRAPH_LOCAL_RANKS")
    if value is None:
        return world
    if not value.isdigit() or not 1 <= int(value) <= world:
        raise InputError("KVGRAPH_LOCAL_RANKS", value, f"a whole number from 1 to gpus ({world})")
    return int(value)


class RankSet:
    """The running ranks of one runtime: the store, the worker processes, rank 0's groups and engines."""

    def __init__(self, transformer, world: int):
        self.world = world
        self.device = next(transformer.parameters()).device
        self.timeout_s = collective_timeout()
        self.local = local_ranks(world)
        self.devices = rank_devices(self.device, world, self.local)
        self.pcontext = None
        self.groups = None
        self.engines = {}
        self.seq = 0
        self.version = None
        self.skeleton_digest = None
        self.exits: dict[int, str] = {}
        if self.device.type == "cuda":
            nccl_process_settings()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(os.environ.get("KVGRAPH_MASTER_ADDR", "127.0.0.1"),
                                   int(os.environ.get("KVGRAPH_MASTER_PORT", "0")), world, True, timeout,
                                   wait_for_workers=False)
        self.control = Control(self.store, 0, world)
        self.log_dir = tempfile.mkdtemp(prefix="kvgraph-ranks-")  # the launcher's error files

    # -- start and stop ----------------------------------------------------------------------------------------------

    def start(self, loaded) -> None:
        started = time.perf_counter()
        self._launch()
        self._wait_ready()
        self.groups = RankGroups(self.store, 0, self.world, self.device, self.timeout_s)
        self.send_model(loaded)
        logger.info("KV-Graph: %d ranks ready on %s in %.1f s (%s; worker pids %s).", self.world,
                    self.describe_devices(), time.perf_counter() - started, backend_for(self.device),
                    ", ".join(map(str, self.pids())) or "none")

    def _launch(self) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

        if self.local < 2:
            return
        path = os.pathsep.join(p for p in (str(PACK_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        envs, args = {}, {}
        for rank in range(1, self.local):
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port), "WORLD_SIZE": str(self.world),
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "KVGRAPH_DEVICE": str(self.devices[rank]),
                   "KVGRAPH_PARALLEL_TIMEOUT": str(self.timeout_s), "KVGRAPH_PARENT_PID": str(os.getpid()),
                   "PYTHONPATH": path}
            if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
                # N processes share the host's cores: without this each would start one thread per core.
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.local))
            envs[rank - 1] = env
            args[rank - 1] = ("-m", "graph_runtime.parallel.worker")
        logs = DefaultLogsSpecs(log_dir=self.log_dir, redirects=Std.NONE, tee=Std.NONE)
        with _process_signals_kept():
            self.pcontext = start_processes(name="kvgraph-rank", entrypoint=sys.executable, args=args, envs=envs,
                                            logs_specs=logs)

    def _wait_ready(self) -> None:
        keys = [f"ready/{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            self.health()
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys, 1) if not self.store.check([key])]
                raise ParallelStartError(f"rank(s) {', '.join(map(str, missing))} did not join within "
                                         f"{self.timeout_s:.0f} s")
            time.sleep(0.05)

    def send_model(self, loaded) -> None:
        """The weights to every rank: the whole module the first time or when its structure changed, else only
        new values into the same storages (the workers' graphs stay valid)."""
        skeleton, storages = model_skeleton(loaded.transformer)
        digest = hashlib.sha256(skeleton).hexdigest()
        whole = digest != self.skeleton_digest
        seq = self._post("load" if whole else "weights", skeleton if whole else b"")
        broadcast_storages(storages, self.groups.compute, self.device)
        del storages  # rank 0's storages are the model's own: never kept here
        self.control.answers(seq, self.timeout_s, self.health)
        self.skeleton_digest, self.version = digest, weights_version(loaded)
        self.engines = self.engines if not whole else {}

    def stop(self) -> None:
        """Ask the workers to exit, then make sure they did."""
        if self.groups is not None:
            try:
                seq = self._post("stop")
                self.control.answers(seq, min(self.timeout_s, 10.0), self.health)
                if self.pcontext is not None:
                    self.pcontext.wait(5, period=0.05)  # exited by themselves: nothing left to signal
            except Exception as exc:  # noqa: BLE001 - stopping anyway
                logger.debug("KV-Graph: ranks did not answer the stop: %s", exc)
        self.abort()

    def abort(self) -> None:
        """End every group and process now."""
        if self.groups is not None:
            self.groups.abort()
            self.groups = None
        if self.pcontext is not None:
            self.pcontext.close(timeout=5)
            self.pcontext = None
        self.engines = {}
        # The store closes now, not at some later garbage collection: a fixed KVGRAPH_MASTER_PORT is free for the
        # next start.
        self.store = self.control.store = None
        shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- health and failures -----------------------------------------------------------------------------------------

    def health(self) -> None:
        """Raise `PeerLost` when a worker process has exited or reported a failure."""
        if self.pcontext is not None:
            result = self.pcontext.wait(0)
            if result is not None:
                for local_rank, failure in result.failures.items():
                    self.exits[local_rank + 1] = _exit_text(failure.exitcode)
                self.pcontext = None  # the launcher closed the rest
                raise PeerLost(self.failure_text() or "a rank exited")
        if self.control.failures():
            raise PeerLost(self.failure_text())

    def failure_text(self) -> str:
        """What each failed rank reported, or how it exited."""
        parts = []
        reported = _quietly(self.control.failures, {})
        for rank in range(1, self.world):
            if rank in reported:
                parts.append(f"rank {rank} ({self.device_name(rank)}) failed: {reported[rank]}")
            elif rank in self.exits:
                parts.append(f"rank {rank} ({self.device_name(rank)}) {self.exits[rank]}")
        return "; ".join(parts)

    def collect_exits(self, wait_s: float = 3.0) -> None:
        """Give a worker that just died a moment to be reaped (or to finish reporting), so the message can say so."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                self.health()
            except PeerLost:
                return
            time.sleep(0.1)

    def device_name(self, rank: int) -> str:
        device = self.devices[rank]
        return "another host" if device is None else str(device)

    def describe_devices(self) -> str:
        return ", ".join(self.device_name(r) for r in range(self.world))

    def pids(self) -> list[int]:
        return sorted(self.pcontext.pids().values()) if self.pcontext is not None else []

    # -- a prompt ----------------------------------------------------------------------------------------------------

    def _post(self, kind: str, payload: bytes = b"") -> int:
        self.seq += 1
        self.control.post(self.seq, kind, payload)
        return self.seq

    def engine(self, transformer, request: SamplingRequest) -> ParallelEngine:
        plan = plan_for(self.world, request.do_cfg)
        engine = self.engines.get(plan)
        if engine is None:
            engine = self.engines[plan] = ParallelEngine(
                transformer, plan, 0, self.groups.sp(plan), self.groups.cfg(plan),
                watch=DeviceWatch(self.device, self.timeout_s, self.health))
        return engine

    def sample(self, loaded, request: SamplingRequest, on_step=None, should_stop=None,
               on_event=None) -> SampleResult:
        """One prompt on every rank. Raises `StoppedInStep` when every rank stopped at the same point (the ranks
        keep running); anything else (`PeerLost`, rank 0's own error) leaves the ranks for the caller to abort."""
        if weights_version(loaded) != self.version:
            self.send_model(loaded)
        engine = self.engine(loaded.transformer, request)
        seq = self._post("sample", dumps(request))
        deferred: list[BaseException] = []

        def step_done(step, total, latents):
            # A progress callback that raises (ComfyUI's progress bar on an interrupt) must not leave the other
            # ranks waiting in the next step: it is held, the ranks stop together at the next step, then it is raised.
            if on_step is not None and not deferred:
                try:
                    on_step(step, total, latents)
                except BaseException as exc:  # noqa: BLE001 - raised after the ranks stopped
                    deferred.append(exc)

        def stop() -> bool:
            return self.groups.stop_flag(bool(deferred) or bool(should_stop is not None and should_stop()))

        try:
            result = sample(engine, request, step_done, stop, on_event)
        except (Cancelled, KVGraphError) as exc:
            self.control.answers(seq, self.timeout_s, self.health)  # every rank met it: they wait for the next
            raise StoppedInStep(deferred[0] if deferred else exc) from None
        answers = self.control.answers(seq, self.timeout_s, self.health)
        if deferred:
            raise StoppedInStep(deferred[0])
        result.stats["ranks"] = [{"rank": 0, "device": str(self.device), **_per_rank(result.stats)}] + [
            {"rank": rank, "device": self.device_name(rank), **_per_rank(answer["stats"])}
            for rank, answer in sorted(answers.items())]
        plan = engine.plan
        result.stats["parallel"] = {"world": self.world, "cfg_groups": plan.cfg_groups, "sp": plan.sp,
                                    "backend": backend_for(self.device)}
        return result


@contextlib.contextmanager
def _process_signals_kept():
    """The launcher installs its own SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers when started from the main thread (it
    was written for torchrun, which owns its process), and warns when started from another. This process is
    ComfyUI's or the command line's: its handlers stay as they were, and the workers need no signal to end (they
    watch for rank 0, see worker.py)."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n, None) for n in names) if sig} if main else {}
    launcher_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = launcher_log.level
    launcher_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        launcher_log.setLevel(level)
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _per_rank(stats: dict) -> dict:
    keys = ("captures", "replays", "eager_steps", "prefill_captures", "prefill_replays", "eager_prefills")
    return {k: stats[k] for k in keys if k in stats}


def _exit_text(exitcode: int) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _quietly(fn, default):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a store that is gone has nothing more to say
        return default


class ParallelRuntime:
    """The parallel ranks of one loaded transformer. Prompts are run one at a time (the workers serve one)."""

    def __init__(self, loaded, world: int):
        self._loaded = weakref.ref(loaded)  # its owner (graph_runtime/loaded.py), which holds this runtime
        self.world = world
        self.ranks: RankSet | None = None
        self.fallback_reason: str | None = None
        self.starts = 0
        self.failures = 0
        self.last_failure: str | None = None
        self._lock = threading.Lock()
        _LIVE_RUNTIMES.add(self)

    def sample(self, request: SamplingRequest, on_step=None, should_stop=None, on_event=None) -> SampleResult:
        loaded = self._loaded()
        with self._lock:
            if self.fallback_reason is None:
                try:
                    ranks = self._running(loaded)
                except KVGraphError:
                    raise  # a count this model or machine cannot take: the user's to change
                except Exception as exc:  # noqa: BLE001 - any failure to start ends on one device, logged
                    self.fallback_reason = f"{type(exc).__name__}: {exc}"
                    logger.warning("KV-Graph: could not start %d ranks (%s); prompts run on one device until the "
                                   "model is loaded again.", self.world, self.fallback_reason)
            if self.fallback_reason is not None:
                return sample(loaded.engine, request, on_step, should_stop, on_event)
            try:
                return ranks.sample(loaded, request, on_step, should_stop, on_event)
            except StoppedInStep as stopped:
                raise stopped.error from None
            except BaseException as exc:
                raise self._failed(ranks, exc) from exc

    def _running(self, loaded) -> RankSet:
        """The ranks, started (again) when none run, when one was lost while idle, or when the model moved."""
        transformer = loaded.transformer
        ranks = self.ranks
        if ranks is not None:
            device = next(transformer.parameters()).device
            try:
                if device != ranks.device:
                    raise PeerLost(f"the model moved from {ranks.device} to {device}")
                ranks.health()
            except PeerLost as exc:
                logger.warning("KV-Graph: restarting the %d ranks: %s.", self.world, exc)
                ranks.abort()
                ranks = self.ranks = None
        if ranks is None:
            check_heads(self.world, transformer.config.num_attention_heads)
            ranks = RankSet(transformer, self.world)
            try:
                ranks.start(loaded)
            except BaseException:
                ranks.abort()
                raise
            self.ranks = ranks
            self.starts += 1
        return ranks

    def _failed(self, ranks: RankSet, exc: BaseException) -> ParallelFailure:
        ranks.collect_exits()
        others = ranks.failure_text()
        own = f"rank 0 ({ranks.device}): {type(exc).__name__}: {exc}"
        what = others or own
        ranks.abort()
        self.ranks = None
        self.failures += 1
        self.last_failure = what
        message = (f"KV-Graph: sampling on {self.world} devices failed: {what}. The other ranks were shut down; the "
                   "next prompt starts them again.")
        if others:
            message += f" (Rank 0 saw: {type(exc).__name__}: {str(exc)[:300]})"
        logger.error(message)
        return ParallelFailure(message)

    def shutdown(self) -> None:
        with self._lock:
            if self.ranks is not None:
                self.ranks.stop()
                self.ranks = None

    def status(self) -> dict:
        ranks = self.ranks
        return {"gpus": self.world, "running": ranks is not None, "fallback_reason": self.fallback_reason,
                "devices": ranks.describe_devices() if ranks else None, "pids": ranks.pids() if ranks else [],
                "starts": self.starts, "failures": self.failures, "last_failure": self.last_failure,
                "rank0_graphs": [engine.status() for engine in ranks.engines.values()] if ranks else []}


# The runtimes with workers, so that at interpreter exit the workers are told to stop (they would also notice rank
# 0's store going away). Process-wide by nature: the workers are this process's children.
_LIVE_RUNTIMES: "weakref.WeakSet" = weakref.WeakSet()
atexit.register(lambda: [r.shutdown() for r in list(_LIVE_RUNTIMES)])
