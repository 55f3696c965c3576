"""Load the Qwen-Image-2.1 transformer from a diffusers folder or a ComfyUI / diffusers single file, bf16 or INT8
ConvRot (`qwen_image_2.1_int8_convrot.safetensors`, `qwen_image_2.1_turbo_int8_convrot.safetensors`)."""

from __future__ import annotations

import os

import torch

from ..errors import CheckpointError, shorten
from ..quantized import KEEP_INT8, check_mode, read_layers
from .assemble import assign_weights, build_empty, check_against_model, check_fits, finish
from .checks import require_kind
from .comfy_layout import transformer_comfy_key, transformer_from_comfy_state_dict
from .config_infer import check_config_values, config_values, infer_transformer_config
from .detect import QWEN21_TRANSFORMER
from .gguf_files import is_gguf
from .int8_files import install_int8_layers, meta_weights, read_weights, unquantized_shapes
from .sources import resolve

BF16_FILE = "qwen_image_2.1_bf16.safetensors"
INT8_FILE = "qwen_image_2.1_int8_convrot.safetensors"
EXPECTED = (f"a Qwen-Image-2.1 transformer: ComfyUI's models/diffusion_models/{INT8_FILE} or {BF16_FILE} (or their "
            "Turbo twins), a ComfyUI-GGUF qwen_image21 .gguf file, a diffusers pipeline folder (with transformer/), "
            "or a diffusers transformer/ folder")
CLASS_NAME = "QwenImage21Transformer2DModel"
BLOCKS = "transformer_blocks."


def _check_folder_config(source) -> None:
    name = source.config.get("_class_name")
    if name and name != CLASS_NAME:
        what = "a Qwen-Image 1.x transformer" if name == "QwenImageTransformer2DModel" else f"a {name}"
        raise CheckpointError(source.path, f"is {what} folder (config.json _class_name), not {CLASS_NAME}.", EXPECTED)


def _check_config_against_weights(source, config: dict, shapes, file_key) -> None:
    """config.json against the weights beside it (`check_config_values`): every value the shapes determine, and the
    rotary axes, which no shape tells, must split the head width."""
    from diffusers import QwenImage21Transformer2DModel

    where = source.path / "config.json"
    inferred = infer_transformer_config(shapes, source.path, EXPECTED, file_key)
    given = config_values(config, QwenImage21Transformer2DModel, inferred, none_means={"out_channels": "in_channels"})
    check_config_values(where, given, {k: v for k, v in inferred.items() if k != "axes_dims_rope"}, EXPECTED)
    axes, head_dim = given["axes_dims_rope"], inferred["attention_head_dim"]
    if (not isinstance(axes, (list, tuple)) or len(axes) != 3
            or not all(isinstance(a, int) and not isinstance(a, bool) and a > 0 and a % 2 == 0 for a in axes)
            or sum(axes) != head_dim):
        raise CheckpointError(where, f"says axes_dims_rope={shorten(repr(axes))}: expected three positive even "
                                     f"numbers adding up to the attention head width {head_dim} (the rotary "
                                     "embedding's frame, height and width axes).", EXPECTED)


def keeps_int8(module_name: str) -> bool:
    """In int8 mode the 32 blocks' Linear layers (99% of the weights) run int8. A quantized layer outside them (the
    timestep and text embedders, the shared modulation, the output head) is dequantized at load: each runs on a
    handful of rows per step, and the runtime reads the model's compute dtype off its first parameter, the
    timestep embedder's."""
    return module_name.startswith(BLOCKS)


def transformer_is_quantized(path: str | os.PathLike) -> bool:
    """Whether the transformer checkpoint at `path` holds INT8 ConvRot layers; reads headers and records only, and
    a missing or broken file raises the CheckpointError its load would. A GGUF file loads as float weights."""
    if is_gguf(path):
        return False
    source = resolve(path, "transformer", EXPECTED)
    if source.info.quantized is None:
        return False
    # FP8 and block-format layers are dequantized at load: only int8 ones make it an INT8 file
    return any(not layer.dequantized_at_load for layer in read_layers(source.files, source.header, EXPECTED).values())


def load_transformer(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu", quantized: str = KEEP_INT8, dequantize_device=None,
                     gguf_int8_on=None):
    """Load `diffusers.QwenImage21Transformer2DModel` in eval mode, gradients off.

    `path`: a diffusers pipeline folder (its transformer/ is used), a transformer/ folder, or one .safetensors file in
    ComfyUI's layout (optional `model.diffusion_model.` prefix, fused `img_mlp.gate_up`) or diffusers' key names. A
    folder's config.json is used as is; a single file's config is inferred from its tensor shapes. Weights are read
    one tensor at a time, cast to `dtype` and placed on `device`; the model is never materialised twice.

    `quantized` says how an INT8 ConvRot file runs (a float file loads the same either way): "int8" keeps the
    blocks' weights int8 (ConvRotInt8Linear: half the memory, W8A8 through comfy-kitchen); "dequantize" expands
    every quantized layer once, on `dequantize_device` (default: `device`), into ordinary `dtype` weights.

    A `.gguf` file (ComfyUI-GGUF's `qwen_image21` layout) is dequantized at load into ordinary `dtype` weights; with
    `gguf_int8_on` (a device) the blocks' Linears become INT8 ConvRot block by block as they are read.
    """
    from diffusers import QwenImage21Transformer2DModel

    check_mode(quantized)
    if is_gguf(path):  # dequantized at load into `dtype` weights (gguf_transformer.py)
        from .gguf_transformer import load_gguf_transformer

        return load_gguf_transformer(path, dtype, device, EXPECTED, gguf_int8_on, dequantize_device)
    source = resolve(path, "transformer", EXPECTED)
    if source.config is not None:
        _check_folder_config(source)
    require_kind(source, QWEN21_TRANSFORMER, EXPECTED, BF16_FILE, quantized_ok=True)
    layers = read_layers(source.files, source.header, EXPECTED)

    file_shapes = unquantized_shapes(source.header.shapes, layers)
    mapped_shapes = {k: tuple(v.shape) for k, v in
                     transformer_from_comfy_state_dict(meta_weights(source.header.shapes, layers)).items()}
    # errors about a ComfyUI file name its own keys (prefixed, gate_up fused)
    prefix = source.info.prefix
    file_key = (lambda k: transformer_comfy_key(k, prefix)) if source.info.layout == "comfyui" else (lambda k: k)
    if source.config is not None:
        config = dict(source.config)
        _check_config_against_weights(source, config, mapped_shapes, file_key)
    else:
        config = infer_transformer_config(mapped_shapes, source.path, EXPECTED, file_key)
    model = build_empty(lambda: QwenImage21Transformer2DModel.from_config(config))
    check_against_model(model, mapped_shapes, source.path, EXPECTED, file_key=file_key, file_shapes=file_shapes)

    check_fits(source.path, source.header, dtype, device, EXPECTED)

    loaded = read_weights(source, layers, transformer_from_comfy_state_dict, dtype, device, quantized, keeps_int8,
                          dequantize_device, EXPECTED)
    install_int8_layers(model, loaded.int8_layers, source.path, EXPECTED, file_key, dtype)
    assign_weights(model, loaded.tensors)
    del loaded
    return finish(model, source.path, EXPECTED, device)
