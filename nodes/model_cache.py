"""The pack's loaded models, kept for the life of the ComfyUI process.

ComfyUI's own output cache may drop a loader's result (the classic cache does when another workflow runs, the LRU
cache when it is full); loading the file again would give a new transformer and so a new, empty graph manager. This
cache is keyed by what the user loaded (file identity: real path, size, mtime; dtype; options), so every workflow
that loads the same file gets the same model object back, and its captured graphs with it. Entries leave when the
user releases them or the file changes on disk. ComfyUI can still move their weights off the GPU at any time.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Callable

from ..graph_runtime.comfy_interop.files import file_identity
from ..graph_runtime.report import mib, storage_text

logger = logging.getLogger("kvgraph")

_lock = threading.RLock()
_handles: dict[tuple, object] = {}
_loads: Counter = Counter()  # key -> how many times it was loaded from disk (the status route reports it)


def cache_key(kind: str, path: str, dtype_name: str, *options) -> tuple:
    return (kind, file_identity(path), dtype_name, *options)


def get_or_load(key: tuple, load: Callable[[], object]):
    """The cached handle for `key`, or `load()`'s result, cached.

    Loading happens outside the lock: it can take minutes, and status requests must not wait for it.
    """
    with _lock:
        handle = _handles.get(key)
    if handle is not None:
        logger.debug("KV-Graph: reusing loaded %s %s", key[0], key[1][0])
        return handle
    handle = load()
    handle.key = key
    with _lock:
        stale = [k for k in _handles if k[0] == key[0] and k[1][0] == key[1][0] and k[2:] == key[2:] and k != key]
        dropped = [_drop(k, "file changed on disk") for k in stale]
        _handles[key] = handle
        _loads[key] += 1
    for old in dropped:  # the same file changed on disk: its old weights are dead weight now
        old.offload()
    logger.info("KV-Graph: loaded %s from %s (%s, %s)", key[0], key[1][0], storage_text(handle.module),
                mib(handle.size_bytes))
    return handle


def adopt(handle) -> None:
    """Put a handle that is being used back in the cache if it was released while ComfyUI's own output cache still
    held it: it is loaded again, so later workflows loading the same file must get it rather than a second copy.
    A handle with LoRAs chained on goes back as the loader's own handle: the cache holds models, not LoRA sets."""
    handle = getattr(handle, "base", None) or handle
    key = getattr(handle, "key", None)
    if not key:
        return
    with _lock:
        if key not in _handles:
            _handles[key] = handle


def handles() -> list:
    with _lock:
        return list(_handles.values())


def load_count(key: tuple) -> int:
    with _lock:
        return _loads[key]


def forget_all(reason: str = "released by the user") -> list:
    """Drop every cached model; returns the handles dropped (their weights go once nothing else holds them)."""
    with _lock:
        keys = list(_handles)
        return [_drop(k, reason) for k in keys]


def _drop(key: tuple, reason: str):
    handle = _handles.pop(key)
    logger.info("KV-Graph: dropping %s %s: %s", key[0], key[1][0], reason)
    return handle
