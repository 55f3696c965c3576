"""The tiny transformer as a ComfyUI "fp8 scaled" single file: each block Linear an e4m3 weight with a `.weight_scale`
(one fp32 value for the tensor, as ComfyUI writes them) and a `{"format": "float8_e4m3fn"}` record; everything else
bf16. For the loaders' tests of ComfyUI's FP8 records."""

from __future__ import annotations

import json
import os

import torch

E4M3_MAX = 448.0


def fp8_record() -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode("utf-8")), dtype=torch.uint8)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scalar scale): weight / scale rounded to e4m3, the tensor's amax mapped to 448."""
    scale = (weight.detach().float().abs().amax() / E4M3_MAX).clamp(min=1e-12)
    return (weight.detach().float() / scale).to(torch.float8_e4m3fn), scale.reshape(())


def write_fp8_scaled_transformer(state_dict, path: str | os.PathLike, input_scales: bool = True):
    """Write a diffusers-named transformer state dict as an fp8-scaled ComfyUI file (with `.input_scale` tensors as
    ComfyUI's files carry them, unless `input_scales` is False): the blocks' Linears in FP8."""
    from .loading.comfy_layout import transformer_to_comfy_state_dict

    return write_fp8_scaled(transformer_to_comfy_state_dict(state_dict), path,
                            lambda key: ".transformer_blocks." in key, input_scales)


def fp8_layer(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """{key suffix: tensor} of one FP8 scaled layer."""
    q, scale = quantize_fp8(weight)
    return {".weight": q, ".weight_scale": scale, ".comfy_quant": fp8_record()}


def write_fp8_scaled(comfy_state_dict, path: str | os.PathLike, select, input_scales: bool = True, layer=fp8_layer):
    """A state dict in a ComfyUI file's names -> a mixed-precision file: each 2-D `.weight` whose key `select` takes
    becomes the tensors `layer(weight)` gives ({suffix: tensor}: FP8 with its scale and record by default), the rest
    bf16."""
    from pathlib import Path

    from .tiny import save_safetensors

    out = {}
    for key, value in comfy_state_dict.items():
        if key.endswith(".weight") and select(key) and value.dim() == 2:
            prefix = key[: -len(".weight")]
            out.update({prefix + suffix: t for suffix, t in layer(value).items()})
            if input_scales:
                out[prefix + ".input_scale"] = torch.ones((), dtype=torch.float32)
        else:
            out[key] = value.detach().to(torch.bfloat16).contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(out, path)
    return path
