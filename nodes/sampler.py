"""KVGraphSampler: the prefix-K/V prefill + CUDA-graph decode sampler for Qwen-Image-2.1.

Reads CONDITIONING and LATENT from this pack's encode node or from core ComfyUI's TextEncodeQwenImage21, and returns
raw VAE latents, so it drops into core workflows in place of KSampler.
"""

from __future__ import annotations

import logging

import comfy.model_management as mm
from comfy_api.latest import io

from ..graph_runtime import in_flight
from ..graph_runtime.comfy_interop.conditioning import conditioning_to_prompt
from ..graph_runtime.comfy_interop.latents import (
    latent_noise_mask, latent_samples, latent_stats, normalized_to_raw, raw_to_normalized,
)
from ..graph_runtime.decode import DECODE_MODES
from ..graph_runtime.errors import InputError
from ..graph_runtime.loading.variant import AUTO, TURBO, sigma_preset_for
from ..graph_runtime.parallel import sample_on_devices
from ..graph_runtime.report import run_summary
from ..graph_runtime.sampling.sampler import Cancelled, SamplingRequest, check_schedule
from ..graph_runtime.sampling.schedule import SIGMA_PRESETS, TURBO_SIGMAS
from ..graph_runtime.validation import MAX_SEED, VAE_SCALE
from .comfyui import events, memory
from .comfyui.model_handles import TransformerHandle, expect_handle
from .comfyui.progress import SamplerProgress
from .comfyui.types import SAMPLING, Transformer

logger = logging.getLogger("kvgraph")

COMPILE_OPTIONS = ("off", "blocks")
NODE_SIGMA_PRESETS = (AUTO, *SIGMA_PRESETS)


def _check_choice(name: str, value, options) -> None:
    if value not in options:
        raise InputError(name, value, f"one of {', '.join(options)}")


class KVGraphSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphSampler",
            display_name="KV-Graph Sampler (Qwen-Image-2.1)",
            category=SAMPLING,
            description=(
                "Samples Qwen-Image-2.1 with flow-matching Euler. The text and reference-image tokens run once and "
                "their K/V are kept; every step then recomputes only the image tokens and replays a captured CUDA "
                "graph. Graphs stay cached across prompts for the loaded model. Accepts conditioning "
                "from the KV-Graph encode node or core's Text Encode Qwen Image 2.1."
            ),
            inputs=[
                Transformer.Input("model", tooltip="From a KV-Graph transformer or diffusers loader, or a Load LoRA "
                                                   "node (its LoRAs are merged at the start of the run)."),
                io.Conditioning.Input("positive", tooltip="The prompt's conditioning (KV-Graph or core Qwen-Image-2.1 "
                                                          "encode node)."),
                io.Conditioning.Input("negative", optional=True,
                                      tooltip="Negative conditioning; used only when cfg is above 1 (true CFG, which "
                                              "runs the model twice per step)."),
                io.Latent.Input("latent", tooltip="Sets the output size and batch; with denoise below 1 it is also "
                                                  "the image to start from. A noise mask on it (Set Latent Noise "
                                                  "Mask) inpaints as KSampler does: where the mask is 0 the latent "
                                                  "is kept."),
                io.Int.Input("seed", default=0, min=0, max=MAX_SEED, control_after_generate=True,
                             tooltip="Noise seed; the same seed gives the same image as the diffusers pipeline. "
                                     "Only its low 32 bits reach the noise (torch's CPU generator, as in diffusers "
                                     "and core ComfyUI's samplers): seeds that differ by a multiple of 2^32 give "
                                     "the same image."),
                io.Int.Input("steps", default=40, min=1, max=1000,
                             tooltip="Denoising steps for the dynamic schedule (40 is the model's default). The "
                                     "turbo preset (auto with a Turbo checkpoint) always runs its fixed 8 steps."),
                io.Float.Input("cfg", default=1.0, min=1.0, max=20.0, step=0.1,
                               tooltip="Guidance scale. 1 disables CFG (the model's default). Above 1 with a "
                                       "negative connected, runs true CFG at twice the cost."),
                io.Combo.Input("sigma_preset", options=list(NODE_SIGMA_PRESETS), default=AUTO,
                               tooltip="auto: turbo for the Turbo checkpoint (a file with 'turbo' in its name), "
                                       "dynamic otherwise. dynamic: the model's resolution-dependent shifted "
                                       "schedule over 'steps'. turbo: the Turbo model's fixed "
                                       f"{len(TURBO_SIGMAS)}-step grid, used as ComfyUI's Turbo template does "
                                       "(no shift; use cfg 1)."),
                io.Float.Input("denoise", default=1.0, min=0.01, max=1.0, step=0.01,
                               tooltip="1 samples from pure noise. Below 1, starts from the input latent and runs the "
                                       "last part of a longer schedule (image-to-image)."),
                io.Combo.Input("decode_mode", options=list(DECODE_MODES), default="auto",
                               tooltip="auto: replay CUDA graphs where possible, else decode eagerly (always "
                                       "correct). graph: same, but warns when a step cannot replay. eager: never "
                                       "capture (for debugging)."),
                io.Combo.Input("compile", options=list(COMPILE_OPTIONS), default="off",
                               tooltip="off (default): the graphs record our fused kernels and PyTorch's. blocks: "
                                       "also torch.compile the transformer blocks on CUDA: the same step time, "
                                       "and a compile on the first prompt after loading (docs/performance.md)."),
            ],
            outputs=[io.Latent.Output(display_name="latent", tooltip="Raw VAE latents, for a VAE decode node.")],
        )

    @classmethod
    def execute(cls, model, positive, latent, seed, steps, cfg, sigma_preset, denoise, decode_mode, compile,
                negative=None) -> io.NodeOutput:
        request, stats = build_request(model, positive, negative, latent, seed, steps, cfg, sigma_preset, denoise,
                                       decode_mode, compile)
        # Refused here, before anything is loaded or allocated, when the request cannot fit (comfyui/memory.py);
        # ComfyUI is then asked to make room for all of it beyond the transformer's own weights.
        budget = memory.check_request(model, request, model.patcher.load_device)
        # The plan's decisions reach the runtime through the request (its prefix placement) and the load (its
        # resident blocks: the other blocks stream from pinned host memory).
        request.memory_plan = budget.plan
        with model.loaded.following(budget.plan):
            model.ensure_loaded(max(0, budget.total - budget.part("transformer weights")))
        loaded = model.loaded
        loaded.use_attention(model.attention)  # the loader's choice; another than the last run's rebuilds the step
        prompt_id, node_id = events.executing_ids()
        total = len(TURBO_SIGMAS) if request.sigma_preset == TURBO else int(steps)

        # The handle's LoRA set is merged (or the originals restored) before the run and held until it ends.
        with loaded.loras_in_use(model.loras), in_flight.sampling(loaded, prompt_id, node_id, total) as record:
            progress = SamplerProgress(total, record)
            try:
                result = sample_on_devices(loaded, request, model.gpus, on_step=progress.on_step,
                                           should_stop=progress.should_stop, on_event=events.sender(prompt_id, node_id))
            except Cancelled:
                # The sampler stopped between steps (its caches are released): end the node the way ComfyUI
                # expects an interrupted node to end.
                mm.throw_exception_if_processing_interrupted()
                raise
        preset = request.sigma_preset + (f" ({AUTO})" if sigma_preset == AUTO else "")
        logger.info(run_summary(request.latent_width * VAE_SCALE, request.latent_height * VAE_SCALE,
                                request.batch_size, result, preset, cfg))
        out = normalized_to_raw(result.latents.float(), stats).to(mm.intermediate_device())
        return io.NodeOutput({"samples": out})


def build_request(model, positive, negative, latent, seed, steps, cfg, sigma_preset, denoise, decode_mode,
                  compile) -> tuple[SamplingRequest, object]:
    """Validate the node's inputs and turn ComfyUI's CONDITIONING / LATENT into the runtime's request (which checks
    the sampling settings themselves: seed, steps, cfg, denoise).

    Returns the request and the latent statistics used to normalize.
    """
    expect_handle("model", model, TransformerHandle)
    _check_choice("sigma_preset", sigma_preset, NODE_SIGMA_PRESETS)
    preset = sigma_preset_for(sigma_preset, model.info.get("variant"))
    _check_choice("decode_mode", decode_mode, DECODE_MODES)
    _check_choice("compile", compile, COMPILE_OPTIONS)
    channels = model.module.config.in_channels
    samples = latent_samples(latent, "latent", channels)
    batch, _, height, width = samples.shape
    mask = latent.get("noise_mask")
    if mask is not None:  # inpainting, as KSampler does it: the input latent is kept where the mask is 0
        mask = latent_noise_mask(mask, height, width, "latent noise_mask")
        if mask.shape[0] not in (1, batch):
            raise InputError("latent noise_mask", f"{mask.shape[0]} masks", f"1 mask, or one per latent ({batch})")
    stats = latent_stats()

    text_dim = model.module.config.context_in_dim
    pos = conditioning_to_prompt(positive, "positive", channels, text_dim)
    neg = None
    if cfg > 1.0 and negative is None:
        logger.warning("KV-Graph: cfg %.2f has no effect without a negative conditioning; sampling without CFG.", cfg)
    if cfg > 1.0 and negative is not None:
        neg = conditioning_to_prompt(negative, "negative", channels, text_dim)
    for name, parsed in (("positive", pos), ("negative", neg)):
        if parsed is not None and parsed.embeds.embeds.shape[0] not in (1, batch):
            raise InputError(name, f"{parsed.embeds.embeds.shape[0]} prompts",
                             f"1 prompt, or one per latent in the batch ({batch})")

    request = SamplingRequest(
        positive=pos.embeds, negative=neg.embeds if neg is not None else None, cfg=float(cfg),
        reference_latents=[raw_to_normalized(r, stats) for r in pos.reference_latents],
        # Each branch prefills with the references its own conditioning carries, as core's samplers do.
        negative_reference_latents=(None if neg is None
                                    else [raw_to_normalized(r, stats) for r in neg.reference_latents]),
        latent_height=height, latent_width=width, batch_size=batch, seed=int(seed), steps=int(steps),
        sigma_preset=preset, denoise=float(denoise),
        # In float32 whatever the LATENT's dtype (the pack's bf16 VAE Encode gives bf16): the kept area of an inpaint
        # comes back through normalized_to_raw in float32, so it is the input latent to float32 round-off.
        init_latents=raw_to_normalized(samples.float(), stats) if denoise < 1.0 or mask is not None else None,
        noise_mask=mask,
        decode_mode=decode_mode, compile=compile == "blocks", scheduler_config=model.scheduler_config,
        control=model.control,
        step_cache=getattr(model, "step_cache", None),
        prefix_placement=model.prefix_placement,
    )
    if model.control is not None:
        model.control.tokens(height, width)  # the VAE encodes the control images now, before any sampling
    check_schedule(request)  # before the memory budget: a size the schedule cannot take is refused as such
    return request, stats
