"""ComfyUI IMAGEs (`[B, H, W, 3|4]` in [0, 1]) <-> the VAE's RGBA pixels (`[B, 4, 1, H, W]` in [-1, 1]), cropping to
the VAE's grid, and PIL images.
"""

from __future__ import annotations

import torch

from ..encoding.images import image_processor
from ..errors import InputError
from ..validation import describe_value
from .latents import VAE_SCALE


IMAGE_EXPECTED = "an IMAGE [batch, height, width, 3 or 4] (from Load Image, a VAE decode or another image node)"


def check_image(image, name: str = "image") -> torch.Tensor:
    """`image` when it is a ComfyUI IMAGE with at least one image; else an InputError naming the input and what
    arrived (a STRING through a Switch node, a LATENT dict, a mask)."""
    if not isinstance(image, torch.Tensor):
        raise InputError(name, describe_value(image), IMAGE_EXPECTED)
    if image.dim() != 4 or image.shape[-1] not in (3, 4) or min(image.shape[:3]) < 1:
        raise InputError(name, f"a tensor of shape {list(image.shape)}", IMAGE_EXPECTED)
    return image


def comfy_image_to_vae_pixels(image: torch.Tensor, name: str = "image") -> torch.Tensor:
    """ComfyUI IMAGE `[B, H, W, 3|4]` in [0, 1] -> the VAE's RGBA input `[B, 4, 1, H, W]` in [-1, 1].

    An RGB image gets an opaque alpha channel: the Qwen-Image-2.1 VAE reads and writes RGBA.
    """
    check_image(image, name)
    pixels = image.float().movedim(-1, 1)
    if pixels.shape[1] == 3:
        pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
    return (pixels * 2.0 - 1.0).clamp(-1.0, 1.0).unsqueeze(2)


def vae_pixels_to_comfy_image(pixels: torch.Tensor) -> torch.Tensor:
    """The VAE's output `[B, 3|4, H, W]` in [-1, 1] -> ComfyUI IMAGE `[B, H, W, 3]` in [0, 1].

    ComfyUI images are RGB; alpha is composited over white, which is also what the vision encoder sees.
    """
    images = ((pixels.float() + 1.0) / 2.0).clamp(0.0, 1.0)
    rgb = images[:, :3]
    if images.shape[1] == 4:
        alpha = images[:, 3:4]
        rgb = rgb * alpha + (1.0 - alpha)
    return rgb.movedim(1, -1).contiguous()


def vae_pixels_to_comfy_mask(pixels: torch.Tensor) -> torch.Tensor:
    """The VAE's output `[B, 3|4, H, W]` in [-1, 1] -> its alpha channel as a ComfyUI MASK `[B, H, W]` in [0, 1], in
    core's Load Image convention: 1 - alpha (1 where the image is transparent), what Join Image with Alpha takes back.
    An RGB output is opaque: all 0."""
    if pixels.shape[1] < 4:
        return pixels.new_zeros((pixels.shape[0], *pixels.shape[2:]), dtype=torch.float32)
    alpha = ((pixels[:, 3].float() + 1.0) / 2.0).clamp(0.0, 1.0)
    return 1.0 - alpha


def crop_to_multiple(image: torch.Tensor, multiple: int = VAE_SCALE) -> torch.Tensor:
    """Center-crop an IMAGE `[B, H, W, C]` to sides that are multiples of `multiple` (the VAE's 16x grid)."""
    check_image(image, "image")
    height, width = image.shape[1], image.shape[2]
    new_h, new_w = height // multiple * multiple, width // multiple * multiple
    if new_h < multiple or new_w < multiple:
        raise InputError("image", f"{width}x{height} px", f"at least {multiple}x{multiple} px")
    top, left = (height - new_h) // 2, (width - new_w) // 2
    return image[:, top:top + new_h, left:left + new_w]


def comfy_image_to_pil(image: torch.Tensor, name: str = "image"):
    """The first image of an IMAGE batch as a PIL image (RGBA when it has an alpha channel)."""
    from PIL import Image

    check_image(image, name)
    array = (image[0].float().clamp(0, 1) * 255.0).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(array, mode="RGBA" if array.shape[-1] == 4 else "RGB")


def to_pil(images: torch.Tensor, keep_alpha: bool = False) -> list:
    """The VAE's [-1, 1] RGBA (or RGB) output -> PIL images.

    By default RGB with the alpha composited over white, as the ComfyUI nodes show them (the same conversion);
    `keep_alpha` keeps the VAE's alpha channel (mostly transparent for a Qwen-Image-2.1 text-to-image).
    """
    if keep_alpha:
        return image_processor().postprocess(images.float(), output_type="pil")
    rgb = vae_pixels_to_comfy_image(images)
    return [comfy_image_to_pil(rgb[i:i + 1]) for i in range(rgb.shape[0])]
