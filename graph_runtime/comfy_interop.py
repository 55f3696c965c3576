"""Pure conversions between ComfyUI's data conventions and the runtime's. No ComfyUI import here.

ComfyUI conventions this module speaks (as core ComfyUI's Qwen-Image-2.1 support uses them):

- LATENT: `{"samples": z}` with `z` `[B, 64, H/16, W/16]` in *raw* VAE space. The model works on normalized latents
  `(z - latents_mean) / latents_std`; core applies that in its latent format, the runtime takes normalized latents,
  so the conversion happens here, with the Qwen-Image-2.1 VAE statistics.
- CONDITIONING: `[[cond, extras]]`. `cond` is `[B, T, 4096]`: the text encoder's hidden states with the system turn
  dropped and the *vision tokens removed*. `extras` may hold `attention_mask` `[B, T]` (only when padded),
  `image_slots` (for each reference image, the index in `cond` where its latent tokens are spliced in) and
  `reference_latents` (raw VAE space, `[1, 64, h, w]` each, in image order). A reference without a slot goes after
  the last text token.

The runtime's `PromptEmbeds` instead keeps one encoder row per vision slot (each standing for 2x2 latent tokens)
and marks them in `image_mask`; the transformer never reads those rows' values (it splices the reference latents in),
so dropping them and reinserting zeros loses nothing.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .decode.layout import TOKENS_PER_SLOT
from .encoding.images import vae_decode, vae_encode
from .encoding.prompt import PromptEmbeds
from .errors import InputError

LATENT_CHANNELS = 64
VAE_SCALE = 16

# -- file identity (the loaded-model cache key) --------------------------------------------------------------------


def file_identity(path: str | os.PathLike) -> tuple:
    """What makes a model file (or folder) the same one: real path plus size and mtime of every weight file in it.

    A folder's identity covers its `.safetensors`/`.json` files one level down (a diffusers pipeline keeps each
    component in a subfolder), so replacing any shard changes it.
    """
    real = Path(os.path.realpath(path))
    if real.is_file():
        st = real.stat()
        return (str(real), st.st_size, st.st_mtime_ns)
    parts = []
    for f in sorted(real.rglob("*")):
        if f.is_file() and f.suffix in (".safetensors", ".json") and len(f.relative_to(real).parts) <= 2:
            st = f.stat()
            parts.append((str(f.relative_to(real)), st.st_size, st.st_mtime_ns))
    return (str(real), tuple(parts))


# -- latents -------------------------------------------------------------------------------------------------------


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
    expected = f"a LATENT dict whose 'samples' is [batch, {channels}, height/16, width/16] (Qwen-Image-2.1)"
    if not isinstance(latent, dict) or not isinstance(latent.get("samples"), torch.Tensor):
        raise InputError(name, type(latent).__name__, expected)
    samples = latent["samples"]
    if samples.dim() == 5 and samples.shape[2] == 1:
        samples = samples[:, :, 0]
    if samples.dim() != 4 or samples.shape[1] != channels or samples.shape[0] < 1:
        raise InputError(name, f"samples of shape {list(samples.shape)}", expected)
    return samples


def empty_latent(width: int, height: int, batch_size: int = 1, channels: int = LATENT_CHANNELS) -> dict:
    """An all-zero LATENT of the given pixel size, as core's Qwen-Image-2.1 encode node makes it."""
    return {"samples": torch.zeros(batch_size, channels, height // VAE_SCALE, width // VAE_SCALE)}


# -- conditioning --------------------------------------------------------------------------------------------------


@dataclass
class ParsedConditioning:
    embeds: PromptEmbeds
    reference_latents: list[torch.Tensor]  # raw VAE space, [1, C, h, w] each


def _slots_per_reference(ref: torch.Tensor, name: str, index: int) -> int:
    tokens = ref.shape[-2] * ref.shape[-1]
    if tokens % TOKENS_PER_SLOT:
        raise InputError(f"{name} reference_latents[{index}]", f"a {ref.shape[-2]}x{ref.shape[-1]} latent grid",
                         "a reference whose latent token count is a multiple of 4 (image sides in multiples of "
                         "32 px, as the Qwen-Image-2.1 encode nodes size them)")
    return tokens // TOKENS_PER_SLOT


def _reference_latent(ref, name: str, index: int, channels: int) -> torch.Tensor:
    expected = f"a tensor [1, {channels}, h, w] (raw VAE latents)"
    if not isinstance(ref, torch.Tensor):
        raise InputError(f"{name} reference_latents[{index}]", type(ref).__name__, expected)
    if ref.dim() == 5 and ref.shape[2] == 1:
        ref = ref[:, :, 0]
    if ref.dim() != 4 or ref.shape[1] != channels:
        raise InputError(f"{name} reference_latents[{index}]", f"shape {list(ref.shape)}", expected)
    return ref[:1]


def conditioning_to_prompt(conditioning, name: str = "positive",
                           channels: int = LATENT_CHANNELS) -> ParsedConditioning:
    """Core CONDITIONING (from core's TextEncodeQwenImage21 or this pack's encode node) -> PromptEmbeds + references.

    The vision slots are re-expanded: for reference `i` of `h x w` latent tokens, `h*w/4` rows marked in
    `image_mask` are inserted at `image_slots[i]`, as core's transformer splices the reference at that index.
    """
    expected = ("CONDITIONING from a Qwen-Image-2.1 text encode node: one entry [cond [B, T, C], {...}] (combined "
                "or area conditioning is not supported)")
    if not isinstance(conditioning, (list, tuple)) or len(conditioning) == 0:
        raise InputError(name, type(conditioning).__name__, expected)
    if len(conditioning) > 1:
        raise InputError(name, f"{len(conditioning)} conditioning entries", expected)
    entry = conditioning[0]
    if not isinstance(entry, (list, tuple)) or len(entry) < 2 or not isinstance(entry[0], torch.Tensor):
        raise InputError(name, type(entry).__name__, expected)
    cond, extras = entry[0], dict(entry[1] or {})
    if cond.dim() != 3:
        raise InputError(name, f"cond of shape {list(cond.shape)}", expected)
    batch, length = cond.shape[0], cond.shape[1]

    refs = [_reference_latent(r, name, i, channels) for i, r in enumerate(extras.get("reference_latents") or [])]
    counts = [_slots_per_reference(r, name, i) for i, r in enumerate(refs)]
    given = list(extras.get("image_slots") or [])
    # Core's rule: a reference without a slot goes after the text; slots beyond the references are ignored.
    slots = (given + [length] * len(refs))[:len(refs)]
    previous = 0
    for i, slot in enumerate(slots):
        if not isinstance(slot, int) or isinstance(slot, bool) or not previous <= slot <= length:
            raise InputError(f"{name} image_slots[{i}]", slot,
                             f"increasing token indices within the {length}-token conditioning")
        previous = slot

    mask = extras.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape[-1:]) != (length,):
            raise InputError(f"{name} attention_mask", getattr(mask, "shape", mask), f"a [batch, {length}] mask")
        mask = mask.reshape(-1, length).bool().to(cond.device)
        if mask.shape[0] == 1 and batch > 1:
            mask = mask.expand(batch, -1)

    pieces, image_pieces, mask_pieces = [], [], []
    start = 0
    for slot, count in zip(slots, counts):
        pieces += [cond[:, start:slot], cond.new_zeros(batch, count, cond.shape[2])]
        image_pieces += [torch.zeros(slot - start, dtype=torch.bool), torch.ones(count, dtype=torch.bool)]
        if mask is not None:
            mask_pieces += [mask[:, start:slot], mask.new_ones(batch, count)]
        start = slot
    pieces.append(cond[:, start:])
    image_pieces.append(torch.zeros(length - start, dtype=torch.bool))
    if mask is not None:
        mask_pieces.append(mask[:, start:])
    embeds = torch.cat(pieces, dim=1)
    image_mask = torch.cat(image_pieces).to(cond.device).unsqueeze(0).expand(batch, -1).clone()
    text_mask = None
    if mask is not None:
        text_mask = torch.cat(mask_pieces, dim=1)
        if bool(text_mask.all()):
            text_mask = None
    return ParsedConditioning(PromptEmbeds(embeds=embeds, image_mask=image_mask, text_mask=text_mask), refs)


def prompt_to_conditioning(embeds: PromptEmbeds, reference_latents=()) -> list:
    """PromptEmbeds + raw reference latents -> core-format CONDITIONING (readable by core's sampler too).

    Each reference's vision rows (`h*w/4` of them, in order) are dropped and their position recorded in
    `image_slots`, exactly the layout core's Qwen-Image-2.1 text encoder produces.
    """
    refs = [r for r in reference_latents]
    image_mask = embeds.image_mask[0].bool()
    counts = [_slots_per_reference(r, "reference", i) for i, r in enumerate(refs)]
    positions = image_mask.nonzero(as_tuple=True)[0].tolist()
    if sum(counts) != len(positions):
        raise InputError("reference images", f"{len(refs)} latents covering {sum(counts)} slots",
                         f"latents matching the {len(positions)} image slots the prompt was encoded with")
    slots, cursor = [], 0
    for count in counts:
        first = positions[cursor]
        slots.append(first - cursor)  # rows kept before this image: everything before it minus earlier image rows
        cursor += count
    keep = ~image_mask
    cond = embeds.embeds[:, keep.to(embeds.embeds.device)]
    extras = {"pooled_output": None}
    if embeds.text_mask is not None:
        text_mask = embeds.text_mask[:, keep.to(embeds.text_mask.device)]
        if not bool(text_mask.all()):
            extras["attention_mask"] = text_mask.long()
    if refs:
        extras["image_slots"] = slots
        extras["reference_latents"] = refs
    return [[cond, extras]]


def encode_pixels_raw(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, H, W] in [-1, 1] -> raw latents [B, z, H/16, W/16] (the distribution's mode, not normalized):
    what a ComfyUI LATENT and core's `reference_latents` hold. Serialized per VAE, as every runtime VAE call is."""
    return vae_encode(vae, pixels)


def decode_raw_latents(vae, raw: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """Raw latents [B, z, h, w] (a ComfyUI LATENT's samples) -> the VAE's output [B, C, 16h, 16w] in [-1, 1];
    `tiled` when a whole decode does not fit (graph_runtime/vae_decode.py)."""
    return vae_decode(vae, raw, tiled)


# -- pixels --------------------------------------------------------------------------------------------------------


def comfy_image_to_vae_pixels(image: torch.Tensor, name: str = "image") -> torch.Tensor:
    """ComfyUI IMAGE `[B, H, W, 3|4]` in [0, 1] -> the VAE's RGBA input `[B, 4, 1, H, W]` in [-1, 1].

    An RGB image gets an opaque alpha channel: the Qwen-Image-2.1 VAE reads and writes RGBA.
    """
    if not isinstance(image, torch.Tensor) or image.dim() != 4 or image.shape[-1] not in (3, 4):
        raise InputError(name, getattr(image, "shape", type(image).__name__), "an IMAGE [batch, height, width, 3 or 4]")
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


def crop_to_multiple(image: torch.Tensor, multiple: int = VAE_SCALE) -> torch.Tensor:
    """Center-crop an IMAGE `[B, H, W, C]` to sides that are multiples of `multiple` (the VAE's 16x grid)."""
    if not isinstance(image, torch.Tensor) or image.dim() != 4:
        raise InputError("image", getattr(image, "shape", type(image).__name__), "an IMAGE [batch, height, width, C]")
    height, width = image.shape[1], image.shape[2]
    new_h, new_w = height // multiple * multiple, width // multiple * multiple
    if new_h < multiple or new_w < multiple:
        raise InputError("image", f"{width}x{height} px", f"at least {multiple}x{multiple} px")
    top, left = (height - new_h) // 2, (width - new_w) // 2
    return image[:, top:top + new_h, left:left + new_w]


def comfy_image_to_pil(image: torch.Tensor):
    """The first image of an IMAGE batch as a PIL image (RGBA when it has an alpha channel)."""
    from PIL import Image

    array = (image[0].float().clamp(0, 1) * 255.0).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(array, mode="RGBA" if array.shape[-1] == 4 else "RGB")


# -- live previews -------------------------------------------------------------------------------------------------


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
