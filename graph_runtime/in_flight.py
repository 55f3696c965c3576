"""Sampling runs in progress and models in use, and the releases that wait for them.

Route handlers run on ComfyUI's server thread while a prompt samples on the worker thread. Releasing a model's
graphs mid-run would throw away the entry the run is replaying (it would capture again on its next step), so the
loaded model (graph_runtime/loaded.py) counts its runs and defers a release that finds it busy until they end: a
prompt in flight keeps its entries. Likewise a model a node is computing with (the transformer sampling, the text
encoder encoding, the VAE encoding or decoding) is not moved off its device mid-use: an offload asked for meanwhile
happens when its last use ends. This module keeps the runs' public progress and those uses (of any model object
with a `patcher`, `kind` and `offload()`: the ComfyUI nodes' model handles); it needs no ComfyUI itself.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

logger = logging.getLogger("kvgraph")

# Guards the tables below (the worker thread's nodes and the server thread's routes read and change them).
_lock = threading.RLock()
_runs: dict[int, dict] = {}  # run id -> public progress of that run
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
                and not (h.kind == "transformer" and h.loaded.busy)]
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
    return used or (handle.kind == "transformer" and handle.loaded.busy)


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
def sampling(loaded, prompt_id: str | None, node_id: str | None, total_steps: int):
    """One sampling run on `loaded` (graph_runtime/loaded.py), busy for its duration (a graph release waits for its
    end); yields the run's progress record."""
    with _lock:
        _next_id[0] += 1
        run_id = _next_id[0]
        record = {"run": run_id, "prompt_id": prompt_id, "node": node_id, "model": loaded.engine.name,
                  "step": 0, "total": total_steps, "started": time.time()}
        _runs[run_id] = record
    try:
        with loaded.running():
            yield record
    finally:
        with _lock:
            _runs.pop(run_id, None)
        _offload_idle()


def update(record: dict, step: int, total: int) -> None:
    with _lock:
        record["step"], record["total"] = step, total


def runs() -> list[dict]:
    with _lock:
        return [dict(r) for r in _runs.values()]
