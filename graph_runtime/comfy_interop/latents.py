"""ComfyUI LATENTs: `{"samples": z}` with `z` `[B, 64, H/16, W/16]` in *raw* VAE space.

The model works on normalized latents `(z - latents_mean) / latents_std`; core ComfyUI applies that in its latent
format, the runtime takes normalized latents, so the conversion happens here, with the Qwen-Image-2.1 VAE statistics.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..validation import VAE_SCALE, describe_value

LATENT_CHANNELS = 64


@dataclass(frozen=True)
class LatentStats:
    """Per-channel statistics of the VAE latent space, `[1, C, 1, 1]` float32."""

    mean: torch.Tensor
    std: torch.Tensor


def latent_stats(vae=None) -> LatentStats:
    """The VAE's `latents_mean` / `latents_std`, or Qwen-Image-2.1's published ones when no VAE is given.

    The published values are read from diffusers' `AutoencoderKLQwenImage21` defaults (the same numbers core
    ComfyUI's Qwen-Image-2.1 latent format uses), so LATENTs made by core and by this pack are interchangeable.
    """
    if vae is not None:
        mean, std = vae.config.latents_mean, vae.config.latents_std
    else:
        from diffusers import AutoencoderKLQwenImage21

        params = inspect.signature(AutoencoderKLQwenImage21.__init__).parameters
        mean, std = params["latents_mean"].default, params["latents_std"].default
    channels = len(mean)
    return LatentStats(mean=torch.tensor(mean, dtype=torch.float32).view(1, channels, 1, 1),
                       std=torch.tensor(std, dtype=torch.float32).view(1, channels, 1, 1))


def raw_to_normalized(raw: torch.Tensor, stats: LatentStats) -> torch.Tensor:
    """Raw VAE latents -> the model's normalized space, computed as `encode_pixels` does (same ops, same dtype)."""
    mean = stats.mean.to(raw.device, raw.dtype)
    std = stats.std.to(raw.device, raw.dtype)
    return (raw - mean) / std


def normalized_to_raw(normalized: torch.Tensor, stats: LatentStats) -> torch.Tensor:
    mean = stats.mean.to(normalized.device, normalized.dtype)
    std = stats.std.to(normalized.device, normalized.dtype)
    return normalized * std + mean


def latent_samples(latent, name: str = "latent", channels: int = LATENT_CHANNELS) -> torch.Tensor:
    """The `[B, C, h, w]` samples of a ComfyUI LATENT dict (a video-style `[B, C, 1, h, w]` is accepted)."""
    expected = (f"a LATENT dict whose 'samples' is [batch, {channels}, height/16, width/16] (Qwen-Image-2.1), each "
                "at least 1")
    if not isinstance(latent, dict) or not isinstance(latent.get("samples"), torch.Tensor):
        raise InputError(name, describe_value(latent), expected)
    samples = latent["samples"]
    if samples.dim() == 5 and samples.shape[2] == 1:
        samples = samples[:, :, 0]
    # A zero-sized side (a [1, 64, 0, 4] latent) has no image to decode or sample.
    if samples.dim() != 4 or samples.shape[1] != channels or min(samples.shape[0], *samples.shape[2:]) < 1:
        raise InputError(name, f"samples of shape {list(samples.shape)}", expected)
    return samples


def empty_latent(width: int, height: int, batch_size: int = 1, channels: int = LATENT_CHANNELS) -> dict:
    """An all-zero LATENT of the given pixel size, as core's Qwen-Image-2.1 encode node makes it."""
    return {"samples": torch.zeros(batch_size, channels, height // VAE_SCALE, width // VAE_SCALE)}


def latent_noise_mask(mask, height: int, width: int, name: str = "noise_mask") -> torch.Tensor:
    """A LATENT's `noise_mask` (e.g. from SetLatentNoiseMask: `[N, 1, H, W]` or `[N, H, W]`, any resolution, 1 where
    to sample) as `[N, 1, height, width]` float32 at the latent's size, resized as core's `reshape_mask` does it
    (bilinear)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
        raise InputError(name, type(mask).__name__, "a mask tensor [batch, height, width] with values in [0, 1]")
    mask = mask.float().reshape(-1, 1, mask.shape[-2], mask.shape[-1])
    return torch.nn.functional.interpolate(mask, size=(height, width), mode="bilinear")
