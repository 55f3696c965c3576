"""The tiny transformer as ComfyUI mixed-precision files in comfy-kitchen's block formats (W4A16/AWQ, NVFP4, MXFP8),
for the loaders' tests and make-tiny: the blocks' Linears quantized, everything else bf16.

NVFP4 and MXFP8 are quantized by comfy-kitchen's own layouts (`quantize`), so the files hold exactly what its
quantizers write. comfy-kitchen offers no AWQ quantizer (its layout reads calibrated files only); the W4A16 file is
written by plain round-to-nearest into the same layout (`(q - 8) * scale + zero` per group of input features), which
is all a loader test needs: the loader reads the layout, not the calibration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .tiny_fp8 import fp8_layer, write_fp8_scaled

FORMATS = ("float8_e4m3fn", "awq_w4a16", "nvfp4", "mxfp8")
TINY_AWQ_GROUP = 32  # the tiny model's narrowest Linear has 32 inputs (real files use 64)


def _record(fmt: str, **extra) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt, **extra}).encode("utf-8")), dtype=torch.uint8)


def awq_layer(weight: torch.Tensor, group: int = TINY_AWQ_GROUP) -> dict[str, torch.Tensor]:
    """Round-to-nearest W4A16 in comfy-kitchen's AWQ layout: per group of `group` inputs and per output row, the 16
    levels span the group's min..max (scale = range / 15, zero = min + 8 * scale, in bf16 as the files store them)."""
    w = weight.detach().float()
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((groups - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1) + 8).clamp(0, 15)
    q = q.reshape(rows, cols).to(torch.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).view(torch.int8)  # bits 0..3: column 2j, bits 4..7: column 2j+1
    return {".weight": packed, ".weight_scale": scale.t().contiguous(), ".weight_zero": zero.t().contiguous(),
            ".comfy_quant": _record("awq_w4a16", group_size=group)}


def nvfp4_layer(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    from comfy_kitchen.tensor import TensorCoreNVFP4Layout

    q, params = TensorCoreNVFP4Layout.quantize(weight.detach().to(torch.bfloat16))
    return {".weight": q, ".weight_scale": params.block_scale, ".weight_scale_2": params.scale.float(),
            ".comfy_quant": _record("nvfp4")}


def mxfp8_layer(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    from comfy_kitchen.tensor import TensorCoreMXFP8Layout

    q, params = TensorCoreMXFP8Layout.quantize(weight.detach().to(torch.bfloat16))
    return {".weight": q, ".weight_scale": params.scale, ".comfy_quant": _record("mxfp8")}


LAYERS = {"float8_e4m3fn": fp8_layer, "awq_w4a16": awq_layer, "nvfp4": nvfp4_layer, "mxfp8": mxfp8_layer}
FILE_NAMES = {"float8_e4m3fn": "qwen_image_2.1_fp8_scaled.safetensors",
              "awq_w4a16": "qwen_image_2.1_awq_w4a16.safetensors",
              "nvfp4": "qwen_image_2.1_nvfp4.safetensors", "mxfp8": "qwen_image_2.1_mxfp8.safetensors"}


def write_kitchen_transformer(state_dict, path: str | os.PathLike, fmt: str) -> Path:
    """A diffusers-named transformer state dict as a ComfyUI file whose block Linears are `fmt` (one of FORMATS)."""
    from .loading.comfy_layout import transformer_to_comfy_state_dict

    return write_fp8_scaled(transformer_to_comfy_state_dict(state_dict), path,
                            lambda key: ".transformer_blocks." in key, layer=LAYERS[fmt])


def comfyui_kitchen_paths(models_dir: str | os.PathLike) -> dict[str, Path]:
    return {fmt: Path(models_dir) / "diffusion_models" / name for fmt, name in FILE_NAMES.items()}


def write_comfyui_kitchen_files(models_dir: str | os.PathLike, transformer) -> dict[str, Path]:
    """The tiny transformer (a module) in each format, in models_dir/diffusion_models."""
    state_dict = transformer.state_dict()
    paths = comfyui_kitchen_paths(models_dir)
    return {fmt: write_kitchen_transformer(state_dict, path, fmt) for fmt, path in paths.items()}
