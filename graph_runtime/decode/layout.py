"""The joint text/image token layout of one request branch, computed once on the host.

diffusers rebuilds this inside every forward (`repeat_interleave` with tensor repeats, `nonzero()`, `.tolist()` in the
RoPE and the prefix segments): host syncs that cannot be captured in a CUDA graph and that cost time every step.
Everything here depends only on the prompt's token layout and the image sizes, not on the denoising step, so the
prefill computes it once and every decode step reads it.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

# Each vision-language image slot stands for a 2x2 group of latent tokens (16 px VAE tokens, 32 px VLM slots).
TOKENS_PER_SLOT = 4

# RoPE tables per model (its `pos_embed` module) and layout: diffusers' table builder walks every token in Python
# and syncs on its masks, for a table that is the same for every prompt of a layout. The few most recent layouts
# are kept (a table is small next to the model).
ROTARY_TABLES_KEPT = 8
_rotary_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_rotary_lock = threading.Lock()


@dataclass(frozen=True)
class TokenLayout:
    """Where text, condition images and the target image sit in the joint sequence.

    `image_pad_mask` is over the joint sequence (text positions False, every image token True); condition images
    come first in `img_shapes`, the target image last, and the target's tokens are the last `target_tokens`.
    """

    image_pad_mask: torch.Tensor  # (seq_len,) bool, on the compute device
    img_shapes: tuple[tuple[int, int, int], ...]
    prefix_len: int
    target_tokens: int
    segments: tuple[tuple[int, int, bool], ...]  # prefix runs (start, end, is_text), as diffusers' processor reads them
    vlm_text_positions: torch.Tensor | None = field(default=None, compare=False)  # for the padded-mask path
    # Joint-sequence positions of the image and the text tokens, on the compute device (where the prefill scatters
    # the latent and text rows; precomputed so it needs no `nonzero()` sync).
    image_positions: torch.Tensor | None = field(default=None, compare=False)
    text_positions: torch.Tensor | None = field(default=None, compare=False)

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.target_tokens

    @property
    def signature(self) -> tuple:
        """Everything that makes two layouts differ for a decode graph: the prefix runs and every image shape.

        Equal token counts with different layouts differ here, since RoPE positions follow the runs.
        """
        return (self.prefix_len, self.target_tokens, self.img_shapes, self.segments)

    @classmethod
    def build(cls, vlm_image_mask: torch.Tensor, img_shapes, device) -> "TokenLayout":
        """From the text encoder's image-slot mask (over the encoder sequence, condition slots only) and the shapes.

        The target image's tokens are appended after the encoder sequence. Unlike the diffusers pipeline, which
        appends `target_tokens // 4` slots and so needs an even latent grid, the target is laid out token by token,
        so any multiple of 16 px works.
        """
        img_shapes = tuple(tuple(int(v) for v in s) for s in img_shapes)
        if not img_shapes:
            raise ValueError("img_shapes must hold at least the target image's (1, h, w)")
        mask = vlm_image_mask.detach().to("cpu", torch.bool)
        if mask.dim() == 2:
            mask = mask[0]
        runs = mask.tolist()
        cond_tokens = sum(math.prod(s) for s in img_shapes[:-1])
        slots = sum(runs)
        if slots * TOKENS_PER_SLOT != cond_tokens:
            raise ValueError(
                f"the prompt encoding reserves {slots} image slots ({slots * TOKENS_PER_SLOT} latent tokens) but the "
                f"condition images have {cond_tokens} latent tokens; encode the prompt with the same reference images"
            )
        joint = []
        for is_image in runs:
            joint.extend([True] * TOKENS_PER_SLOT if is_image else [False])
        target_tokens = math.prod(img_shapes[-1])
        prefix_len = len(joint)
        joint.extend([True] * target_tokens)

        segments = []
        block_bounds = _image_block_bounds(joint[:prefix_len], img_shapes[:-1])
        start = 0
        for begin, end in block_bounds:
            if begin > start:
                segments.append((start, begin, True))
            segments.append((begin, end, False))
            start = end
        if start < prefix_len:
            segments.append((start, prefix_len, True))
        vlm_text_positions = (~mask).nonzero(as_tuple=True)[0]
        return cls(
            image_pad_mask=torch.tensor(joint, dtype=torch.bool, device=device),
            img_shapes=img_shapes,
            prefix_len=prefix_len,
            target_tokens=target_tokens,
            segments=tuple(segments),
            vlm_text_positions=vlm_text_positions,
            image_positions=torch.tensor([i for i, is_image in enumerate(joint) if is_image], dtype=torch.long,
                                         device=device),
            text_positions=torch.tensor([i for i, is_image in enumerate(joint) if not is_image], dtype=torch.long,
                                        device=device),
        )

    def rotary(self, pos_embed: torch.nn.Module) -> torch.Tensor:
        """Complex RoPE table over the joint sequence, from the model's own `QwenImage21Rope` (remembered per model
        and layout; callers only read it)."""
        device = self.image_pad_mask.device
        key = (self.signature, str(device))
        with _rotary_lock:
            tables = _rotary_tables.setdefault(pos_embed, OrderedDict())
            table = tables.get(key)
            if table is not None:
                tables.move_to_end(key)
                return table
        table = pos_embed(list(self.img_shapes), self.image_pad_mask, device=device)
        with _rotary_lock:
            tables[key] = table
            while len(tables) > ROTARY_TABLES_KEPT:
                tables.popitem(last=False)
        return table

    def target_token_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.seq_len, dtype=torch.bool, device=self.image_pad_mask.device)
        mask[self.prefix_len:] = True
        return mask

    def prefix_attention_mask(self, device) -> torch.Tensor:
        """`[P, P]` bool, True where prefix row i may attend to prefix key j: every key before its segment, and
        within its segment all keys (an image) or those up to itself (text). Diffusers' processor applies the same
        rule one segment at a time."""
        allowed = torch.zeros(self.prefix_len, self.prefix_len, dtype=torch.bool, device=device)
        for start, end, is_text in self.segments:
            allowed[start:end, :start] = True
            own = torch.ones(end - start, end - start, dtype=torch.bool, device=device)
            allowed[start:end, start:end] = own.tril() if is_text else own
        return allowed

    def joint_key_valid(self, text_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Expand a text padding mask over the encoder sequence to the joint sequence (None when nothing is padded)."""
        if text_mask is None:
            return None
        text_mask = text_mask.bool()
        if bool(text_mask.all()):
            return None
        batch = text_mask.shape[0]
        valid = torch.ones(batch, self.seq_len, dtype=torch.bool, device=text_mask.device)
        text_positions = self.text_positions.to(text_mask.device)
        valid[:, text_positions] = text_mask[:, self.vlm_text_positions.to(text_mask.device)]
        return valid


def _image_block_bounds(prefix_is_image: list[bool], cond_shapes) -> list[tuple[int, int]]:
    """Split the prefix's image tokens into one block per condition image, by token count (not by runs: two
    adjacent images with no text between them are still separate bidirectional blocks)."""
    positions = [i for i, is_image in enumerate(prefix_is_image) if is_image]
    bounds, cursor = [], 0
    for shape in cond_shapes:
        n = math.prod(shape)
        block = positions[cursor:cursor + n]
        if block[-1] - block[0] + 1 != n:
            raise ValueError("a condition image's slots are not contiguous in the prompt encoding")
        bounds.append((block[0], block[-1] + 1))
        cursor += n
    return bounds
