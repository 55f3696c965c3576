"""Load ComfyUI's INT8 ConvRot files (`*_int8_convrot.safetensors`) through the same loaders as the bf16 files.

A quantized layer's int8 weight and its per-row scales travel through the component's key map together (the scale
under the weight's name), so a map that renames a key renames both and one that splits rows (the DiT's fused
`img_mlp.gate_up` -> `gate_layer` / `proj`) splits both the same way: the rotation runs along the input dimension,
so rows stay independent and the split is exact. Then, per layer:

- `int8` mode: the layer becomes a ConvRotInt8Linear / ConvRotInt8Embedding holding the file's tensors as they are;
- `dequantize` mode, a layer the component keeps in float (`keep_int8` False) or a record asking for full precision:
  comfy-kitchen dequantizes it once into an ordinary weight of the loader's dtype.

Tensors are read one at a time (scales first: they are a few MB); nothing is held twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ..errors import CheckpointError
from ..quantized import (
    DEQUANTIZE, ConvRotInt8Embedding, ConvRotInt8Linear, LayerQuant, dequantize_weight, read_layers,
)
from ..quantized.comfy_quant import INPUT_SCALE, RECORD, SCALE, WEIGHT, check_scale
from ..quantized.int8_convrot import per_row_scale
from ..safetensors_file import iter_tensors, owned

logger = logging.getLogger(__name__)
KeyMap = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class LoadedWeights:
    """What a checkpoint gives the model: float tensors by model key, and int8 layers by model module name."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    int8_layers: dict[str, tuple[torch.Tensor, torch.Tensor, LayerQuant]] = field(default_factory=dict)
    dequantized: int = 0  # quantized layers turned into float weights
    float8: int = 0  # the file's FP8 layers (always dequantized: there is no FP8 weight path from a file)


def unquantized_shapes(shapes: Mapping[str, tuple], layers: Mapping[str, LayerQuant]) -> dict[str, tuple]:
    """The header without the records and scales: the shapes the model's own state dict must match."""
    sidecars = {p + suffix for p in layers for suffix in (RECORD, SCALE, INPUT_SCALE)}
    return {k: v for k, v in shapes.items() if k not in sidecars}


def read_weights(source, layers: Mapping[str, LayerQuant], key_map: KeyMap, dtype: torch.dtype, device,
                 mode: str, keep_int8: Callable[[str], bool] = lambda name: True,
                 dequantize_device=None, expected: str | None = None,
                 keep: Callable[[str], bool] = lambda key: True) -> LoadedWeights:
    """Stream `source`'s tensors into model keys. Float tensors are cast to `dtype`; quantized layers stay int8 or
    are dequantized as the module docstring says. `dequantize_device`: where comfy-kitchen dequantizes (a GPU
    does it in a fraction of the CPU's time); the result goes to `device`. Scales that are all zero or not finite
    raise a CheckpointError naming the file and the key (with `expected`). `keep(file key)`: the tensors to read
    (default all; a GGUF text encoder takes only the vision tower from its safetensors file)."""
    loaded = LoadedWeights()
    scales = {}
    layers = {p: layer for p, layer in layers.items() if keep(p + WEIGHT)}
    for name, tensor in iter_tensors(source.files, device=device, names=[p + SCALE for p in layers]):
        check_scale(tensor, source.path, name, expected)
        scales[name[: -len(SCALE)]] = tensor
    wanted = [k for k in source.header.tensors if not k.endswith((RECORD, SCALE)) and keep(k)
              and not (k.endswith(INPUT_SCALE) and k[: -len(INPUT_SCALE)] in layers)]
    # Not owned as read: each tensor is cast, dequantized or copied out of the file's map below, once.
    for name, tensor in iter_tensors(source.files, device=device, names=wanted, own=False):
        layer = layers.get(name[: -len(WEIGHT)]) if name.endswith(WEIGHT) else None
        if layer is None:
            cast = tensor.is_floating_point() and tensor.dtype != dtype
            loaded.tensors.update(key_map({name: tensor.to(dtype) if cast else owned(tensor)}))
            continue
        scale = per_row_scale(scales.pop(layer.prefix), tensor.shape[0])
        parts, part_scales = key_map({name: tensor}), key_map({name: scale})
        loaded.float8 += layer.is_float8  # per layer of the file (a fused gate_up is one)
        for key, q in parts.items():
            module_name = key[: -len(WEIGHT)]
            if layer.is_float8:
                at = dequantize_device or q.device
                weight = q.to(at).float() * part_scales[key].to(at)
                loaded.tensors[key] = weight.to(dtype).to(q.device)
                loaded.dequantized += 1
                continue
            if mode != DEQUANTIZE and not layer.full_precision and keep_int8(module_name):
                loaded.int8_layers[module_name] = (owned(q), part_scales[key], layer)
                continue
            at = dequantize_device or q.device
            weight = dequantize_weight(q.to(at), part_scales[key].to(at), layer.group_size, layer.convrot, dtype)
            loaded.tensors[key] = weight.to(q.device)
            loaded.dequantized += 1
    if loaded.float8:
        logger.info("KV-Graph: %s: %d FP8 layers dequantized to %s at load (the precision then treats them as a float "
                    "file's weights)", source.path, loaded.float8, str(dtype).removeprefix("torch."))
    return loaded


def install_int8_layers(model: torch.nn.Module, int8_layers, path, expected: str,
                        file_key: Callable[[str], str] = lambda key: key, output_dtype=torch.bfloat16) -> None:
    """Swap each named Linear / Embedding of the (empty, meta) model for its int8 layer. A Linear's bias slot is
    kept, so the float bias from the file is assigned to it afterwards like every other tensor."""
    for module_name, (q, scale, layer) in int8_layers.items():
        parent_name, _, child = module_name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, child)
        except AttributeError:
            raise CheckpointError(path, f"quantizes {file_key(module_name + WEIGHT)}, which the model does not "
                                        "have.", expected) from None
        if isinstance(old, torch.nn.Linear):
            new = ConvRotInt8Linear.from_quantized(q, scale, layer.group_size, layer.convrot, bias=old.bias)
        elif isinstance(old, torch.nn.Embedding):
            new = ConvRotInt8Embedding.from_quantized(q, scale, layer.group_size, layer.convrot, old.padding_idx,
                                                      output_dtype)
        else:
            raise CheckpointError(path, f"quantizes {file_key(module_name + WEIGHT)}, a {type(old).__name__}: only "
                                        "Linear and Embedding layers can be int8.", expected)
        setattr(parent, child, new)
