"""A tiny random Fun ControlNet Union for the tiny transformer (`graph_runtime.tiny`), in the released key layout.

`make-tiny --comfyui-models` writes it into `models/model_patches/` under the name the ControlNet examples load, so
they run as shipped on the tiny files. Two control blocks over the tiny model's two blocks (one after each), the MLP
fused as `img_mlp.gate_up` as in the released file; its residuals are about as large as the stream they join, so a
controlled image differs visibly from an uncontrolled one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..tiny import TINY_TRANSFORMER, save_safetensors
from .file import to_file_state_dict
from .model import FunControlNet

EXAMPLE_CONTROLNET_FILE = "qwen_image_2.1_fun_controlnet_union.safetensors"


def random_tiny_controlnet(seed: int = 0, num_blocks: int = 2, config: dict | None = None,
                           scale: float = 1.0) -> FunControlNet:
    """A random net for a transformer of `config` (default the tiny one). `scale` multiplies the projections'
    default initialization (larger: the control changes the output more)."""
    config = config or TINY_TRANSFORMER
    torch.manual_seed(seed)
    width = config["num_attention_heads"] * config["attention_head_dim"]
    net = FunControlNet(num_blocks, width, config["attention_head_dim"], config["mlp_ratio"], config["eps"])
    with torch.no_grad():
        for block in net.blocks:
            block.attn.norm_q.weight.normal_(1.0, 0.1)
            block.attn.norm_k.weight.normal_(1.0, 0.1)
        for linear in (net.control_img_in, net.before_proj, *net.after_proj):
            linear.weight.mul_(scale)
            linear.bias.normal_(0.0, 0.1 * scale)
    return net


def write_tiny_controlnet(path: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in to_file_state_dict(random_tiny_controlnet(seed)).items()}
    save_safetensors(tensors, path)
    return path


def comfyui_controlnet_path(models_dir: str | os.PathLike) -> Path:
    """Where `make-tiny --comfyui-models MODELS_DIR` writes it: the examples' file in models/model_patches."""
    return Path(models_dir) / "model_patches" / EXAMPLE_CONTROLNET_FILE
