"""What the pack holds (loaded models, decode graphs, runs in progress) and how to let it go.

Shared by the HTTP routes and the cache nodes, so both report and release the same way. The loaded transformers
are the model cache's (each owns its engines, graph_runtime/loaded.py); graph-manager state is read through
`engine.status()`, which holds the manager's lock; the text reports are worded by graph_runtime/report.py.
"""

from __future__ import annotations

from ..graph_runtime.report import graph_cache_fields, release_text, status_text
from . import in_flight, model_cache


def _handle_for(loaded, handles):
    for handle in handles:
        if handle.module is loaded.transformer:
            return handle
    return None


def _engines():
    """(owner, engine) for every engine of every loaded transformer."""
    return [(loaded, engine) for loaded in model_cache.loaded_transformers() for engine in loaded.engines()]


def status_payload() -> dict:
    """JSON-ready: per loaded transformer its graph entries and counters, plus every loaded model and active run."""
    handles = model_cache.handles()
    models = []
    for loaded, engine in _engines():
        try:
            if engine.transformer is None:
                continue
            state = engine.status()
        except Exception as exc:  # noqa: BLE001 - one odd engine (another pack's, say) must not break the route
            models.append({"engine_id": f"{id(engine):x}", "error": f"{type(exc).__name__}: {exc}"})
            continue
        handle = _handle_for(loaded, handles)
        models.append({
            "engine_id": f"{id(engine):x}",
            "model": state["model"],
            "source": handle.source if handle else None,
            "dtype": handle.dtype_name if handle else None,
            "device": str(handle.device) if handle else None,
            "loads": model_cache.load_count(handle.key) if handle else None,
            "busy": loaded.busy,
            **graph_cache_fields(state),
            "lora": loaded.merged_loras(),
            "budget": handle.last_budget if handle else None,
        })
    loaded = []
    for handle in handles:
        item = handle.describe()
        item["loads"] = model_cache.load_count(handle.key)
        loaded.append(item)
    return {"models": models, "loaded": loaded, "running": in_flight.runs()}


def release(models: bool = False) -> dict:
    """Release every decode graph (deferred for an engine a sampler is using right now); with `models`, also drop
    the loaded models from the pack's cache and move their weights off the GPU."""
    graphs = []
    for loaded in model_cache.loaded_transformers():
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
        for handle in model_cache.forget_all():
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
