"""Sampling runs in progress and models in use, and the releases that wait for them.

Route handlers run on ComfyUI's server thread while a prompt samples on the worker thread. Releasing an engine's
graphs mid-run would throw away the entry the run is replaying (it would capture again on its next step), so a
release that finds the engine busy is deferred until the run ends: a prompt in flight keeps its entries. Likewise a
model a node is computing with (the transformer sampling, the text encoder encoding, the VAE encoding or decoding)
is not moved off its device mid-use: an offload asked for meanwhile happens when its last use ends.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

from ..graph_runtime.report import mib

logger = logging.getLogger("kvgraph")

_lock = threading.RLock()
_runs: dict[int, dict] = {}  # run id -> public progress of that run
_busy: dict[int, int] = {}  # id(engine) -> runs using it
_pending: dict[int, tuple[object, str]] = {}  # id(engine) -> (engine, why) released when its last run ends
_uses: dict[int, int] = {}  # id(patcher) -> nodes computing with that model now (LoRA chains share the patcher)
_offloads: dict[int, object] = {}  # id(patcher) -> handle to offload when its last use ends
_next_id = [0]


def begin_use(handle) -> None:
    """The model of `handle` is in use from now until `end_use`: an offload asked for meanwhile
    (`offload_when_idle`) waits for the end of its last use."""
    with _lock:
        _uses[id(handle.patcher)] = _uses.get(id(handle.patcher), 0) + 1


def end_use(handle) -> None:
    key = id(handle.patcher)
    with _lock:
        left = _uses.get(key, 1) - 1
        if left:
            _uses[key] = left
        else:
            _uses.pop(key, None)
    _offload_idle()


@contextmanager
def using(handle):
    """`begin_use` / `end_use` around a block that computes with `handle`'s model."""
    begin_use(handle)
    try:
        yield handle
    finally:
        end_use(handle)


def _offload_idle() -> None:
    """Offload every handle released while in use that nothing uses any more."""
    with _lock:
        idle = [h for h in _offloads.values() if not _uses.get(id(h.patcher), 0)
                and not (h.kind == "transformer" and _busy.get(id(h.engine), 0))]
        for handle in idle:
            _offloads.pop(id(handle.patcher), None)
    for handle in idle:
        handle.offload()
        logger.info("KV-Graph: %s %s moved off its device after its use ended (released while in use).",
                    handle.kind, handle.source)


def in_use(handle) -> bool:
    """Whether a node is computing with the model of `handle` (for a transformer: also a run on its engine)."""
    with _lock:
        used = _uses.get(id(handle.patcher), 0) > 0
    return used or (handle.kind == "transformer" and is_busy(handle.engine))


def offload_when_idle(handle) -> bool:
    """Move `handle`'s weights off their device now when nothing uses them (True), or when its last use (or its
    engine's last run) ends (False)."""
    if in_use(handle):
        with _lock:
            _offloads[id(handle.patcher)] = handle
        _offload_idle()  # the use may have ended between the check and the record
        return False
    handle.offload()
    return True


@contextmanager
def sampling(engine, prompt_id: str | None, node_id: str | None, total_steps: int):
    """Mark `engine` busy for the duration of one sampling run; yields the run's progress record."""
    with _lock:
        _next_id[0] += 1
        run_id = _next_id[0]
        record = {"run": run_id, "prompt_id": prompt_id, "node": node_id, "model": engine.name,
                  "step": 0, "total": total_steps, "started": time.time()}
        _runs[run_id] = record
        _busy[id(engine)] = _busy.get(id(engine), 0) + 1
    try:
        yield record
    finally:
        with _lock:
            _runs.pop(run_id, None)
            left = _busy.get(id(engine), 1) - 1
            if left:
                _busy[id(engine)] = left
            else:
                _busy.pop(id(engine), None)
            pending = _pending.pop(id(engine), None) if not left else None
        if pending is not None:
            _release_now(engine, pending[1])
        _offload_idle()


def update(record: dict, step: int, total: int) -> None:
    with _lock:
        record["step"], record["total"] = step, total


def runs() -> list[dict]:
    with _lock:
        return [dict(r) for r in _runs.values()]


def is_busy(engine) -> bool:
    with _lock:
        return _busy.get(id(engine), 0) > 0


def release_graphs(engine, reason: str = "requested") -> str:
    """Release the engine's graphs now, or when its running sampler finishes. Returns "released" or "deferred"."""
    with _lock:
        if _busy.get(id(engine), 0):
            _pending[id(engine)] = (engine, reason)
            return "deferred"
    _release_now(engine, reason)
    return "released"


def _release_now(engine, reason: str) -> None:
    held = engine.release()
    if held.get("entries"):
        logger.info("KV-Graph: released %d decode graph entries (%s) of %s: %s.", held["entries"],
                    mib(held.get("bytes", 0)), engine.name, reason)
