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
from ..quantized import block_formats
from ..quantized.comfy_quant import (
    FLOAT8_FORMATS, INPUT_SCALE, RECORD, SCALE, WEIGHT, check_scale, sidecar_keys, weight_shape,
)
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
    # {format: the file's layers of it}, for the formats always dequantized at load (FP8, NVFP4, MXFP8, W4A16/AWQ:
    # there is no path from a file's layer of these to our int8 or FP8 layers)
    at_load: dict[str, int] = field(default_factory=dict)


def unquantized_shapes(shapes: Mapping[str, tuple], layers: Mapping[str, LayerQuant]) -> dict[str, tuple]:
    """The header without the records and scales, and a packed weight at its float shape: the shapes the model's own
    state dict must match."""
    sidecars = {k for layer in layers.values() for k in sidecar_keys(layer, shapes)}
    out = {k: tuple(v) for k, v in shapes.items() if k not in sidecars}
    for prefix, layer in layers.items():
        if prefix + WEIGHT in out:
            out[prefix + WEIGHT] = weight_shape(layer, out[prefix + WEIGHT])
    return out


def meta_weights(shapes: Mapping[str, tuple], layers: Mapping[str, LayerQuant], keep=lambda key: True):
    """`unquantized_shapes` as meta tensors, for the key maps and config inference (no data read)."""
    return {k: torch.empty(v, device="meta") for k, v in unquantized_shapes(shapes, layers).items() if keep(k)}


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
    int8 = {p: layer for p, layer in layers.items() if not layer.dequantized_at_load}
    for name, tensor in iter_tensors(source.files, device=device, names=[p + SCALE for p in int8]):
        check_scale(tensor, source.path, name, expected)
        scales[name[: -len(SCALE)]] = tensor
    sidecars = {k for layer in layers.values() for k in sidecar_keys(layer, source.header.tensors)}
    wanted = [k for k in source.header.tensors if k not in sidecars and not k.endswith((RECORD, SCALE)) and keep(k)]
    # Not owned as read: each tensor is cast, dequantized or copied out of the file's map below, once.
    for name, tensor in iter_tensors(source.files, device=device, names=wanted, own=False):
        layer = layers.get(name[: -len(WEIGHT)]) if name.endswith(WEIGHT) else None
        if layer is None:
            cast = tensor.is_floating_point() and tensor.dtype != dtype
            loaded.tensors.update(key_map({name: tensor.to(dtype) if cast else owned(tensor)}))
            continue
        if layer.dequantized_at_load:
            # dequantized whole under the file's name, then mapped: a map that splits rows (the fused gate_up) must
            # not split a packed weight from block scales laid out another way
            at = dequantize_device or tensor.device
            weight = _dequantize_at_load(source, layer, tensor.to(at), dtype, expected)
            loaded.tensors.update(key_map({name: weight.to(tensor.device)}))
            loaded.at_load[layer.format] = loaded.at_load.get(layer.format, 0) + 1
            loaded.dequantized += 1
            continue
        scale = per_row_scale(scales.pop(layer.prefix), tensor.shape[0])
        parts, part_scales = key_map({name: tensor}), key_map({name: scale})
        for key, q in parts.items():
            module_name = key[: -len(WEIGHT)]
            if mode != DEQUANTIZE and not layer.full_precision and keep_int8(module_name):
                loaded.int8_layers[module_name] = (owned(q), part_scales[key], layer)
                continue
            at = dequantize_device or q.device
            weight = dequantize_weight(q.to(at), part_scales[key].to(at), layer.group_size, layer.convrot, dtype)
            loaded.tensors[key] = weight.to(q.device)
            loaded.dequantized += 1
    for fmt, count in sorted(loaded.at_load.items()):
        # the same line ComfyUI users know from FP8 files, for each format the file holds
        label = "FP8" if fmt in FLOAT8_FORMATS else block_formats.LABELS[fmt]
        logger.info("KV-Graph: %s: %d %s layers dequantized to %s at load (the precision then treats them as a float "
                    "file's weights: `auto` makes them int8 where our INT8 GEMM runs, else they stay %s)",
                    source.path, count, label, str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
    return loaded


def _dequantize_at_load(source, layer: LayerQuant, weight: torch.Tensor, dtype: torch.dtype, expected):
    """One FP8 / block-format layer as a float weight of `dtype`, on the weight's device; its sidecars are read here
    (a few per layer), and scales that are not finite or all zero raise a CheckpointError naming the key."""
    if layer.is_float8:
        names = {"scale": layer.prefix + SCALE}
    else:
        names = block_formats.sidecars(layer.format, layer.prefix, source.header.tensors)
    parts = {}
    for name, tensor in iter_tensors(source.files, device=weight.device, names=list(names.values())):
        role = next(r for r, key in names.items() if key == name)
        # the scales (not AWQ's zero points, which may all be 0); fp8 / e8m0 block scales are checked by the result
        if role in ("scale", "scale_2") and tensor.is_floating_point() and tensor.element_size() > 1:
            check_scale(tensor, source.path, name, expected)
        parts[role] = tensor
    if layer.is_float8:
        return (weight.float() * per_row_scale(parts["scale"], weight.shape[0]).float()).to(dtype)
    out = block_formats.dequantize(layer.format, weight, parts, layer.group_size, dtype)
    if not bool(torch.isfinite(out).all()):
        raise CheckpointError(source.path, f"dequantizes {layer.prefix + WEIGHT} ({layer.format}) to NaN or infinite "
                                           "values: a damaged file.", expected)
    return out


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
