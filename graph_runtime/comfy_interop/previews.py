"""Live previews: normalized latents projected to a small RGB image, as ComfyUI shows them while a sampler runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..encoding.images import vae_encode
from .latents import LATENT_CHANNELS, VAE_SCALE, latent_stats, raw_to_normalized


@dataclass(frozen=True)
class PreviewProjection:
    """A linear map from normalized latent channels to RGB in [-1, 1]: `rgb = latent @ factors + bias`."""

    factors: torch.Tensor  # [C, 3]
    bias: torch.Tensor  # [3]


def gray_projection(channels: int = LATENT_CHANNELS) -> PreviewProjection:
    """The fallback when nothing better is known: the channel mean, as gray."""
    return PreviewProjection(torch.full((channels, 3), 1.0 / math.sqrt(channels)), torch.zeros(3))


def _calibration_images(size: int, count: int = 8) -> torch.Tensor:
    """Smooth random colour fields `[count, 4, 1, size, size]` in [-1, 1] (opaque): enough colour variety for a
    least-squares fit, deterministic so the projection is the same every run."""
    generator = torch.Generator().manual_seed(1234)
    coarse = torch.rand(count, 3, 4, 4, generator=generator) * 2 - 1
    rgb = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=True).clamp(-1, 1)
    return torch.cat([rgb, torch.ones_like(rgb[:, :1])], dim=1).unsqueeze(2)


@torch.no_grad()
def fit_preview_projection(vae, size: int = 128) -> PreviewProjection:
    """Fit the latent -> RGB projection for this VAE by least squares on a few encoded colour fields.

    Cheap (one small encode) and specific to the weights actually loaded, so previews track the real model without
    shipping a table of numbers.
    """
    param = next(vae.parameters())
    pixels = _calibration_images(size).to(param.device, param.dtype)
    raw = vae_encode(vae, pixels).float()
    latents = raw_to_normalized(raw, latent_stats(vae))
    target = torch.nn.functional.avg_pool2d(pixels[:, :3, 0].float(), VAE_SCALE)
    x = latents.movedim(1, -1).reshape(-1, latents.shape[1]).cpu()
    y = target.movedim(1, -1).reshape(-1, 3).cpu()
    design = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    # A little ridge keeps the fit stable when there are fewer distinct colours than channels.
    reg = 1e-3 * torch.eye(design.shape[1])
    solution = torch.linalg.solve(design.T @ design + reg, design.T @ y)
    return PreviewProjection(factors=solution[:-1].contiguous(), bias=solution[-1].contiguous())


def preview_image(latents: torch.Tensor, projection: PreviewProjection):
    """The first sample of normalized latents `[B, C, h, w]` as a small RGB PIL image (one pixel per latent token)."""
    from PIL import Image

    x = latents[0].float().movedim(0, -1)
    rgb = x @ projection.factors.to(x.device) + projection.bias.to(x.device)
    array = ((rgb.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(array, mode="RGB")
