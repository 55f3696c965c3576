"""Reference images and the VAE: resizing as the pipeline does, encoding to and decoding from normalized latents.

The Qwen-Image-2.1 VAE reads and writes RGBA (4 channels); the vision encoder sees the RGB image composited over
white. Latents are handled in the normalized space the transformer works in: `(z - latents_mean) / latents_std`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

VAE_SCALE = 16
# Condition images are sized in 32 px steps: one vision-encoder slot is 2x2 latent tokens.
REFERENCE_MULTIPLE = 32


def image_processor() -> VaeImageProcessor:
    return VaeImageProcessor(vae_scale_factor=VAE_SCALE, vae_latent_channels=64)


@dataclass
class PreparedReference:
    vision_image: object  # PIL image at the size the vision encoder sees
    vae_pixels: torch.Tensor  # [1, C, 1, H, W] in [-1, 1]
    width: int
    height: int


def reference_size(image, resolution: int = 1024) -> tuple[int, int]:
    """(width, height) the pipeline gives a reference: area `resolution**2`, its aspect ratio, multiples of 32."""
    width, height, _ = calculate_dimensions(resolution * resolution, image.size[0] / image.size[1])
    return int(width), int(height)


def prepare_references(images, resolution: int = 1024) -> list[PreparedReference]:
    """Resize each reference once for both the vision encoder and the VAE, as `QwenImage21Pipeline` does."""
    from PIL import Image

    processor = image_processor()
    prepared = []
    for img in images:
        if not isinstance(img, Image.Image):
            img = Image.fromarray(img)
        if img.mode != "RGBA":
            img = img.convert("RGBA")
        width, height = reference_size(img, resolution)
        prepared.append(PreparedReference(
            vision_image=processor.resize(img, width=width, height=height),
            vae_pixels=processor.preprocess(img, width=width, height=height).unsqueeze(2),
            width=width,
            height=height,
        ))
    return prepared


def _stats(vae, like: torch.Tensor):
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1).to(like.device, like.dtype)
    return mean, std


@torch.no_grad()
def encode_pixels(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, H, W] in [-1, 1] -> normalized latents [B, z, H/16, W/16] (the distribution's mode)."""
    param = next(vae.parameters())
    latents = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()[:, :, 0]
    mean, std = _stats(vae, latents)
    return (latents - mean) / std


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents [B, z, h, w] -> images [B, C, 16h, 16w] in [-1, 1]."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, std = _stats(vae, latents)
    return vae.decode((latents * std + mean).unsqueeze(2), return_dict=False)[0][:, :, 0]


def to_pil(images: torch.Tensor) -> list:
    """[-1, 1] RGBA (or RGB) tensors -> PIL images."""
    return image_processor().postprocess(images.float(), output_type="pil")
