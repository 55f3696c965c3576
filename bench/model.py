"""The full-size Qwen-Image-2.1 transformer with random weights, built directly on the GPU (no download)."""

from __future__ import annotations

import copy

import torch
from diffusers import QwenImage21Transformer2DModel

from graph_runtime.tiny import TINY_TRANSFORMER


def build_transformer(tiny: bool = False, layers: int = 32, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    torch.manual_seed(seed)
    config = dict(TINY_TRANSFORMER) if tiny else {"num_layers": layers}
    with torch.device(device):
        model = QwenImage21Transformer2DModel(**config).to(dtype).eval()
    # Default init leaves the zero-centred norms at zero; small normal weights keep activations finite and
    # non-trivial through 32 blocks, as in the anchor measurements.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.requires_grad_(False)
    return model


def fp32_copy(model):
    """An fp32 copy of exactly the same (bf16-representable) weights: the quality reference."""
    model32 = copy.deepcopy(model).float()
    model32.requires_grad_(False)
    return model32
