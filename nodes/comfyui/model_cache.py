"""The pack's loaded models, kept across prompts and workflows, within a bound; what they hold and how to let it go.

ComfyUI's own output cache may drop a loader's result (the classic cache does when another workflow runs, the LRU
cache when it is full); loading the file again would give a new transformer and so a new, empty graph manager. This
cache is keyed by what the user loaded (file identity: real path, size, mtime; dtype; options), so every workflow
that loads the same file gets the same model object back, and its captured graphs with it. ComfyUI can still move
their weights off the GPU at any time.

Entries leave when the user releases them, when the file changes on disk, and when the cache is over its bound:
least recently used first, until the models' host memory is within the limit (graph_runtime/eviction.py:
KVGRAPH_MODEL_CACHE_GB, by default half the RAM) and, where this ComfyUI has a RAM-pressure cache, until the host
has the headroom ComfyUI keeps free. Each eviction is logged. A model in use, or asked for by the prompt running
now, stays. An evicted model that something else still holds (ComfyUI's output cache, a prompt) is handed back by
the next load of the same file rather than read again, so an eviction never makes a second copy.

The status and release (`status_payload`, `release`) are the HTTP routes' and the cache nodes' alike, so both report
and release the same way: graph-manager state is read through `engine.status()`, which holds the manager's lock;
the text reports are worded by graph_runtime/report.py.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter, OrderedDict
from typing import Callable

from ...graph_runtime import eviction, in_flight
from ...graph_runtime.comfy_interop.files import file_identity
from ...graph_runtime.memory import GiB, gib, host_available_bytes
from ...graph_runtime.report import graph_cache_fields, mib, release_text, status_text, storage_text
from .events import executing_ids

logger = logging.getLogger("kvgraph")

_lock = threading.RLock()
_handles: OrderedDict[tuple, object] = OrderedDict()  # least recently used first
_evicted: dict[tuple, weakref.ref] = {}  # key -> an evicted handle, for as long as something else holds it
_loads: Counter = Counter()  # key -> how many times it was loaded from disk (the status route reports it)
# Every transformer this cache loaded that is still alive (cached, evicted or released but held elsewhere, e.g. by
# ComfyUI's output cache): the status and release routes reach their graphs through it.
_transformers: "weakref.WeakSet" = weakref.WeakSet()


def cache_key(kind: str, path: str, dtype_name: str, *options) -> tuple:
    return (kind, file_identity(path), dtype_name, *options)


def get_or_load(key: tuple, load: Callable[[], object]):
    """The cached handle for `key`, or `load()`'s result, cached; the cache is then trimmed to its bound.

    Loading happens outside the lock: it can take minutes, and status requests must not wait for it.
    """
    with _lock:
        handle = _handles.get(key) or _revive(key)
        if handle is not None:
            _handles.move_to_end(key)
    if handle is not None:
        _mark_prompt(handle)
        logger.debug("KV-Graph: reusing loaded %s %s", key[0], key[1][0])
        trim(keep=key)  # ComfyUI's RAM pressure may have grown since the last load
        return handle
    trim(keep=key)  # make room before the load, as far as the bound allows
    handle = load()
    handle.key = key
    _mark_prompt(handle)
    with _lock:
        if handle.kind == "transformer":
            _transformers.add(handle.loaded)
        stale = [k for k in _handles if k[0] == key[0] and k[1][0] == key[1][0] and k[2:] == key[2:] and k != key]
        dropped = [_drop(k, "file changed on disk") for k in stale]
        _handles[key] = handle
        _loads[key] += 1
    for old in dropped:  # the same file changed on disk: its old weights are dead weight now
        old.offload()
    logger.info("KV-Graph: loaded %s from %s (%s, %s)", key[0], key[1][0], storage_text(handle.module),
                mib(handle.size_bytes))
    trim(keep=key)
    return handle


def adopt(handle) -> None:
    """Put a handle that is being used back in the cache if it was released (or evicted) while ComfyUI's own output
    cache still held it: it is loaded again, so later workflows loading the same file must get it rather than a
    second copy; and mark it the most recently used. A handle with LoRAs chained on goes back as the loader's own
    handle: the cache holds models, not LoRA sets."""
    handle = getattr(handle, "base", None) or handle
    key = getattr(handle, "key", None)
    if not key:
        return
    with _lock:
        _evicted.pop(key, None)
        if _handles.get(key) is not handle:
            _handles[key] = handle
        _handles.move_to_end(key)
    _mark_prompt(handle)


def handles() -> list:
    with _lock:
        return list(_handles.values())


def loaded_transformers() -> list:
    """The owners (graph_runtime/loaded.py) of every transformer loaded here that is still alive."""
    with _lock:
        return list(_transformers)


def load_count(key: tuple) -> int:
    with _lock:
        return _loads[key]


def forget_all(reason: str = "released by the user") -> list:
    """Drop every cached model; returns the handles dropped (their weights go once nothing else holds them)."""
    with _lock:
        _evicted.clear()
        return [_drop(k, reason) for k in list(_handles)]


def trim(keep: tuple | None = None) -> list:
    """Evict least recently used models until the cache is within its limit and ComfyUI's RAM headroom is met; a
    model in use, loaded for the running prompt, or `keep`, stays. Returns the handles evicted."""
    prompt = executing_ids()[0]
    limit, headroom = eviction.limit_bytes(), ram_headroom()
    available = host_available_bytes() if headroom else None
    shortfall = max(0, headroom - available) if available is not None else 0
    with _lock:
        entries = [eviction.Entry(k, host_bytes(h), evictable=k != keep and not in_flight.in_use(h)
                                  and (prompt is None or getattr(h, "last_prompt", None) != prompt))
                   for k, h in _handles.items()]
        total, evicted = sum(e.bytes for e in entries), []
        for entry in eviction.evictions(entries, limit, shortfall):
            why = (f"the cached models hold {gib(total)} of host memory, over the limit of {gib(limit)} "
                   f"({eviction.LIMIT_VARIABLE})" if limit is not None and total > limit else
                   f"ComfyUI keeps {gib(headroom)} of RAM free and {gib(available)} is available")
            handle = _drop(entry.key, f"evicted, least recently used ({mib(entry.bytes)} of host memory): {why}")
            _evicted[entry.key] = weakref.ref(handle)
            evicted.append(handle)
            total -= entry.bytes
    return evicted


def host_bytes(handle) -> int:
    """The host memory a cached model holds (its weights on the CPU, its pinned host copy)."""
    return int(getattr(handle, "host_bytes", 0) or 0)


def ram_headroom() -> int:
    """The host memory ComfyUI's RAM-pressure cache keeps free, where this ComfyUI has one: 0.33.0 sets it for each
    prompt (comfy.memory_management.RAM_CACHE_HEADROOM), 0.8.0 takes it from --cache-ram (GiB); else 0."""
    try:
        import comfy.memory_management as comfy_memory

        headroom = int(getattr(comfy_memory, "RAM_CACHE_HEADROOM", 0) or 0)
        if headroom:
            return headroom
    except Exception:  # noqa: BLE001 - absent, or not importable on this ComfyUI: no such policy
        pass
    try:
        from comfy.cli_args import args

        value = getattr(args, "cache_ram", 0)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        return int(float(value or 0) * GiB)
    except Exception:  # noqa: BLE001
        return 0


def _revive(key: tuple):
    """An evicted handle for `key` that is still alive elsewhere, back in the cache: no second copy is loaded."""
    ref = _evicted.pop(key, None)
    handle = ref() if ref is not None else None
    if handle is not None:
        _handles[key] = handle
        logger.info("KV-Graph: %s %s was evicted but is still in memory: reused, not loaded again", key[0],
                    key[1][0])
    return handle


def _mark_prompt(handle) -> None:
    """Remember the prompt that last asked for `handle`: the running prompt's models are not evicted."""
    handle.last_prompt = executing_ids()[0]


def _drop(key: tuple, reason: str):
    handle = _handles.pop(key)
    logger.info("KV-Graph: dropping %s %s: %s", key[0], key[1][0], reason)
    return handle


# -- what the pack holds, and letting it go ----------------------------------------------------------------------------


def _handle_for(loaded, handles):
    for handle in handles:
        if handle.module is loaded.transformer:
            return handle
    return None


def _engines():
    """(owner, engine) for every engine of every loaded transformer."""
    return [(loaded, engine) for loaded in loaded_transformers() for engine in loaded.engines()]


def status_payload() -> dict:
    """JSON-ready: per loaded transformer its graph entries and counters, plus every loaded model and active run."""
    held = handles()
    models = []
    for loaded, engine in _engines():
        try:
            if engine.transformer is None:
                continue
            state = engine.status()
        except Exception as exc:  # noqa: BLE001 - one odd engine (another pack's, say) must not break the route
            models.append({"engine_id": f"{id(engine):x}", "error": f"{type(exc).__name__}: {exc}"})
            continue
        handle = _handle_for(loaded, held)
        models.append({
            "engine_id": f"{id(engine):x}",
            "model": state["model"],
            "source": handle.source if handle else None,
            "dtype": handle.dtype_name if handle else None,
            "device": str(handle.device) if handle else None,
            "loads": load_count(handle.key) if handle else None,
            "busy": loaded.busy,
            **graph_cache_fields(state),
            "lora": loaded.merged_loras(),
            "budget": handle.last_budget if handle else None,
        })
    loaded = []
    for handle in held:
        item = handle.describe()
        item["loads"] = load_count(handle.key)
        loaded.append(item)
    return {"models": models, "loaded": loaded, "running": in_flight.runs()}


def release(models: bool = False) -> dict:
    """Release every decode graph (deferred for an engine a sampler is using right now); with `models`, also drop
    the loaded models from the pack's cache and move their weights off the GPU."""
    graphs = []
    for loaded in loaded_transformers():
        engines = loaded.engines()
        try:
            bytes_held = [engine.bytes_held() for engine in engines]
            result = loaded.release_graphs(reason="released by the user")
        except Exception as exc:  # noqa: BLE001 - release the others regardless
            graphs += [{"engine_id": f"{id(engine):x}", "model": None, "result": f"failed: {exc}", "bytes": 0}
                       for engine in engines]
            continue
        graphs += [{"model": engine.name, "engine_id": f"{id(engine):x}", "result": result, "bytes": held}
                   for engine, held in zip(engines, bytes_held)]
    dropped = []
    if models:
        for handle in forget_all():
            # A model a node is computing with (sampling, encoding, decoding) keeps its weights where they are
            # until that use ends, then leaves.
            unloaded = in_flight.offload_when_idle(handle)
            dropped.append({"kind": handle.kind, "source": handle.source, "unloaded": unloaded})
    return {"graphs": graphs, "models": dropped}


def status_report() -> str:
    """The status as text, for the cache-status node."""
    return status_text(status_payload())


def release_report(models: bool) -> str:
    return release_text(release(models))
