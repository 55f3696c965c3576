"""Load the Qwen-Image-2.1 transformer from a diffusers folder or a ComfyUI / diffusers single file."""

from __future__ import annotations

import os

import torch

from ..errors import CheckpointError
from .assemble import assign_weights, build_empty, check_against_model, finish
from .checks import require_kind
from .comfy_layout import transformer_comfy_key, transformer_from_comfy_state_dict
from .config_infer import infer_transformer_config
from .detect import QWEN21_TRANSFORMER
from .safetensors_file import iter_tensors
from .sources import resolve

BF16_FILE = "qwen_image_2.1_bf16.safetensors"
EXPECTED = (f"a Qwen-Image-2.1 transformer: ComfyUI's models/diffusion_models/{BF16_FILE}, a diffusers pipeline "
            "folder (with transformer/), or a diffusers transformer/ folder")
CLASS_NAME = "QwenImage21Transformer2DModel"


def _check_folder_config(source) -> None:
    name = source.config.get("_class_name")
    if name and name != CLASS_NAME:
        what = "a Qwen-Image 1.x transformer" if name == "QwenImageTransformer2DModel" else f"a {name}"
        raise CheckpointError(source.path, f"is {what} folder (config.json _class_name), not {CLASS_NAME}.", EXPECTED)


def load_transformer(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu"):
    """Load `diffusers.QwenImage21Transformer2DModel` in eval mode, gradients off.

    `path`: a diffusers pipeline folder (its transformer/ is used), a transformer/ folder, or one .safetensors file in
    ComfyUI's layout (optional `model.diffusion_model.` prefix, fused `img_mlp.gate_up`) or diffusers' key names. A
    folder's config.json is used as is; a single file's config is inferred from its tensor shapes. Weights are read
    one tensor at a time, cast to `dtype` and placed on `device`; the model is never materialised twice.
    """
    from diffusers import QwenImage21Transformer2DModel

    source = resolve(path, "transformer", EXPECTED)
    if source.config is not None:
        _check_folder_config(source)
    require_kind(source, QWEN21_TRANSFORMER, EXPECTED, BF16_FILE)

    mapped_shapes = {k: tuple(v.shape) for k, v in
                     transformer_from_comfy_state_dict(source.header.meta_state_dict()).items()}
    # errors about a ComfyUI file name its own keys (prefixed, gate_up fused)
    prefix = source.info.prefix
    file_key = (lambda k: transformer_comfy_key(k, prefix)) if source.info.layout == "comfyui" else (lambda k: k)
    if source.config is not None:
        config = dict(source.config)
    else:
        config = infer_transformer_config(mapped_shapes, source.path, EXPECTED, file_key)
    model = build_empty(lambda: QwenImage21Transformer2DModel.from_config(config))
    check_against_model(model, mapped_shapes, source.path, EXPECTED, file_key=file_key,
                        file_shapes=source.header.shapes)

    tensors = dict(iter_tensors(source.files, dtype=dtype, device=device))
    assign_weights(model, transformer_from_comfy_state_dict(tensors))
    del tensors
    return finish(model, source.path, EXPECTED, device)
