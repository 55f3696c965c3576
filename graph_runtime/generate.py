"""The main job end to end: prompt (+ reference images) -> encode -> sample -> VAE decode -> images.

Used by the CLI; the ComfyUI nodes call the same pieces one node at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import free_memory
from .comfy_interop.pixels import to_pil
from .encoding.images import decode_latents, encode_pixels, prepare_references, reference_size
from .encoding.placed import PlacedTextEncoder
from .encoding.prompt import PromptEncoder
from .memory import bytes_on, check_runtime_request
from .memory import plan as plans
from .memory.sizes import VaeDims
from .loaded import LoadedTransformer
from .parallel import sample_on_devices
from .sampling.sampler import SamplingRequest, check_schedule, sample
from .validation import check_reference_resolution, check_size
from .vae_decode import check_decoded

__all__ = ["DEFAULT_SIZE", "GenerationResult", "QwenImageGenerator", "check_size"]

DEFAULT_SIZE = 1024


@dataclass
class GenerationResult:
    images: list
    latents: torch.Tensor
    timings: dict
    stats: dict
    paths: list = field(default_factory=list)


class QwenImageGenerator:
    """Holds loaded models (anything with .transformer, .vae, .text_encoder, .processor, .scheduler_config).
    `gpus` > 1 decodes each image on that many devices (graph_runtime/parallel). `text_encoder_placement`: one of the
    loader nodes' `text_encoder_placement` choices (encoding/placed.py); `auto` runs the memory plan's."""

    def __init__(self, models, gpus: int = 1, loaded: LoadedTransformer | None = None,
                 text_encoder_placement: str = "auto"):
        self.models = models
        self.gpus = gpus
        self.encoder = PromptEncoder(models.text_encoder, models.processor)
        # The encode runs where the transformer is (the text encoder may wait on the host between encodes).
        self.placed = PlacedTextEncoder(models.text_encoder, next(models.transformer.parameters()).device,
                                        text_encoder_placement)
        # The transformer's owner (engine, graphs, LoRA state, ranks); one per loaded model: pass it when another
        # object already owns this transformer.
        self.loaded = loaded if loaded is not None else LoadedTransformer(models.transformer)

    @property
    def engine(self):
        return self.loaded.engine

    def _sampling_beside(self, request, references: int, tokens: int) -> tuple[int, int] | None:
        """For the text encoder's `auto`: what the request's sampling needs on the device (its memory plan, before
        the prompt is encoded: the token bound stands for the prompt) and what of that the transformer and the VAE
        already hold there; None where the device is the host, or another placement is set."""
        transformer = self.loaded.transformer
        device = next(transformer.parameters()).device
        if self.placed.placement != plans.TE_AUTO or device.type == "cpu":
            return None
        free = free_memory.device_free_bytes(device)
        if free is None:
            return None
        vae = self.models.vae
        shape = plans.request_shape(request.latent_width * 16, request.latent_height * 16, request.batch_size,
                                    request.cfg > 1.0, references, prompt_tokens=tokens)
        held = bytes_on(transformer, device) + bytes_on(vae, device)
        sizes = plans.ModelSizes.of(transformer, VaeDims.of(vae))
        return plans.plan_memory(sizes, shape, free + held).gpu_bytes, held

    def generate(self, prompt: str, negative_prompt: str | None = None, cfg: float = 1.0, images=(),
                 width: int | None = None, height: int | None = None, steps: int = 40, seed: int = 0,
                 sigma_preset: str = "dynamic", decode_mode: str = "auto", compile: bool = False,
                 batch_size: int = 1, reference_resolution: int = DEFAULT_SIZE, keep_alpha: bool = False,
                 on_step=None, on_event=None, prefix_placement: str = "auto") -> GenerationResult:
        """`width`/`height` None: the last reference's size, or 1024. The images are RGB over white (as the ComfyUI
        nodes show them) unless `keep_alpha`. Every argument is checked before any model runs."""
        timings = {}
        images = list(images or [])
        check_reference_resolution(reference_resolution)
        if images and (width is None or height is None):
            auto_w, auto_h = reference_size(images[-1], reference_resolution, name=f"image{len(images)}")
            width = auto_w if width is None else width
            height = auto_h if height is None else height
        width = check_size("width", DEFAULT_SIZE if width is None else width)
        height = check_size("height", DEFAULT_SIZE if height is None else height)
        # The request is built (and so its settings checked: seed, steps, batch, cfg) before any model runs; the
        # encoders fill in its prompt and references below.
        request = SamplingRequest(
            positive=None, cfg=cfg, latent_height=height // 16, latent_width=width // 16, batch_size=batch_size,
            seed=seed, steps=steps, sigma_preset=sigma_preset, decode_mode=decode_mode, compile=compile,
            scheduler_config=self.models.scheduler_config, prefix_placement=prefix_placement,
        )
        self.encoder.check_prompt(prompt, len(images))
        if negative_prompt is not None and request.cfg > 1.0:
            self.encoder.check_prompt(negative_prompt, len(images), "negative_prompt")

        start = time.perf_counter()
        refs = prepare_references(images, reference_resolution) if images else []
        vision_images = [r.vision_image for r in refs]
        texts = [prompt] + ([negative_prompt] if negative_prompt is not None and request.cfg > 1.0 else [])
        tokens = max(self.encoder.token_bound(t, vision_images) for t in texts)
        beside = self._sampling_beside(request, len(refs), tokens)
        with self.placed.encoding(tokens, beside) as device:
            positive = self.encoder.encode(prompt, vision_images, device=device)
            negative = None
            if len(texts) > 1:
                negative = self.encoder.encode(negative_prompt, vision_images, device=device, name="negative_prompt")
        timings["text_encoder_placement"] = self.placed.last
        reference_latents = [encode_pixels(self.models.vae, r.vae_pixels) for r in refs]
        timings["encode_ms"] = (time.perf_counter() - start) * 1e3

        request.positive, request.negative, request.reference_latents = positive, negative, reference_latents
        check_schedule(request)
        # Refused here, before anything is allocated, when the whole request (the decoded images included) cannot fit
        # on its device (the GPU, or the CPU's memory).
        budget = check_runtime_request(self.loaded, request, self.models.vae, self.models.text_encoder,
                                       image_bytes_per_pixel=4 if keep_alpha else 3, stream=self.gpus == 1,
                                       text_encoder_placement=self.placed.placement)
        if budget is not None:
            # The plan's resident blocks on the device, the others streamed (or all of them there again).
            request.memory_plan = budget.plan
            self.loaded.follow_plan(next(self.loaded.transformer.parameters()).device, budget.plan)
        start = time.perf_counter()
        if self.gpus == 1:
            result = sample(self.engine, request, on_step=on_step, on_event=on_event)
        else:
            result = sample_on_devices(self.loaded, request, self.gpus, on_step=on_step, on_event=on_event)
        timings["sample_ms"] = (time.perf_counter() - start) * 1e3
        timings.update(result.timings)

        start = time.perf_counter()
        # One image at a time, each made a PIL image at once: the batch is never held as float pixels (the budget
        # counts the PIL images and one image's decode).
        vae_name = (getattr(self.models, "sources", None) or {}).get("vae")
        count, pil = result.latents.shape[0], []
        for i in range(count):
            pixels = decode_latents(self.models.vae, result.latents[i:i + 1], self.loaded.engines())
            # The latents were finite after every step (the sampler checks), so a bad image comes from the VAE.
            check_decoded(pixels, vae_name, (i, count))
            pil += to_pil(pixels, keep_alpha=keep_alpha)
            del pixels
        timings["vae_decode_ms"] = (time.perf_counter() - start) * 1e3
        return GenerationResult(images=pil, latents=result.latents, timings=timings, stats=result.stats,
                                paths=result.paths)
