"""A tiny random LoRA for the tiny transformer (`graph_runtime.tiny`), in ComfyUI's key layout.

`make-tiny --comfyui-models` writes it into `models/loras/` under the name the LoRA example workflow loads, so that
example runs as shipped on the tiny files: kohya pairs with an alpha under `diffusion_model.`, on every Linear of
every block under diffusers' names (the MLP's gate and up projections apart, as kohya-style trainers write them), so
core's LoRA loaders map every key of it onto the KV-Graph MODEL too. Its changes are about as large as the weights
themselves, so an image made with it differs visibly from one made without.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..tiny import TINY_TRANSFORMER

# The file the LoRA example workflow names in models/loras (a stand-in: users pick their own LoRA there).
EXAMPLE_LORA_FILE = "qwen_image_2.1_lora.safetensors"
BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
                 "img_mlp.out")


def tiny_lora_tensors(seed: int = 0, rank: int = 4, alpha: float = 2.0, std: float = 0.3) -> dict[str, torch.Tensor]:
    config = TINY_TRANSFORMER
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = hidden * config["mlp_ratio"]
    shapes = {"img_mlp.gate_layer": (mlp, hidden), "img_mlp.proj": (mlp, hidden), "img_mlp.out": (hidden, mlp)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for block in range(config["num_layers"]):
        for name in BLOCK_LINEARS:
            rows, cols = shapes.get(name, (hidden, hidden))
            stem = f"diffusion_model.transformer_blocks.{block}.{name}"
            tensors[f"{stem}.lora_down.weight"] = torch.randn(rank, cols, generator=generator) * std
            tensors[f"{stem}.lora_up.weight"] = torch.randn(rows, rank, generator=generator) * std
            tensors[f"{stem}.alpha"] = torch.tensor(alpha)
    return tensors


def write_tiny_lora(path: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in tiny_lora_tensors(seed).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def comfyui_lora_path(models_dir: str | os.PathLike) -> Path:
    """Where `make-tiny --comfyui-models MODELS_DIR` writes the tiny LoRA: the LoRA example's file in models/loras."""
    return Path(models_dir) / "loras" / EXAMPLE_LORA_FILE
