"""Decoding single images with the Qwen-Image-2.1 VAE in the memory it really needs.

diffusers' `decode` runs the video decoder with its temporal feature cache: every causal convolution keeps a clone
of its input for the next frame, for the whole decode. An image has one frame, and this VAE's convolutions have no
temporal extent, so the clones are never read: without them the full-size VAE decodes an image in well under two
thirds of the memory (a trace of the allocations: tests/test_memory.py), with bit-equal output.

When even that does not fit next to what must stay on the GPU (the transformer and its captured graphs), the decode
is tiled with diffusers' own tiled decoder (256 px tiles blended over 64 px: a few hundred MiB at any size, and
output that differs slightly at the seams), as ComfyUI's own VAE decode falls back to when it runs out of memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import memory
from .errors import FlatOutputError, NonFiniteError

logger = logging.getLogger("kvgraph")
_logged: set[str] = set()


def _can_skip_cache(vae, z: torch.Tensor) -> bool:
    config = vae.config
    return z.shape[2] == 1 and getattr(config, "patch_size", None) is None and not vae.use_tiling


@torch.no_grad()
def decode_frames(vae, z: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """`vae.decode(z)` for `z` `[B, C, 1, h, w]`: the cache-free decoder for single frames, else diffusers' own."""
    if tiled:
        was = vae.use_tiling
        vae.use_tiling = True
        try:
            return vae.decode(z, return_dict=False)[0]
        finally:
            vae.use_tiling = was
    if not _can_skip_cache(vae, z):
        return vae.decode(z, return_dict=False)[0]
    out = vae.decoder(vae.post_quant_conv(z), feat_cache=None, first_chunk=True)
    return torch.clamp(out, min=-1.0, max=1.0)


def should_tile(vae, height: int, width: int, free_bytes: int | None) -> bool:
    """Whether a whole decode at `height` x `width` px would not fit in `free_bytes` (None: unknown, so no) while a
    tiled one would. Logged once per reason."""
    if free_bytes is None:
        return False
    dims = memory.VaeDims.of(vae)
    whole = memory.vae_decode_bytes(dims, width, height)
    margin = memory.MARGIN_BYTES
    if whole + margin <= free_bytes or memory.vae_decode_bytes(dims, width, height, tiled=True) + margin > free_bytes:
        return False
    key = f"{width}x{height}"
    if key not in _logged:
        _logged.add(key)
        logger.info("KV-Graph: VAE decode at %dx%d is tiled: a whole decode needs %s and %s is free next to the "
                    "models and graphs on the GPU.", width, height, memory.gib(whole + margin), memory.gib(free_bytes))
    return True


@dataclass(frozen=True)
class DecodePlan:
    """How one image decodes: its output size in pixels, whole or tiled, and the memory that decode needs."""

    width: int
    height: int
    tiled: bool
    bytes: int


def plan_decode(vae, latent_height: int, latent_width: int, free_bytes: int | None,
                weights_to_load: bool = False) -> DecodePlan:
    """The decode of one `latent_height` x `latent_width` latent in `free_bytes` (None: unknown): whole, or tiled when
    only a tiled decode fits (`should_tile`). `weights_to_load`: the VAE's own weights are not on the device yet, so
    they come out of `free_bytes` first."""
    dims = memory.VaeDims.of(vae)
    height, width = latent_height * dims.spatial_ratio, latent_width * dims.spatial_ratio
    if free_bytes is not None and weights_to_load:
        free_bytes -= dims.weight_bytes
    tiled = should_tile(vae, height, width, free_bytes)
    return DecodePlan(width, height, tiled, memory.vae_decode_bytes(dims, width, height, tiled))


def check_decoded(images: torch.Tensor, vae_name: str | None = None,
                  position: tuple[int, int] | None = None) -> None:
    """Refuse a decode whose output cannot be an image: NaN/inf (NaN weights decode to a black image once saved), or
    an image of one flat colour (an all-zero VAE decodes everything to grey). Call it on the VAE's output
    `[B, C, H, W]` in [-1, 1], decoded from latents already checked finite, so the VAE's weights are the cause; a
    flat image of the clamp bounds (pure white or black) can be real and passes. One host sync. `position`: (index,
    count) of `images` in a batch decoded one image at a time, to name it."""
    lo, hi = images.amin(dim=(-2, -1)), images.amax(dim=(-2, -1))  # [B, C]
    flat = ((lo == hi).all(dim=1) & (hi.abs() < 1).any(dim=1)).nonzero().flatten()
    finite, flat = torch.isfinite(images).all().item(), flat.tolist()
    weights = f"the VAE's weights ({vae_name})" if vae_name else "the VAE's weights"
    damaged = "a damaged or wrongly converted file: replace the VAE file"
    if not finite:
        raise NonFiniteError("the decoded image", f"the latent was finite, so {weights} are the likely cause, "
                                                  f"{damaged}")
    if flat:
        first, count = (position[0] + flat[0], position[1]) if position else (flat[0], images.shape[0])
        which = "the decoded image" if count == 1 else f"decoded image {first + 1} of {count}"
        raise FlatOutputError(which, f"a working VAE decodes no latent to one flat colour, so {weights} are the "
                                     f"likely cause (all zero?), {damaged}")
