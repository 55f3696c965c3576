"""Masked sampling (inpainting) as ComfyUI's KSampler does it with a latent's noise mask.

Where the mask is 1 the image is sampled anew; where it is 0 the model sees the input latent's own noising path,
`sigma * noise + (1 - sigma) * input`, at every step, and its prediction there is replaced by the input, so the run's
latents follow that path and at sigma 0 that region is the input latent. Fractional values blend the two. The update
runs in float32 whatever the model's dtype, so the kept region is not rounded away step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Inpaint:
    """One run's mask, noise and input latent, packed like the latents: `[B, tokens, 1]` and `[B, tokens, C]`."""

    mask: torch.Tensor
    noise: torch.Tensor
    init: torch.Tensor

    @classmethod
    def packed(cls, mask: torch.Tensor, noise: torch.Tensor, init: torch.Tensor) -> "Inpaint":
        """From `[B, 1, h, w]` mask and packed `[B, h * w, C]` noise and input latent."""
        return cls(mask.flatten(2).transpose(1, 2).float(), noise.float(), init.float())

    def model_input(self, latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The latents the model sees at `sigma`: the kept region put back on the input's noising path."""
        kept = sigma * self.noise + (1.0 - sigma) * self.init
        return latents.float() * self.mask + kept * (1.0 - self.mask)

    def step(self, latents: torch.Tensor, model_input: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor,
             sigma_next: torch.Tensor) -> torch.Tensor:
        """KSampler's Euler step: the prediction as `denoised`, the input latent taken as the denoised image where the
        mask keeps it, and the step taken from the run's own latents (not the re-noised model input), in float32."""
        denoised = model_input - sigma * velocity.float()
        denoised = denoised * self.mask + self.init * (1.0 - self.mask)
        latents = latents.float()
        return latents + (latents - denoised) / sigma * (sigma_next - sigma)
