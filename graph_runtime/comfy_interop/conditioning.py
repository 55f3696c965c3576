"""ComfyUI CONDITIONING <-> the runtime's PromptEmbeds.

CONDITIONING is `[[cond, extras]]`. `cond` is `[B, T, 4096]`: the text encoder's hidden states with the system turn
dropped and the *vision tokens removed*. `extras` may hold `attention_mask` `[B, T]` (only when padded),
`image_slots` (for each reference image, the index in `cond` where its latent tokens are spliced in) and
`reference_latents` (raw VAE space, `[1, 64, h, w]` each, in image order). A reference without a slot goes after
the last text token.

The runtime's `PromptEmbeds` instead keeps one encoder row per vision slot (each standing for 2x2 latent tokens)
and marks them in `image_mask`; the transformer never reads those rows' values (it splices the reference latents in),
so dropping them and reinserting zeros loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decode import TOKENS_PER_SLOT
from ..encoding.prompt import PromptEmbeds
from ..errors import InputError
from ..validation import MAX_REFERENCES, describe_value
from .latents import LATENT_CHANNELS


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


def conditioning_to_prompt(conditioning, name: str = "positive", channels: int = LATENT_CHANNELS,
                           text_dim: int | None = None) -> ParsedConditioning:
    """Core CONDITIONING (from core's TextEncodeQwenImage21 or this pack's encode node) -> PromptEmbeds + references.

    The vision slots are re-expanded: for reference `i` of `h x w` latent tokens, `h*w/4` rows marked in
    `image_mask` are inserted at `image_slots[i]`, as core's transformer splices the reference at that index.
    `text_dim`: the width the transformer reads (another model's text encoder gives another one).
    """
    expected = ("CONDITIONING from a Qwen-Image-2.1 text encode node: one entry [cond [B, T, C], {...}] (combined "
                "or area conditioning is not supported)")
    if not isinstance(conditioning, (list, tuple)) or len(conditioning) == 0:
        raise InputError(name, describe_value(conditioning), expected)
    if len(conditioning) > 1:
        raise InputError(name, f"{len(conditioning)} conditioning entries", expected)
    entry = conditioning[0]
    if not isinstance(entry, (list, tuple)) or len(entry) < 2 or not isinstance(entry[0], torch.Tensor):
        raise InputError(name, type(entry).__name__, expected)
    cond, extras = entry[0], dict(entry[1] or {})
    if cond.dim() != 3:
        raise InputError(name, f"cond of shape {list(cond.shape)}", expected)
    if text_dim is not None and cond.shape[2] != text_dim:
        raise InputError(name, f"conditioning of width {cond.shape[2]} (another model's text encoder)",
                         f"Qwen-Image-2.1 conditioning of width {text_dim}, from the KV-Graph encode node or core's "
                         "Qwen-Image-2.1 text encode node")
    batch, length = cond.shape[0], cond.shape[1]

    given_refs = list(extras.get("reference_latents") or [])
    if len(given_refs) > MAX_REFERENCES:  # e.g. core's Reference Latent chained eleven times
        raise InputError(f"{name} reference_latents", f"{len(given_refs)} reference images",
                         f"at most {MAX_REFERENCES} reference images (Qwen-Image-2.1's limit)")
    refs = [_reference_latent(r, name, i, channels) for i, r in enumerate(given_refs)]
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


def conditioning_to(conditioning: list, device) -> list:
    """CONDITIONING with its tensors (`cond`, `attention_mask`, `reference_latents`) on `device`; each entry's
    extras are a copy, so the conditioning given is left as it is."""
    out = []
    for cond, extras in conditioning:
        extras = dict(extras)
        if "attention_mask" in extras:
            extras["attention_mask"] = extras["attention_mask"].to(device)
        if "reference_latents" in extras:
            extras["reference_latents"] = [r.to(device) for r in extras["reference_latents"]]
        out.append([cond.to(device), extras])
    return out


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
