"""What one conditioning entry puts in front of the image: its prompt embeddings and reference latents, with a digest
of their content.

Core samplers hand the model the same conditioning at every step, but as new tensors each time (moved, repeated,
concatenated), so a prefix cannot be found again by tensor identity. The digest names the content instead: two
entries with the same prompt embeddings, masks, image slots and reference latents share one prefix, and entries that
differ in any of them never do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..comfy_interop.conditioning import conditioning_to_prompt
from ..comfy_interop.latents import LATENT_CHANNELS, LatentStats, latent_stats, raw_to_normalized
from ..encoding.prompt import PromptEmbeds
from ..errors import InputError

# The keys of a conditioning entry's extras that change the prefix (the rest, e.g. `pooled_output`, do not).
PREFIX_EXTRAS = ("attention_mask", "image_slots", "reference_latents")


@dataclass(frozen=True, eq=False)
class PrefixSource:
    """One conditioning entry as the prefix reads it. Compared (and hashed) by `digest` only."""

    embeds: PromptEmbeds
    references: tuple[torch.Tensor, ...]  # normalized latent space, [1, C, h, w] each, in image order
    digest: str

    def __eq__(self, other) -> bool:
        return isinstance(other, PrefixSource) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return (f"PrefixSource({self.embeds.embeds.shape[1]} encoder rows, {len(self.references)} references, "
                f"{self.digest[:12]})")

    @property
    def reference_shapes(self) -> list[tuple[int, int, int]]:
        return [(1, r.shape[2], r.shape[3]) for r in self.references]

    @property
    def batch(self) -> int:
        return self.embeds.embeds.shape[0]

    def embeds_for(self, batch: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings and text mask for a model call of `batch` samples. A call may hold several copies of the
        conditioning's own batch (core batches equal conditionings, e.g. a negative equal to the positive, into one
        call), so the rows repeat as often as the batch holds them, as core repeats them."""
        own = self.batch
        if batch % own:
            raise InputError("conditioning", f"{own} prompts for a model call of {batch} latents",
                             "1 prompt, or one per latent in the batch")
        repeats = batch // own
        embeds = PromptEmbeds(self.embeds.embeds.repeat(repeats, 1, 1), self.embeds.image_mask.repeat(repeats, 1),
                              None if self.embeds.text_mask is None else self.embeds.text_mask.repeat(repeats, 1))
        return embeds.for_batch(batch, device, dtype)

    @classmethod
    def from_conditioning(cls, cond: torch.Tensor, extras: dict, stats: LatentStats | None = None,
                          channels: int = LATENT_CHANNELS, name: str = "conditioning",
                          text_dim: int | None = None) -> "PrefixSource":
        """One core CONDITIONING entry (`cond` and its extras dict, as core's Qwen-Image-2.1 encode node or the
        pack's makes it) read as the runtime reads it; reference latents go to the model's normalized space.
        `text_dim`: the width of the transformer's text input, checked."""
        extras = {k: extras[k] for k in PREFIX_EXTRAS if extras.get(k) is not None}
        parsed = conditioning_to_prompt([[cond, extras]], name, channels, text_dim)
        stats = stats if stats is not None else latent_stats()
        references = tuple(raw_to_normalized(r, stats) for r in parsed.reference_latents)
        return cls(parsed.embeds, references, content_digest(parsed.embeds, references))


def content_digest(embeds: PromptEmbeds, references) -> str:
    """A digest of everything that decides the prefix K/V: the embeddings and masks (values, shapes, dtypes) and
    each reference latent. Read from host copies once per sampling run, never per step."""
    digest = hashlib.blake2b(digest_size=20)
    tensors = [embeds.embeds, embeds.image_mask, embeds.text_mask, *references]
    for tensor in tensors:
        if tensor is None:
            digest.update(b"none;")
            continue
        host = tensor.detach().to("cpu").contiguous()
        digest.update(f"{tuple(host.shape)}|{host.dtype};".encode())
        digest.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
