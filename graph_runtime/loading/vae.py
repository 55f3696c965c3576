"""Load the Qwen-Image-2.1 VAE from a diffusers folder or ComfyUI's single file."""

from __future__ import annotations

import os

import torch

from ..errors import CheckpointError, shorten
from .assemble import assign_weights, build_empty, check_against_model, check_fits, finish
from .checks import require_kind
from .comfy_layout import vae_comfy_key_namer, vae_from_comfy_state_dict
from .config_infer import check_config_values, config_values, infer_vae_config
from .detect import QWEN21_VAE
from ..safetensors_file import iter_tensors
from .sources import resolve

BF16_FILE = "qwen_image_2.1_vae_bf16.safetensors"
EXPECTED = (f"the Qwen-Image-2.1 VAE (64 latent channels, 16x): ComfyUI's models/vae/{BF16_FILE}, a diffusers "
            "pipeline folder (with vae/), or a diffusers vae/ folder")
CLASS_NAME = "AutoencoderKLQwenImage21"
_OTHER_VAE_CLASSES = {
    "AutoencoderKLQwenImage": "the Qwen-Image 1.x VAE (16 latent channels)",
    "AutoencoderKLWan": "a Wan VAE",
    "AutoencoderKL": "a Stable Diffusion / FLUX-style VAE",
}


def _check_folder_config(source) -> None:
    name = source.config.get("_class_name")
    if name and name != CLASS_NAME:
        what = _OTHER_VAE_CLASSES.get(name, f"a {name}")
        raise CheckpointError(source.path, f"is {what} folder (config.json _class_name), not {CLASS_NAME}.", EXPECTED)


# The config values the weights' shapes determine (the others, like latents statistics, are not weights).
_SIZED_BY_WEIGHTS = ("base_dim", "decoder_base_dim", "z_dim", "dim_mult", "num_res_blocks", "in_channels",
                     "out_channels")


def _check_config_against_weights(source, config: dict, shapes, file_key) -> None:
    """config.json against the weights beside it (`check_config_values`), and its latents statistics, one per latent
    channel."""
    from diffusers import AutoencoderKLQwenImage21

    where = source.path / "config.json"
    inferred = infer_vae_config(shapes, source.path, EXPECTED, file_key)
    given = config_values(config, AutoencoderKLQwenImage21, [*_SIZED_BY_WEIGHTS, "latents_mean", "latents_std"],
                          none_means={"decoder_base_dim": "base_dim"})
    check_config_values(where, given, {key: inferred[key] for key in _SIZED_BY_WEIGHTS}, EXPECTED)
    for key in ("latents_mean", "latents_std"):
        value = given[key]
        if not isinstance(value, (list, tuple)) or len(value) != inferred["z_dim"]:
            raise CheckpointError(where, f"says {key}={shorten(repr(value))}: expected a list of {inferred['z_dim']} "
                                         "numbers, one per latent channel of the weights beside it.", EXPECTED)


def load_vae(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
    """Load `diffusers.AutoencoderKLQwenImage21` in eval mode, gradients off.

    `path`: a diffusers pipeline folder (its vae/ is used), a vae/ folder, or one .safetensors file: ComfyUI's
    `qwen_image_2.1_vae_bf16.safetensors` (Wan-2.2-style layout, temporal-kernel-1 Conv3d weights) or diffusers'
    key names. A single file's config is inferred from its shapes (latents_mean/std: the class defaults).
    """
    from diffusers import AutoencoderKLQwenImage21

    source = resolve(path, "vae", EXPECTED)
    if source.config is not None:
        _check_folder_config(source)
    require_kind(source, QWEN21_VAE, EXPECTED, BF16_FILE)

    mapped_shapes = {k: tuple(v.shape) for k, v in vae_from_comfy_state_dict(source.header.meta_state_dict()).items()}
    # errors about a ComfyUI file name its own keys; before the model exists the file's keys place the resamplers
    comfy = source.info.layout == "comfyui"
    file_key = vae_comfy_key_namer(mapped_shapes) if comfy else (lambda k: k)
    if source.config is not None:
        config = dict(source.config)
        _check_config_against_weights(source, config, mapped_shapes, file_key)
    else:
        config = infer_vae_config(mapped_shapes, source.path, EXPECTED, file_key)
    model = build_empty(lambda: AutoencoderKLQwenImage21.from_config(config))
    if comfy:
        file_key = vae_comfy_key_namer(model.state_dict().keys())
    check_against_model(model, mapped_shapes, source.path, EXPECTED, file_key=file_key,
                        file_shapes=source.header.shapes)

    check_fits(source.path, source.header, dtype, device, EXPECTED)

    tensors = dict(iter_tensors(source.files, dtype=dtype, device=device))
    assign_weights(model, vae_from_comfy_state_dict(tensors))
    del tensors
    return finish(model, source.path, EXPECTED, device)
