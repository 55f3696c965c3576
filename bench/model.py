"""The full-size Qwen-Image-2.1 transformer with random weights, built directly on the GPU (no download), as the
pack's loader builds a loaded one: parameters in the model dtype, buffers as the model computes them (fp32).

A plain `.to(bfloat16)` would also round diffusers' timestep-frequency buffer, moving the timestep embedding by about
14% and a step's output by about 17% from what the same weights compute once loaded: timings would not change, but
every error the benchmark prints would be measured on a model that does not exist."""

from __future__ import annotations

import copy

import torch
from diffusers import QwenImage21Transformer2DModel

from graph_runtime.tiny import TINY_TRANSFORMER


def build_transformer(tiny: bool = False, layers: int = 32, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    torch.manual_seed(seed)
    config = dict(TINY_TRANSFORMER) if tiny else {"num_layers": layers}
    with torch.device(device):
        model = QwenImage21Transformer2DModel(**config)
    cast_parameters(model, dtype)
    model.eval()
    # Default init leaves the zero-centred norms at zero; small normal weights keep activations finite and
    # non-trivial through 32 blocks, as in the anchor measurements.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.requires_grad_(False)
    return model


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters to `dtype` in place; buffers keep their dtype (the loader reads weights in `dtype` and builds the
    buffers in `__init__`, fp32, graph_runtime/loading/assemble.py)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=False)


def fp32_copy(model):
    """An fp32 copy of exactly the same (bf16-representable) weights: the quality reference."""
    model32 = copy.deepcopy(model).float()
    model32.requires_grad_(False)
    return model32
