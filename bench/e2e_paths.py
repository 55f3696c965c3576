"""One prompt, prompt to PNG, through ours (`QwenImageGenerator`, the CLI's and the nodes' pieces) or diffusers'
`QwenImage21Pipeline`, with the time and peak memory of each phase.

Phases: `encode` (Qwen3-VL over the prompt, and the reference image for an edit), `ref_vae_encode` (the reference
through the VAE encoder; the pipeline's latent preparation), `prefill`, `steps`, `vae_decode`, `postprocess` (to PIL)
and `png_encode` (ComfyUI's SaveImage settings: PNG, compression level 4; ours encodes on several CPU threads with
`graph_runtime.png_writer`, as the command line writes its files, the pipeline's image is saved by PIL on one thread,
as a diffusers user has it). Our prefill is the prefix rows' pass and all `steps` are decode steps; the pipeline's
prefill is its first step (an extract forward that also predicts step 1), so its `steps` are one fewer. `total` is the
wall time from the call to the PNG bytes; `other` what no phase covers (host work between them).
"""

from __future__ import annotations

import io
import sys
import time

import torch

from graph_runtime.png_writer import COMFYUI_COMPRESS_LEVEL, encode_png

from .phases import Phases


def pil_png_bytes(image) -> int:
    """The PNG's size, encoded by PIL on one thread at ComfyUI's SaveImage level."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=COMFYUI_COMPRESS_LEVEL)
    return buffer.tell()


def ours_png_bytes(image) -> int:
    """The PNG's size, encoded on several threads at the same level."""
    return len(encode_png(image, COMFYUI_COMPRESS_LEVEL))


def _record(phases: Phases, start: float, end: float, **extra) -> dict:
    total = (end - start) * 1e3
    record = {"total_ms": total, **{f"{k}_ms": v for k, v in phases.ms.items()}}
    record["other_ms"] = total - sum(phases.ms.values())
    record["peak_gb"] = phases.overall_peak_gb
    record["peak_gb_by_phase"] = dict(phases.peak_gb)
    record.update(extra)
    return record


def run_ours(generator, scenario, prompt: str, image=None, seed: int = 0, device="cuda", keep=None) -> dict:
    """`generator.generate` with its pieces timed; `sample` is split into prefill and steps by the sampler's own
    (synced) timings. `keep`: a list the output image is appended to."""
    module = sys.modules[type(generator).__module__]
    phases = Phases(device)
    targets = [(generator.encoder, "encode", "encode"), (module, "prepare_references", "ref_prepare"),
               (module, "encode_pixels", "ref_vae_encode"), (module, "sample", "sample"),
               (module, "decode_latents", "vae_decode"), (module, "to_pil", "postprocess")]
    images = [image] if image is not None else []
    events: dict = {}
    with phases.wrap(*targets):
        start = phases.start()
        result = generator.generate(prompt, images=images, width=None if images else scenario.size,
                                    height=None if images else scenario.size, steps=scenario.steps, seed=seed,
                                    sigma_preset=scenario.sigma_preset, reference_resolution=scenario.size,
                                    # the pipeline's own output: an RGBA image (the nodes and CLI composite it over
                                    # white), so both paths encode the same PNG
                                    keep_alpha=True, on_event=lambda name, data: events.setdefault(name, data))
        with phases.phase("png_encode"):
            size = ours_png_bytes(result.images[0])
        end = time.perf_counter()
    if keep is not None:
        keep.append(result.images[0])
    timings = result.timings
    phases.ms["prefill"] = timings["prefill_ms"]
    phases.ms["steps"] = timings["decode_ms_total"]
    sample_ms = phases.ms.pop("sample")
    phases.ms["sample_overhead"] = sample_ms - timings["prefill_ms"] - timings["decode_ms_total"]
    phases.peak_gb["sampling"] = phases.peak_gb.pop("sample", None)
    return _record(phases, start, end, png_bytes=size, steps_run=timings["steps"],
                   ms_per_step=timings["decode_ms_per_step"], stats=result.stats,
                   prefix_tokens=events.get("prefill", {}).get("prefix_tokens"),
                   image_size=list(result.images[0].size))


def run_diffusers(pipe, scenario, prompt: str, image=None, seed: int = 0, device="cuda", keep=None) -> dict:
    """The pipeline's own call with its pieces timed; the loop's step ends are synced in its step callback. The loop
    runs between the latent preparation and the VAE decode, outside any wrapped phase, so its peak memory is the
    peak between phases."""
    phases = Phases(device)
    step_ends: list[float] = []

    def on_step_end(_pipe, i, t, callback_kwargs):
        step_ends.append(phases.mark(f"step {i}"))
        return callback_kwargs

    targets = [(pipe, "encode_prompt", "encode"), (pipe, "prepare_latents", "ref_vae_encode"),
               (pipe.vae, "decode", "vae_decode"), (pipe.image_processor, "postprocess", "postprocess")]
    with phases.wrap(*targets):
        start = phases.start()
        generator = torch.Generator("cpu").manual_seed(seed)
        out = pipe(prompt=prompt, image=image, height=None if image is not None else scenario.size,
                   width=None if image is not None else scenario.size, num_inference_steps=scenario.steps,
                   sigmas=_pipeline_sigmas(scenario), generator=generator, output_type="pil",
                   output_resolution=scenario.size, callback_on_step_end=on_step_end)
        with phases.phase("png_encode"):
            size = pil_png_bytes(out.images[0])
        end = time.perf_counter()
    if keep is not None:
        keep.append(out.images[0])
    loop_start = phases.marks["end ref_vae_encode"]
    phases.ms["prefill"] = (step_ends[0] - loop_start) * 1e3
    phases.ms["steps"] = (step_ends[-1] - step_ends[0]) * 1e3
    phases.peak_gb["sampling"] = phases.peak_gb.pop("between phases", None)
    decode_steps = len(step_ends) - 1
    return _record(phases, start, end, png_bytes=size, steps_run=len(step_ends),
                   ms_per_step=phases.ms["steps"] / decode_steps if decode_steps else None,
                   image_size=list(out.images[0].size))


def _pipeline_sigmas(scenario):
    if scenario.sigma_preset == "turbo":
        from graph_runtime.sampling.schedule import TURBO_SIGMAS

        return list(TURBO_SIGMAS)
    return None
