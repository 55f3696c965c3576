"""The main job end to end: prompt (+ reference images) -> encode -> sample -> VAE decode -> images.

Used by the CLI; the ComfyUI nodes call the same pieces one node at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .encoding.images import decode_latents, encode_pixels, prepare_references, reference_size, to_pil
from .encoding.prompt import PromptEncoder
from .errors import InputError
from .registry import engine_for
from .sampling.sampler import SamplingRequest, sample

DEFAULT_SIZE = 1024


def check_size(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 16 or value % 16:
        raise InputError(name, value, "a positive multiple of 16 pixels (the VAE compresses 16x)")
    return value


@dataclass
class GenerationResult:
    images: list
    latents: torch.Tensor
    timings: dict
    stats: dict
    paths: list = field(default_factory=list)


class QwenImageGenerator:
    """Holds loaded models (anything with .transformer, .vae, .text_encoder, .processor, .scheduler_config)."""

    def __init__(self, models):
        self.models = models
        self.encoder = PromptEncoder(models.text_encoder, models.processor)

    @property
    def engine(self):
        return engine_for(self.models.transformer)

    def generate(self, prompt: str, negative_prompt: str | None = None, cfg: float = 1.0, images=(),
                 width: int | None = None, height: int | None = None, steps: int = 40, seed: int = 0,
                 sigma_preset: str = "dynamic", decode_mode: str = "auto", compile: bool = False,
                 batch_size: int = 1, reference_resolution: int = DEFAULT_SIZE, on_step=None,
                 on_event=None) -> GenerationResult:
        timings = {}
        images = list(images or [])
        if images and (width is None or height is None):
            auto_w, auto_h = reference_size(images[-1], reference_resolution)
            width, height = width or auto_w, height or auto_h
        width = check_size("width", width or DEFAULT_SIZE)
        height = check_size("height", height or DEFAULT_SIZE)

        start = time.perf_counter()
        refs = prepare_references(images, reference_resolution) if images else []
        vision_images = [r.vision_image for r in refs]
        positive = self.encoder.encode(prompt, vision_images, device=self.encoder.device)
        negative = None
        if negative_prompt is not None and cfg > 1.0:
            negative = self.encoder.encode(negative_prompt, vision_images, device=self.encoder.device)
        reference_latents = [encode_pixels(self.models.vae, r.vae_pixels) for r in refs]
        timings["encode_ms"] = (time.perf_counter() - start) * 1e3

        request = SamplingRequest(
            positive=positive, negative=negative, cfg=cfg, reference_latents=reference_latents,
            latent_height=height // 16, latent_width=width // 16, batch_size=batch_size, seed=seed, steps=steps,
            sigma_preset=sigma_preset, decode_mode=decode_mode, compile=compile,
            scheduler_config=self.models.scheduler_config,
        )
        start = time.perf_counter()
        result = sample(self.engine, request, on_step=on_step, on_event=on_event)
        timings["sample_ms"] = (time.perf_counter() - start) * 1e3
        timings.update(result.timings)

        start = time.perf_counter()
        pixels = decode_latents(self.models.vae, result.latents)
        pil = to_pil(pixels)
        timings["vae_decode_ms"] = (time.perf_counter() - start) * 1e3
        return GenerationResult(images=pil, latents=result.latents, timings=timings, stats=result.stats,
                                paths=result.paths)
