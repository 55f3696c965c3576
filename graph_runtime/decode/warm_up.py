"""Warming an engine up for the image sizes a workflow will use, before its first prompt.

A fresh process's first prompt sets up everything its decode path runs: our Triton kernels (compiled, or read from
Triton's on-disk cache), every GEMM's cuBLAS kernel, cuDNN's attention plan for its sequence lengths, the memory of
the graph entry's buffers. `warm_up` runs one prefix pass and one decode step per size, on a graph entry's static
buffers and under the capture's settings (so exactly the kernels a replay runs), with a random prompt of
`prompt_tokens` tokens, and drops them: the next prompt of those sizes then only pays its own captures. With
`capture=True` it goes through the engine's prefill and decode_step instead and keeps the captured graphs of that exact
layout (a text prompt of `prompt_tokens` tokens): a first prompt of that length replays at once. Those graphs are an
idle entry, evicted first when memory runs short.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .capture import CudaGraphBackend, DecodeGraphEntry, EntrySpec
from .kv_format import NATIVE
from .layout import TokenLayout
from .prefill import run_prefill


def _random_request(transformer, height: int, width: int, prompt_tokens: int, batch: int):
    config = transformer.config
    param = next(transformer.parameters())
    generator = torch.Generator("cpu").manual_seed(0)
    layout = TokenLayout.build(torch.zeros(1, prompt_tokens, dtype=torch.bool), [(1, height, width)], param.device)
    embeds = torch.randn(batch, prompt_tokens, config.context_in_dim, generator=generator)
    latents = torch.randn(batch, height * width, config.in_channels, generator=generator)
    timestep = torch.ones(batch)
    return layout, *(t.to(param.device, param.dtype) for t in (embeds, latents, timestep))


def warm_up(engine, sizes, prompt_tokens: int = 128, capture: bool = False, batch: int = 1) -> dict:
    """`sizes`: latent grids `(height, width)` (pixels / 16). Returns what was done and how long it took; with CUDA
    graphs and the model off CUDA nothing happens (nothing would replay)."""
    transformer = engine.transformer
    device = next(transformer.parameters()).device
    if device.type != "cuda" and isinstance(engine.graphs.backend, CudaGraphBackend):
        return {"skipped": f"the model is on {device.type}, not CUDA"}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    done = []
    with torch.inference_mode(False), torch.no_grad():
        for height, width in sizes:
            sync(device)
            start = time.perf_counter()
            layout, embeds, latents, timestep = _random_request(transformer, height, width, prompt_tokens, batch)
            if capture:
                _, prefix = engine.prefill(layout, latents, embeds, timestep, with_target=False)
                outcome = engine.decode_step(prefix, latents, timestep)
                prefix.release()
                path = outcome.path if outcome.reason is None else f"eager: {outcome.reason}"
            else:
                _run_on_static_buffers(engine, layout, latents, embeds, timestep)
                path = "uncaptured"
            sync(device)
            done.append({"latent": [height, width], "prompt_tokens": prompt_tokens, "path": path,
                         "seconds": round(time.perf_counter() - start, 3)})
    return {"sizes": done}


def _run_on_static_buffers(engine, layout, latents, embeds, timestep) -> None:
    """The prefix pass and one step body exactly as a graph entry runs them, on a throwaway entry's buffers (never
    registered with the engine's graphs: no statistics, nothing kept; the memory stays with the allocator for the real
    entry)."""
    settings = getattr(engine.graphs.backend, "capture_settings", contextlib.nullcontext)
    with settings():  # captures run both passes under these (no cuBLAS workspace): load the same GEMM kernels
        inputs = prefilled_static_inputs(engine.transformer, layout, latents, embeds, timestep, latents,
                                         engine.step.kv_format())
        engine.step(inputs)


def prefilled_static_inputs(transformer, layout, hidden_all, embeds, timestep, latents, kv_format=NATIVE):
    """A throwaway graph entry's static inputs with this branch's prefix pass written into them: `hidden_all` is
    what the prefill reads (condition images first), `latents` the target rows the step reads; `kv_format` the
    entry's (kv_format.py)."""
    entry = DecodeGraphEntry(None, EntrySpec.for_request(transformer, layout, latents.shape[0], kv_format=kv_format))
    _, prefix = run_prefill(transformer, layout, hidden_all, embeds, timestep, static_kv=entry.prefill_kv(),
                            with_target=False)
    entry.set_rope(prefix.cos, prefix.sin)
    entry.mark_current(prefix)
    entry.load_inputs(latents, timestep)
    prefix.release()  # the prefix's tensors are views of the entry's buffers, which the inputs keep
    return entry.inputs
