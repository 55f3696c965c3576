"""What the pack holds (loaded models, decode graphs, runs in progress) and how to let it go.

Shared by the HTTP routes and the cache nodes, so both report and release the same way. Graph-manager state is
read through `engine.status()`, which holds the manager's lock; the text reports are worded by graph_runtime/report.py.
"""

from __future__ import annotations

from ..graph_runtime.lora import merged_loras
from ..graph_runtime.registry import process_registry
from ..graph_runtime.report import graph_cache_fields, release_text, status_text
from . import in_flight, model_cache


def _handle_for(engine, handles):
    transformer = engine.transformer
    for handle in handles:
        if handle.module is transformer:
            return handle
    return None


def status_payload() -> dict:
    """JSON-ready: per loaded transformer its graph entries and counters, plus every loaded model and active run."""
    handles = model_cache.handles()
    models = []
    for engine in process_registry().engines():
        try:
            if engine.transformer is None:
                continue
            state = engine.status()
        except Exception as exc:  # noqa: BLE001 - one odd engine (another pack's, say) must not break the route
            models.append({"engine_id": f"{id(engine):x}", "error": f"{type(exc).__name__}: {exc}"})
            continue
        handle = _handle_for(engine, handles)
        models.append({
            "engine_id": f"{id(engine):x}",
            "model": state["model"],
            "source": handle.source if handle else None,
            "dtype": handle.dtype_name if handle else None,
            "device": str(handle.device) if handle else None,
            "loads": model_cache.load_count(handle.key) if handle else None,
            "busy": in_flight.is_busy(engine),
            **graph_cache_fields(state),
            "lora": merged_loras(engine.transformer),
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
    for engine in process_registry().engines():
        try:
            if engine.transformer is None:
                continue
            bytes_held = engine.bytes_held()
            result = in_flight.release_graphs(engine, reason="released by the user")
        except Exception as exc:  # noqa: BLE001 - release the others regardless
            graphs.append({"engine_id": f"{id(engine):x}", "model": None, "result": f"failed: {exc}", "bytes": 0})
            continue
        graphs.append({"model": engine.name, "engine_id": f"{id(engine):x}", "result": result,
                       "bytes": bytes_held})
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
