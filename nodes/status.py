"""What the pack holds (loaded models, decode graphs, runs in progress) and how to let it go.

Shared by the HTTP routes and the cache nodes, so both report and release the same way. Graph-manager state is
read through `engine.status()`, which holds the manager's lock.
"""

from __future__ import annotations

from ..graph_runtime.lora import merged_loras
from ..graph_runtime.registry import process_registry
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
            "entries": state["entries"],
            "captures": state["captures"],
            "replays": state["replays"],
            "eager_steps": state["eager_steps"],
            "eager_total": state["eager_total"],
            "evictions": state["evictions"],
            "prefill_replays": state["prefill_replays"],
            "prefill_captures": state["prefill_captures"],
            "eager_prefills": state["eager_prefills"],
            "bytes_held": state["bytes_held"],
            "max_entries": state["max_entries"],
            "compiled": state.get("compiled", False),
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
            bytes_held = engine.manager.bytes_held()
            result = in_flight.release_graphs(engine, reason="released by the user")
        except Exception as exc:  # noqa: BLE001 - release the others regardless
            graphs.append({"engine_id": f"{id(engine):x}", "model": None, "result": f"failed: {exc}", "bytes": 0})
            continue
        graphs.append({"model": engine.manager.name, "engine_id": f"{id(engine):x}", "result": result,
                       "bytes": bytes_held})
    dropped = []
    if models:
        for handle in model_cache.forget_all():
            busy = handle.kind == "transformer" and in_flight.is_busy(handle.engine)
            if not busy:  # a running sampler keeps its weights where they are until it finishes
                handle.offload()
            dropped.append({"kind": handle.kind, "source": handle.source, "unloaded": not busy})
    return {"graphs": graphs, "models": dropped}


def status_report() -> str:
    """The status as text, for the cache-status node."""
    payload = status_payload()
    lines = []
    if not payload["loaded"]:
        lines.append("No models loaded by KV-Graph.")
    for item in payload["loaded"]:
        lines.append(f"{item['kind']}: {item['source']} ({item['dtype']}, on {item['device']}, "
                     f"{item['bytes'] / 2**20:.1f} MiB, loaded {item['loads']}x)")
    for model in payload["models"]:
        if "error" in model:
            lines.append(f"graph cache {model['engine_id']}: unreadable ({model['error']})")
            continue
        eager = ", ".join(f"{reason}: {n}" for reason, n in model["eager_steps"].items()) or "none"
        eager_prefills = ", ".join(f"{reason}: {n}" for reason, n in model["eager_prefills"].items()) or "none"
        lines.append(f"graph cache of {model['model']} ({model['source'] or 'not loaded by a KV-Graph loader'}): "
                     f"{len(model['entries'])} entries, {model['bytes_held'] / 2**20:.1f} MiB held, "
                     f"{model['captures']} captures, {model['replays']} replays, eager steps: {eager}; prefills: "
                     f"{model['prefill_captures']} captured, {model['prefill_replays']} replayed, eager: "
                     f"{eager_prefills}")
        lora = model["lora"]
        if lora["loras"]:
            names = ", ".join(f"{item['name']} ({item['strength']:g})" for item in lora["loras"])
            lines.append(f"  LoRAs merged: {names}; {lora['weights']} weights, originals "
                         f"{lora['originals_bytes'] / 2**20:.1f} MiB on the host")
        budget = model.get("budget")
        if budget:
            available = budget.get("available_bytes")
            lines.append(f"  last request's memory budget: {budget['total_bytes'] / 2**30:.1f} GiB"
                         + (f" of {available / 2**30:.1f} GiB available" if available is not None else "")
                         + (" (VAE decode tiled)" if budget.get("vae_tiled") else ""))
        for entry in model["entries"]:
            key = entry["key"]
            shape = f"{key['branch']} batch {key['batch']}, {key['prefix_tokens']}+{key['target_tokens']} tokens"
            if entry.get("state") == "failed":
                lines.append(f"  - {shape}: failed ({entry['reason']})")
            else:
                lines.append(f"  - {shape}: {entry['state']}, {entry['captures']} captures, {entry['replays']} "
                             f"replays, {entry['bytes'] / 2**20:.1f} MiB, owner alive: {entry['owner_alive']}")
    for run in payload["running"]:
        lines.append(f"running: prompt {run['prompt_id']} node {run['node']} step {run['step']}/{run['total']}")
    return "\n".join(lines)


def release_report(models: bool) -> str:
    result = release(models)
    lines = [f"graphs of {g['model']}: {g['result']} ({g['bytes'] / 2**20:.1f} MiB)" for g in result["graphs"]]
    lines += [f"model {m['kind']} {m['source']}: dropped" + ("" if m["unloaded"] else " (in use: unloads when done)")
              for m in result["models"]]
    return "\n".join(lines) or "Nothing to release."

