"""The two ways to run an int8 file, and turning a float model's Linear layers int8 in place."""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import InputError
from .int8_convrot import ConvRotInt8Linear

# int8: the file's weights as they are (half the memory of bf16, W8A8 GEMMs through comfy-kitchen).
# dequantize: expanded once at load into ordinary Linear weights of the loader's dtype (then the bf16 fast path).
KEEP_INT8 = "int8"
DEQUANTIZE = "dequantize"
QUANTIZED_MODES = (KEEP_INT8, DEQUANTIZE)


def check_mode(mode: str, name: str = "quantized") -> str:
    if mode not in QUANTIZED_MODES:
        raise InputError(name, mode, f"one of {', '.join(QUANTIZED_MODES)} (how an INT8 ConvRot file is run)")
    return mode


def quantize_linears_(model: torch.nn.Module, group_size: int,
                      include: Callable[[str, torch.nn.Linear], bool] = lambda name, linear: True) -> int:
    """Replace every float `nn.Linear` of `model` for which `include(name, linear)` holds by a ConvRotInt8Linear
    quantized from its weight with comfy-kitchen (on the weight's device), in place; returns how many were
    replaced. The benchmark and the GPU tests build int8 models of any width this way, without a file."""
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and include(name, module)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ConvRotInt8Linear.from_linear(linear, group_size))
    return len(targets)


def dequantize_linears_(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace every ConvRotInt8Linear of `model` by an ordinary Linear holding its dequantized weight (in `dtype`,
    default: the layer's bias dtype, else bf16) and its bias, in place; returns how many were replaced. The same
    weights the loaders' dequantize mode gives, for models quantized in memory."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, ConvRotInt8Linear)]
    for name, layer in targets:
        out_dtype = dtype or (layer.bias.dtype if layer.bias is not None else torch.bfloat16)
        linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                 device="meta")
        linear.weight = torch.nn.Parameter(layer.dequantized_weight(out_dtype), requires_grad=False)
        if layer.bias is not None:
            linear.bias = torch.nn.Parameter(layer.bias.detach().to(out_dtype), requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)
    return len(targets)
