"""Sampling runs in progress, and graph releases that wait for them.

Route handlers run on ComfyUI's server thread while a prompt samples on the worker thread. Releasing an engine's
graphs mid-run would throw away the entry the run is replaying (it would capture again on its next step), so a
release that finds the engine busy is deferred until the run ends: a prompt in flight keeps its entries.
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
_next_id = [0]


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
