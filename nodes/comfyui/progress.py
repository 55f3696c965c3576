"""Per-step progress, interruption and live previews for the sampler node."""

from __future__ import annotations

import logging

import comfy.model_management
import comfy.utils

from ...graph_runtime.comfy_interop.previews import PreviewProjection, gray_projection, preview_image
from ...graph_runtime import in_flight
from . import model_cache

logger = logging.getLogger("kvgraph")


def previews_enabled() -> bool:
    """ComfyUI's live-preview setting (the --preview-method flag, or the frontend's per-prompt override)."""
    try:
        from comfy.cli_args import LatentPreviewMethod, args
    except ImportError:
        return False
    return args.preview_method != LatentPreviewMethod.NoPreviews


def preview_max_size() -> int:
    try:
        from comfy.cli_args import args

        return int(args.preview_size)
    except (ImportError, AttributeError, TypeError, ValueError):
        return 512


def preview_projection() -> PreviewProjection:
    """ComfyUI's own Qwen-Image-2.1 latent->RGB factors when this ComfyUI has them, else a projection fitted to a
    VAE loaded by this pack, else gray."""
    try:
        import comfy.latent_formats

        fmt = comfy.latent_formats.QwenImage21()
        if fmt.latent_rgb_factors is not None:
            import torch

            bias = fmt.latent_rgb_factors_bias or [0.0, 0.0, 0.0]
            return PreviewProjection(torch.tensor(fmt.latent_rgb_factors, dtype=torch.float32),
                                     torch.tensor(bias, dtype=torch.float32))
    except (ImportError, AttributeError):
        pass
    for handle in model_cache.handles():
        if handle.kind == "vae":
            try:
                return handle.preview_projection()
            except Exception as exc:  # noqa: BLE001 - a preview is never worth failing a prompt over
                logger.debug("KV-Graph: preview projection unavailable: %s", exc)
    return gray_projection()


class SamplerProgress:
    """ComfyUI's progress bar (every update is also an interrupt check) plus previews, fed by the sampler's
    `on_step`; `should_stop` lets the sampler stop cleanly between steps."""

    def __init__(self, total: int, run_record: dict | None = None):
        self.bar = comfy.utils.ProgressBar(total)
        self.record = run_record
        self.projection = preview_projection() if previews_enabled() else None

    def on_step(self, step: int, total: int, latents) -> None:
        if self.record is not None:
            in_flight.update(self.record, step, total)
        preview = None
        if self.projection is not None:
            try:
                preview = ("JPEG", preview_image(latents, self.projection), preview_max_size())
            except Exception as exc:  # noqa: BLE001
                logger.debug("KV-Graph: preview failed: %s", exc)
        self.bar.update_absolute(step, total, preview)

    @staticmethod
    def should_stop() -> bool:
        return comfy.model_management.processing_interrupted()
