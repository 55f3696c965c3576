"""What ComfyUI can give a sampling request, for the one memory check (graph_runtime.memory.check_sampling_request),
run before anything is loaded or allocated.

ComfyUI makes room by unloading models, and the pack's idle decode graphs are reused (same shapes) or evicted, so
a request may use: what the device has free (the smaller of ComfyUI's figure and the runtime's, which honours a
per-process memory fraction and leaves out the graphs' private pools) + the request's own models already there +
every other model ComfyUI could unload from it + the decode graphs the pack holds.
"""

from __future__ import annotations

import logging

import torch

import comfy.model_management as mm

from ...graph_runtime import memory
from ...graph_runtime.memory import plan as plans
from ...graph_runtime.report import budget_record
from . import model_cache
from .model_handles import TE_AUTO, TE_GPU, TE_STREAMED, same_device

logger = logging.getLogger("kvgraph")
_said: set = set()


def free_bytes(device) -> int | None:
    """Memory a new allocation on `device` (a GPU, or the CPU: the host's memory) can get now; None when nothing
    reports it."""
    engines = [engine for loaded in model_cache.loaded_transformers() for engine in loaded.engines()]
    runtime = memory.available_bytes(device, engines)
    comfy = mm.get_free_memory(device) if hasattr(mm, "get_free_memory") else None
    known = [int(v) for v in (runtime, comfy) if v is not None]
    return min(known) if known else None


def _latest(kind: str):
    found = [h for h in model_cache.handles() if h.kind == kind]
    return found[-1] if found else None


def _resident_bytes(handle, device) -> int:
    if handle is None or not same_device(handle.device, device):
        return 0
    streamed = handle.patcher.stream_plan()  # a partial load holds only its resident part there
    return streamed.resident if streamed is not None else handle.size_bytes


def _frees(patcher, device) -> bool:
    """Whether unloading `patcher` frees memory on `device`: not when it would only move to the same device (every
    model's offload device is the CPU, so on the CPU unloading frees nothing; cached models are not counted there
    as memory a request could have)."""
    offload = getattr(patcher, "offload_device", None)
    return offload is None or not same_device(offload, device)


def _unloadable_bytes(device, keep) -> int:
    """Weights of the other models ComfyUI holds on `device`, which it unloads when a request needs the room."""
    kept = {id(h.patcher) for h in keep if h is not None}
    loaded = getattr(mm, "current_loaded_models", None)
    if loaded is None:  # no model list to read: the pack's own models are all it can know of
        return sum(int(h.patcher.loaded_size()) for h in model_cache.handles()
                   if id(h.patcher) not in kept and same_device(h.device, device) and _frees(h.patcher, device))
    total = 0
    for entry in list(loaded):
        patcher = entry.model
        if (patcher is not None and id(patcher) not in kept and same_device(entry.device, device)
                and _frees(patcher, device)):
            total += int(entry.model_loaded_memory())
    return total


def _release_hint(device, keep) -> list[str]:
    """On the CPU, unloading frees nothing (`_frees`), but the pack's cache may hold other models there: name them
    as what releasing would free, without counting them as available."""
    kept = {id(h) for h in keep if h is not None}
    cached = sum(h.size_bytes for h in model_cache.handles()
                 if id(h) not in kept and same_device(h.device, device) and not _frees(h.patcher, device))
    if not cached:
        return []
    return [f"release KV-Graph's other cached models ({memory.gib(cached)} on {device}: the KV-Graph Release node "
            'with models, or POST /kvgraph/release {"models": true})']


def _control_bytes(transformer, request) -> dict[str, int]:
    """The request's ControlNet (graph_runtime/controlnet), priced as another weight on the device."""
    if request.control is None:
        return {}
    prefix = max(memory.request_shape(request).prefix_tokens)
    return {"ControlNet": request.control.memory_bytes(transformer, request.batch_size, prefix,
                                                       request.latent_height * request.latent_width)}


def _text_encoder_size(handle):
    return None if handle is None else memory.TextEncoderSize.of(handle.module)


def check_request(model, request, device) -> memory.MemoryBudget:
    """The request's budget against what ComfyUI can give it, kept on the handle for /kvgraph/status; raises
    MemoryBudgetError (naming the settings to change) when no memory plan fits even after ComfyUI unloads
    everything else. The budget's `plan` (graph_runtime/memory/plan.py) says how many blocks stay resident: the
    sampler loads so (`LoadedTransformer.following`)."""
    vae = _latest("vae")
    vae_dims = memory.VaeDims.of(vae.module) if vae is not None else memory.VaeDims.standard(
        memory.compute_dtype(model.module))
    # A LoRA chain's handle shares the loader's model; the status reads the loader's handle.
    reported = getattr(model, "base", None) or model
    free = free_bytes(device)
    available = None if free is None else memory.Available(free, (
        ("of this request's models", _resident_bytes(model, device) + _resident_bytes(vae, device)),
        ("of models ComfyUI can unload", _unloadable_bytes(device, keep=(model, vae))),
        ("of decode graphs", memory.graph_bytes_held(
            engine for loaded in model_cache.loaded_transformers() for engine in loaded.engines())),
    ))
    text_encoder = _latest("text_encoder")
    kept = (text_encoder.placement, text_encoder.size_bytes) if (
        text_encoder is not None and text_encoder.placement == TE_GPU) else None
    budget = memory.check_sampling_request(
        model.module, request, available, device, vae_dims, other_weights=_control_bytes(model.module, request),
        more_options=lambda: _release_hint(device, keep=(model, vae)),
        host_free=free_bytes(torch.device("cpu")) if available is not None else None, vae_assumed=vae is None,
        kept_text_encoder=kept, text_encoder=_text_encoder_size(text_encoder), stream=model.gpus == 1,
        text_encoder_placement=None if text_encoder is None else text_encoder.placement)
    reported.last_budget = budget_record(budget, device, None if available is None else available.total)
    return budget


def encode_placement(text_encoder, tokens: int) -> tuple[str, int]:
    """The placement one encode of about `tokens` runs, and the GPU bytes a streamed one needs (its outside part, the
    layers in flight, the activations). `auto`: the memory plan's placement (plan.text_encoder_placement) for what
    ComfyUI can give the encode: the free memory, the encoder's own loaded bytes and every other model it can
    unload. A forced choice runs as set; where the plan would place the encoder in less memory, the log says so
    once."""
    device = text_encoder.patcher.load_device
    size = plans.TextEncoderSize.of(text_encoder.module)
    need = size.gpu_bytes(TE_STREAMED, tokens)
    chosen = text_encoder.placement
    if not text_encoder.streams_here():  # a CPU device: the weights are there already, nothing to place
        return (plans.TE_OFFLOAD if chosen == TE_AUTO else chosen), need
    free = free_bytes(device)
    if free is None:
        return (plans.TE_OFFLOAD if chosen == TE_AUTO else chosen), need
    available = (free + int(text_encoder.patcher.loaded_size())
                 + _unloadable_bytes(device, keep=(text_encoder,)))
    planned = plans.text_encoder_placement(size, tokens, available)
    room = (f"{memory.gib(size.gpu_bytes(planned, tokens))} of {memory.gib(available)} on {device} for "
            f"{tokens} tokens")
    if chosen == TE_AUTO:
        _say_once((id(text_encoder), chosen, planned),
                  f"KV-Graph: text encoder placement auto runs '{planned}' ({room}).")
        return planned, need
    smaller = plans.TE_PLACEMENTS.index(planned) > plans.TE_PLACEMENTS.index(chosen)
    if planned in (TE_STREAMED, plans.TE_CPU) and smaller:
        _say_once((id(text_encoder), chosen, planned),
                  f"KV-Graph: the text encoder runs '{chosen}' as set; the memory plan would run it '{planned}' "
                  f"({room}).")
    return chosen, need


def _say_once(key, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.info(message)
