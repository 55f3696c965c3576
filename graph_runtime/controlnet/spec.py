"""A ControlNet as a sampling run sees it: the net, its images, strength and start/end range, and what each step and
each prefix branch gets from it.

Control tokens follow ComfyUI's native preparation of the 129 channels for a target of h x w latents (pixels at 16x):
- control latents: the control image resized (bicubic) to the target's pixel size, VAE-encoded, in the model's
  normalized latent space; zeros without a control image;
- keep mask: 1 where the source is kept, 0 where it is regenerated; the regenerate mask is the MASK resized
  (bilinear) to the pixel size and thresholded at 0.5, taken to the latent grid by nearest sampling; without a MASK
  everything is regenerated (keep 0);
- inpaint latents: the inpaint image resized (bicubic), regenerated pixels set to mid-gray (0.5), VAE-encoded and
  normalized; zeros without an inpaint image.
Start/end percent map to sigmas through the model's sampling (`percent_to_sigma` of a flow model with a shift); a
step is controlled when `sigma_end <= sigma <= sigma_start`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..report import compute_dtype
from ..sampling.schedule import flow_percent_to_sigma
from .model import LATENT_CHANNELS, FunControlNet
from .stream import ControlledPrefix

VAE_SCALE = 16



def _check_image(image, name: str):
    if image is None:
        return None
    if not isinstance(image, torch.Tensor) or image.dim() != 4 or image.shape[-1] not in (3, 4):
        raise InputError(name, getattr(image, "shape", type(image).__name__), "an IMAGE [batch, height, width, 3 or 4]")
    return image[:1, ..., :3].float()


def _check_mask(mask):
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 3, 4):
        raise InputError("mask", getattr(mask, "shape", type(mask).__name__), "a MASK [batch, height, width]")
    return mask.reshape(-1, 1, *mask.shape[-2:])[:1].float()


def _resize(image: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """`[1, H, W, C]` IMAGE (or `[1, 1, H, W]` mask) to the target's pixel size."""
    if image.shape[-1] in (3, 4) and image.dim() == 4 and mode == "bicubic":
        return F.interpolate(image.movedim(-1, 1), size=(height, width), mode=mode).movedim(1, -1)
    return F.interpolate(image, size=(height, width), mode=mode)


@dataclass
class ControlSpec:
    """One ControlNet applied to a model. `encode(image [1, H, W, 3] in [0, 1]) -> [1, 64, H/16, W/16]` normalized
    latents (the VAE the user wired in). `sigma_start` / `sigma_end`: the range of sigmas the net acts in."""

    net: FunControlNet
    encode: Callable[[torch.Tensor], torch.Tensor]
    strength: float
    sigma_start: float = 1.0
    sigma_end: float = 0.0
    image: torch.Tensor | None = None
    inpaint_image: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    _tokens: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.image = _check_image(self.image, "image")
        self.inpaint_image = _check_image(self.inpaint_image, "inpaint_image")
        self.mask = _check_mask(self.mask)
        if self.image is None and self.inpaint_image is None and self.mask is None:
            raise InputError("image", None, "a control image, an inpaint image or a mask for the ControlNet")
        if not math.isfinite(self.strength):
            raise InputError("strength", self.strength, "a finite number")

    def active(self, sigma: float) -> bool:
        """Whether a step at `sigma` is controlled."""
        return self.sigma_end <= float(sigma) <= self.sigma_start

    def tokens(self, height: int, width: int) -> torch.Tensor:
        """The `[1, 129, height, width]` control channels for a target of that many latents (made once per size)."""
        key = (height, width)
        if key not in self._tokens:
            self._tokens[key] = self._make_tokens(height, width)
        return self._tokens[key]

    def _make_tokens(self, height: int, width: int) -> torch.Tensor:
        px_h, px_w = height * VAE_SCALE, width * VAE_SCALE
        control = torch.zeros(1, LATENT_CHANNELS, height, width)
        if self.image is not None:
            control = self._encoded(_resize(self.image, px_h, px_w, "bicubic"), height, width, "image")
        regenerate = torch.ones(1, 1, px_h, px_w)
        if self.mask is not None:
            regenerate = (_resize(self.mask, px_h, px_w, "bilinear") >= 0.5).float()
        inpaint = torch.zeros_like(control)
        if self.inpaint_image is not None:
            source = _resize(self.inpaint_image, px_h, px_w, "bicubic")
            source = source * (1 - regenerate.movedim(1, -1)) + 0.5 * regenerate.movedim(1, -1)
            inpaint = self._encoded(source, height, width, "inpaint_image")
        keep = 1 - F.interpolate(regenerate, size=(height, width), mode="nearest")
        return torch.cat([control, keep, inpaint], dim=1)

    def _encoded(self, pixels: torch.Tensor, height: int, width: int, name: str) -> torch.Tensor:
        latent = self.encode(pixels).float().cpu()
        if tuple(latent.shape) != (1, LATENT_CHANNELS, height, width):
            raise InputError(f"{name} latent", tuple(latent.shape), f"[1, {LATENT_CHANNELS}, {height}, {width}] from "
                                                                      "the VAE (a Qwen-Image-2.1 VAE)")
        return latent

    def for_branch(self, transformer, batch: int, height: int, width: int) -> ControlledPrefix:
        """What one prefix branch of `batch` samples gets: the net on the model's device and dtype, its tokens."""
        self.net.check_base(transformer)
        # The dtype activations run in: an INT8 or FP8 model's first parameter may be an 8-bit weight.
        device, dtype = next(transformer.parameters()).device, compute_dtype(transformer)
        net = self.net.placed(device, dtype)
        tokens = self.tokens(height, width).flatten(2).transpose(1, 2).to(device, dtype)
        layers = tuple(net.injection_layers(len(transformer.transformer_blocks)))
        return ControlledPrefix(net, layers, tokens.expand(batch, -1, -1), self.strength)

    def memory_bytes(self, transformer, batch: int, prefix_tokens: int, target_tokens: int) -> int:
        """What the ControlNet adds to a request on the model's device: its weights in the model's dtype, the control
        blocks' K/V of a controlled graph entry, and where its range is not the whole schedule, a second (plain)
        entry's base K/V beside the controlled one."""
        itemsize = compute_dtype(transformer).itemsize
        weights = sum(p.numel() for p in self.net.parameters()) * itemsize
        rows = batch * (prefix_tokens + target_tokens) * self.net.inner_dim * itemsize
        control_kv = 2 * self.net.num_blocks * rows
        whole = self.sigma_start >= 1.0 and self.sigma_end <= 0.0
        plain_entry = 0 if whole else 2 * len(transformer.transformer_blocks) * rows
        return weights + control_kv + plain_entry
