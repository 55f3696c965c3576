"""Reference images and the VAE: resizing as the pipeline does, encoding to and decoding from normalized latents.

The Qwen-Image-2.1 VAE reads and writes RGBA (4 channels); the vision encoder sees the RGB image composited over
white. Latents are handled in the normalized space the transformer works in: `(z - latents_mean) / latents_std`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.image_processor import VaeImageProcessor

from ..memory import available_bytes
from ..vae_decode import decode_frames, should_tile
from ..validation import REFERENCE_MULTIPLE, VAE_SCALE, check_reference_size
from .vae_lock import vae_lock


def image_processor() -> VaeImageProcessor:
    return VaeImageProcessor(vae_scale_factor=VAE_SCALE, vae_latent_channels=64)


@dataclass
class PreparedReference:
    vision_image: object  # PIL image at the size the vision encoder sees
    vae_pixels: torch.Tensor  # [1, C, 1, H, W] in [-1, 1]
    width: int
    height: int


def reference_size(image, resolution: int = 1024, name: str = "image") -> tuple[int, int]:
    """(width, height) the pipeline gives a reference: area `resolution**2`, its aspect ratio, multiples of 32.

    An image too thin for that (a 1x6000 strip would get a side of 0 px) is refused, naming `name`.
    """
    # Imported here: the pipeline module takes seconds to import, and the pack imports this module at start-up.
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    original = tuple(image.size)
    if min(original) < 1:
        check_reference_size(name, original, (0, 0))
    width, height, _ = calculate_dimensions(resolution * resolution, original[0] / original[1])
    check_reference_size(name, original, (int(width), int(height)))
    return int(width), int(height)


def prepare_references(images, resolution: int = 1024) -> list[PreparedReference]:
    """Resize each reference once for both the vision encoder and the VAE, as `QwenImage21Pipeline` does.

    Errors name the images `image1`, `image2`... in the order given, as the ComfyUI encode node's inputs are named.
    """
    from PIL import Image

    processor = image_processor()
    prepared = []
    for index, img in enumerate(images):
        if not isinstance(img, Image.Image):
            img = Image.fromarray(img)
        if img.mode != "RGBA":
            img = img.convert("RGBA")
        width, height = reference_size(img, resolution, name=f"image{index + 1}")
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
def vae_encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, H, W] in [-1, 1] -> raw latents [B, z, H/16, W/16] (the distribution's mode, not normalized).

    Every runtime encode goes through here or `vae_decode`, under the VAE's lock (see `vae_lock`)."""
    param = next(vae.parameters())
    with vae_lock(vae):
        return vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()[:, :, 0]


@torch.no_grad()
def vae_decode(vae, raw: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """Raw latents [B, z, h, w] -> the VAE's output [B, C, 16h, 16w] in [-1, 1], under the VAE's lock; single
    frames without the temporal cache, or tiled (vae_decode.py)."""
    param = next(vae.parameters())
    with vae_lock(vae):
        return decode_frames(vae, raw.to(param.device, param.dtype).unsqueeze(2), tiled)[:, :, 0]


def _keep(image: torch.Tensor) -> torch.Tensor:
    return image


def encode_each(vae, pixels: torch.Tensor, finish=_keep) -> torch.Tensor:
    """`vae_encode` one image at a time, which bounds the encoder's activations to one image's; `finish` is applied
    to each image's raw latents as soon as they are made (e.g. moving them off the GPU)."""
    return torch.cat([finish(vae_encode(vae, pixels[i:i + 1])) for i in range(pixels.shape[0])])


def decode_each(vae, raw: torch.Tensor, tiled: bool = False, finish=_keep, before=None, check=None) -> torch.Tensor:
    """`vae_decode` one image at a time (the memory budgets size the decode of one image: memory/); `finish` is
    applied to each decoded image as soon as it is made (e.g. moving it off the GPU, converting it), and its result
    is written into the batch's output, allocated once (no list of images concatenated at the end). `before(i, n)`
    runs before image `i` of `n` (an interrupt check, a progress bar), `check(image, i, n)` on each image the VAE
    made, before `finish`."""
    out = None
    for i in range(raw.shape[0]):
        if before is not None:
            before(i, raw.shape[0])
        image = vae_decode(vae, raw[i:i + 1], tiled)
        if check is not None:
            check(image, i, raw.shape[0])
        image = finish(image)
        if out is None:
            out = image.new_empty((raw.shape[0], *image.shape[1:]))
        out[i:i + 1] = image
        del image
    return out


def encode_pixels(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, H, W] in [-1, 1] -> normalized latents [B, z, H/16, W/16] (the distribution's mode)."""
    latents = vae_encode(vae, pixels)
    mean, std = _stats(vae, latents)
    return (latents - mean) / std


def decode_latents(vae, latents: torch.Tensor, engines=()) -> torch.Tensor:
    """Normalized latents [B, z, h, w] -> images [B, C, 16h, 16w] in [-1, 1], one image at a time (tiled only when
    a whole decode does not fit in the memory the device has for it, the graph pools of `engines` left out: see
    vae_decode.py)."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, std = _stats(vae, latents)
    raw = latents * std + mean
    tiled = should_tile(vae, raw.shape[-2] * VAE_SCALE, raw.shape[-1] * VAE_SCALE, available_bytes(param.device, engines))
    return decode_each(vae, raw, tiled)
