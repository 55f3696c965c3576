"""Plain-text reports of what the runtime did and holds: the one-line summary of a sampling run, and the status and
release reports (loaded models, decode-graph caches, the last request's memory budget, runs in progress).

Pure functions over the plain dicts the runtime already hands out (a `SamplingResult`'s `stats` and `timings`,
`engine.status()`, `MemoryBudget.as_dict()`, `engine.release()`), so whoever shows them (the ComfyUI nodes, their
HTTP routes, a log) words them the same way and a test can check the wording without a model. The byte units and
a module's stored size and compute dtype live here too, below the memory budget (graph_runtime/memory) that prices
them, so the decode package and the reports reach them without importing the budget.
"""

from __future__ import annotations

from collections import Counter

import torch

GiB = 2**30
MiB = 2**20

def gib(n: int | float) -> str:
    return f"{n / GiB:.1f} GiB"


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers as they are stored (int8 weights count one byte per value),
    counting shared storage once: the text encoder ties its head to its 1.2 GB embedding table."""
    seen, total = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        key = t.data_ptr() if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def block_sizes(transformer: torch.nn.Module) -> tuple[int, list[int]]:
    """(the whole transformer's bytes, each block's). Counted block by block: streamed blocks that share a device
    slot (stream_slots.py) view the same memory, which a count of distinct storages over the whole model would
    merge."""
    blocks = transformer.transformer_blocks
    sizes = [module_bytes(block) for block in blocks]
    inside = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
    seen, outside = set(), 0
    for t in (*transformer.parameters(), *transformer.buffers()):
        key = t.data_ptr() if t.device.type != "meta" else id(t)
        if id(t) not in inside and key not in seen:
            seen.add(key)
            outside += t.numel() * t.element_size()
    return outside + sum(sizes), sizes


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype activations run in: that of the first floating-point parameter (int8 weights are not)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.bfloat16


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8",
               getattr(torch, "float8_e4m3fn", None): "fp8 e4m3", getattr(torch, "float8_e5m2", None): "fp8 e5m2"}


def mib(n: int | float) -> str:
    return f"{n / MiB:.1f} MiB"


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def storage_text(module: torch.nn.Module) -> str:
    """How a loaded model's weights are stored (by share of their bytes) and what its activations compute in, as it
    is, not as the loader's dtype was asked: "int8 ConvRot 98% + bf16 2% weights, bf16 compute", "fp32 weights, fp32
    compute"."""
    from .quantized import int8_modules

    by_dtype: Counter = Counter()
    for p in module.parameters():  # shared (tied) parameters are listed once
        by_dtype[p.dtype] += p.numel() * p.element_size()
    total = sum(by_dtype.values()) or 1
    int8_kind = "int8 ConvRot" if int8_modules(module) else "int8"
    names = [(int8_kind if dtype == torch.int8 else dtype_name(dtype), n) for dtype, n in by_dtype.most_common()]
    weights = names[0][0] if len(names) == 1 else " + ".join(f"{name} {n / total:.0%}" for name, n in names)
    return f"{weights} weights, {dtype_name(compute_dtype(module))} compute"


def by_reason(counts: dict) -> str:
    """`{"no CUDA": 3}` -> "no CUDA: 3" (several joined by commas); an empty dict -> ""."""
    return ", ".join(f"{reason}: {n}" for reason, n in counts.items())


# -- one sampling run ------------------------------------------------------------------------------------------------


def prefill_path(stats: dict) -> str:
    """How the run's prefill ran: " (eager: <reasons>)", " (captured)", " (replayed)", or "" when the request had no
    graph entry (its eager steps say why)."""
    eager = stats.get("eager_prefills", {})
    if eager:
        return " (eager: " + ", ".join(eager) + ")"
    if stats.get("prefill_captures"):
        return " (captured)"
    return " (replayed)" if stats.get("prefill_replays") else ""


def run_summary(width: int, height: int, batch: int, result, preset: str, cfg: float) -> str:
    """One line for a finished run (`result`: anything with the sampler's `stats` and `timings` dicts): size, steps,
    schedule, prefill and per-step decode time, and how many steps were captured, replayed, eager (and why) or
    skipped by a step cache."""
    stats, timings = result.stats, result.timings
    eager = stats.get("eager_steps", {})
    reasons = by_reason(eager)
    skipped = stats.get("skipped_steps", 0)
    return (f"KV-Graph: {batch}x {width}x{height}, {timings.get('steps')} steps ({preset}, cfg {cfg:g}): "
            f"prefill {timings.get('prefill_ms', 0.0):.1f} ms{prefill_path(stats)}, decode "
            f"{timings.get('decode_ms_per_step', 0.0):.2f} ms/step, captures {stats.get('captures', 0)}, replays "
            f"{stats.get('replays', 0)}, eager steps {sum(eager.values())}" + (f" ({reasons})" if reasons else "")
            + (f", skipped steps {skipped} (step cache)" if skipped else ""))


# -- what is held ----------------------------------------------------------------------------------------------------

# The fields of `engine.status()` a status record carries, in the order it lists them.
GRAPH_CACHE_FIELDS = ("entries", "captures", "replays", "eager_steps", "eager_total", "evictions", "prefill_replays",
                      "prefill_captures", "eager_prefills", "skipped_steps", "bytes_held", "max_entries")


def graph_cache_fields(state: dict) -> dict:
    """The reported part of an engine's status (`engine.status()`); `compiled` is False when the engine says nothing."""
    return {**{name: state[name] for name in GRAPH_CACHE_FIELDS}, "compiled": state.get("compiled", False),
            # the attention asked for, what each device runs, and why it runs another kernel (reason -> count)
            "attention_requested": state.get("attention_requested"), "attention": state.get("attention", {}),
            "attention_fallbacks": state.get("attention_fallbacks", {}),
            # Where prefills put their prefix K/V (gpu, int8, host, recompute), and the pinned bytes entries hold.
            "prefix_placements": state.get("prefix_placements", {}), "host_bytes_held": state.get("host_bytes_held", 0)}


def budget_record(budget, device, available: int | None) -> dict:
    """A request's memory budget as the status reports it: its parts, where it ran and what was available there
    (None when the device reports no free memory)."""
    return {**budget.as_dict(), "device": str(device), "available_bytes": available}


def loaded_model_line(item: dict) -> str:
    """A loaded model (`kind`, `source`, `dtype` or the `storage` it has, `device`, `bytes`, `loads`)."""
    return (f"{item['kind']}: {item['source']} ({item.get('storage') or item['dtype']}, on {item['device']}, "
            f"{mib(item['bytes'])}, loaded {item['loads']}x)")


def graph_cache_lines(model: dict) -> list[str]:
    """An engine's status record (`graph_cache_fields` plus `engine_id`, `model`, `source`, `lora`, `budget`; or
    `engine_id` and `error` when it could not be read): a summary line, then indented details, one per entry."""
    if "error" in model:
        return [f"graph cache {model['engine_id']}: unreadable ({model['error']})"]
    lines = [f"graph cache of {model['model']} ({model['source'] or 'not loaded by a KV-Graph loader'}): "
             f"{len(model['entries'])} entries, {mib(model['bytes_held'])} held, {model['captures']} captures, "
             f"{model['replays']} replays, eager steps: {by_reason(model['eager_steps']) or 'none'}"
             + (f", skipped steps: {model['skipped_steps']} (step cache)" if model.get("skipped_steps") else "")
             + "; prefills: "
             f"{model['prefill_captures']} captured, {model['prefill_replays']} replayed, eager: "
             f"{by_reason(model['eager_prefills']) or 'none'}"
             + (f"; prefix K/V: {by_reason(model['prefix_placements'])}" if model.get("prefix_placements") else "")]
    if model.get("attention_requested"):
        runs = ", ".join(f"{kernel} on {where}" for where, kernel in model.get("attention", {}).items())
        lines.append(f"  attention: {model['attention_requested']}" + (f", runs {runs}" if runs else "")
                     + (f"; fallbacks: {by_reason(model['attention_fallbacks'])}"
                        if model.get("attention_fallbacks") else ""))
    lora = model["lora"]
    if lora["loras"]:
        names = ", ".join(f"{item['name']} ({item['strength']:g})" for item in lora["loras"])
        lines.append(f"  LoRAs merged: {names}; {lora['weights']} weights, originals {mib(lora['originals_bytes'])} "
                     "on the host")
    budget = model.get("budget")
    if budget:
        available = budget.get("available_bytes")
        lines.append(f"  last request's memory budget: {gib(budget['total_bytes'])}"
                     + (f" of {gib(available)} available" if available is not None else "")
                     + (" (VAE decode tiled)" if budget.get("vae_tiled") else ""))
        plan = budget.get("plan")
        if plan:
            lines.append(f"  {plan['text']}")
    lines += [f"  - {entry_line(entry)}" for entry in model["entries"]]
    return lines


def entry_line(entry: dict) -> str:
    """One graph entry of `engine.status()["entries"]`: its shape, then its state."""
    key = entry["key"]
    shape = f"{key['branch']} batch {key['batch']}, {key['prefix_tokens']}+{key['target_tokens']} tokens"
    if key.get("prefix_placement", "gpu") != "gpu":
        shape += f", prefix {key['prefix_placement']}"
    if entry.get("state") == "failed":
        return f"{shape}: failed ({entry['reason']})"
    return (f"{shape}: {entry['state']}, {entry['captures']} captures, {entry['replays']} replays, "
            f"{mib(entry['bytes'])}, owner alive: {entry['owner_alive']}")


def status_text(payload: dict) -> str:
    """The whole status (`loaded` models, graph-cache `models`, `running` runs) as lines of text."""
    lines = [] if payload["loaded"] else ["No models loaded by KV-Graph."]
    lines += [loaded_model_line(item) for item in payload["loaded"]]
    for model in payload["models"]:
        lines += graph_cache_lines(model)
    lines += [f"running: prompt {run['prompt_id']} node {run['node']} step {run['step']}/{run['total']}"
              for run in payload["running"]]
    return "\n".join(lines)


def release_text(result: dict) -> str:
    """What a release let go (`graphs`: per engine its result and bytes; `models`: the models dropped)."""
    lines = [f"graphs of {g['model']}: {g['result']} ({mib(g['bytes'])})" for g in result["graphs"]]
    lines += [f"model {m['kind']} {m['source']}: dropped" + ("" if m["unloaded"] else " (in use: unloads when done)")
              for m in result["models"]]
    return "\n".join(lines) or "Nothing to release."
