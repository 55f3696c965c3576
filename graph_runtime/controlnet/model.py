"""The Qwen-Image-2.1 Fun ControlNet Union as a module: a stream of transformer block copies beside the base model.

Facts of the released model (ComfyUI's native `QwenImage21FunControl`, VACE-style):
- `control_img_in` (Linear 129 -> D, with bias) embeds each target token's 129 control channels: 64 control-image
  latents, 1 keep mask, 64 masked-image (inpaint) latents, all in the model's normalized latent space;
- the stream starts from the base model's embedded joint sequence: `before_proj(joint) + x`, where `joint` holds the
  embedded control tokens in the target rows and zeros in the prefix (text and reference) rows;
- control block j is a copy of a base block (same modulation, RoPE and block-causal attention as the base model) and
  its `after_proj` output, times the strength, is added to every row of the base sequence right after base block
  `injection_layers[j]`; the control blocks pair with every (base blocks / control blocks)-th base block from 0.

The blocks are diffusers' own block class, so the pack's decode block code (kernels, K/V buffers) runs them as it
runs the base blocks.
"""

from __future__ import annotations

import itertools

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TransformerBlock

CONTROL_CHANNELS = 129  # 64 control latents + 1 keep mask + 64 inpaint latents
LATENT_CHANNELS = 64

_serials = itertools.count(1)


class FunControlNet(torch.nn.Module):
    def __init__(self, num_blocks: int, inner_dim: int, head_dim: int, mlp_ratio: int, eps: float = 1e-6,
                 name: str = "Fun ControlNet"):
        super().__init__()
        self.name = name
        self.control_img_in = torch.nn.Linear(CONTROL_CHANNELS, inner_dim)
        self.blocks = torch.nn.ModuleList(
            QwenImage21TransformerBlock(inner_dim, inner_dim // head_dim, head_dim, mlp_ratio=mlp_ratio, eps=eps)
            for _ in range(num_blocks))
        self.before_proj = torch.nn.Linear(inner_dim, inner_dim)
        self.after_proj = torch.nn.ModuleList(torch.nn.Linear(inner_dim, inner_dim) for _ in range(num_blocks))
        # Names this set of weights in graph keys (an id() could be reused by another net after this one is freed).
        self.serial = next(_serials)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def inner_dim(self) -> int:
        return self.control_img_in.out_features

    @property
    def head_dim(self) -> int:
        return self.blocks[0].attn.inner_dim // self.blocks[0].attn.heads

    def injection_layers(self, num_base_blocks: int) -> list[int]:
        """The base block each control block's output is added after."""
        return list(range(0, num_base_blocks, num_base_blocks // self.num_blocks))[: self.num_blocks]

    def check_base(self, transformer) -> None:
        """Refuse a base model this net was not made for, naming both sizes."""
        from ..errors import InputError

        config = transformer.config
        width = config.num_attention_heads * config.attention_head_dim
        base_blocks = len(transformer.transformer_blocks)
        if width != self.inner_dim or config.attention_head_dim != self.head_dim:
            raise InputError("controlnet", f"{self.name} (width {self.inner_dim}, head size {self.head_dim})",
                             f"a Fun ControlNet for this model (width {width}, head size {config.attention_head_dim})")
        if base_blocks % self.num_blocks:
            raise InputError("controlnet", f"{self.name} ({self.num_blocks} control blocks)",
                             f"a control block count that divides the model's {base_blocks} blocks")

    def placed(self, device: torch.device, dtype: torch.dtype) -> "FunControlNet":
        """This net on the model's device and dtype (moved in place the first time)."""
        param = self.control_img_in.weight
        if param.device != device or param.dtype != dtype:
            self.to(device=device, dtype=dtype)
        return self

    def weights_key(self) -> tuple:
        """What a captured graph that runs this net depends on: which net, and where its weights are."""
        return ("fun-control", self.serial, self.num_blocks, tuple(p.data_ptr() for p in self.parameters()))
