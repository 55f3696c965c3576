"""ComfyUI's single-file key layouts <-> the diffusers / transformers key names, in both directions.

The forward maps (`*_from_comfy_state_dict`) turn a ComfyUI file into the state dict of the diffusers/transformers
class; the reverse maps (`*_to_comfy_state_dict`) are what `graph_runtime.tiny.write_comfyui_files` uses to write the
tiny model the way ComfyUI's repackaged files are laid out. Forward(reverse(sd)) == sd exactly (tests check it).
Everything here is pure key/tensor shuffling: it works the same on real tensors and on `meta` tensors, which is how
the loaders infer a config from a header before reading any data. Where each layout comes from: docs/checkpoints.md.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import torch

COMFY_DIFFUSION_PREFIX = "model.diffusion_model."


# --------------------------------------------------------------------------------------------------- transformer


def transformer_from_comfy_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI (`model.diffusion_model.` prefix optional, `img_mlp.gate_up` fused) -> diffusers names.

    A file already in diffusers' names passes through unchanged."""
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers

    # The diffusers converter pops from its argument; hand it a shallow copy so the caller's dict survives.
    return convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(state_dict))


def transformer_comfy_key(key: str, prefix: str = COMFY_DIFFUSION_PREFIX) -> str:
    """The ComfyUI name of a diffusers key, for error messages about a ComfyUI file."""
    for split in ("img_mlp.gate_layer.", "img_mlp.proj."):
        key = key.replace(split, "img_mlp.gate_up.")
    return prefix + key


def transformer_to_comfy_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers names -> ComfyUI's: `model.diffusion_model.` prefix, gate_layer and proj fused as gate_up with the
    gate rows first (what ComfyUI's SwiGLUFeedForward splits as `gate, up`)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith("img_mlp.proj.weight"):
            continue  # emitted together with its gate below
        if key.endswith("img_mlp.gate_layer.weight"):
            up = state_dict[key[: -len("gate_layer.weight")] + "proj.weight"]
            out[COMFY_DIFFUSION_PREFIX + key.replace("gate_layer", "gate_up")] = torch.cat([value, up], dim=0)
        else:
            out[COMFY_DIFFUSION_PREFIX + key] = value
    return out


# ----------------------------------------------------------------------------------------------------------- VAE
# ComfyUI builds this VAE as comfy.ldm.wan.vae2_2.WanVAE(temporal_kernel=1): nn.Sequential containers, so blocks are
# addressed by position. Inside a ResidualBlock's `residual` Sequential: 0 RMS_norm, 1 SiLU, 2 conv, 3 RMS_norm,
# 4 SiLU, 5 Dropout, 6 conv. diffusers' AutoencoderKLQwenImage21 names the same modules.

_RESNET_FROM_COMFY = {
    "residual.0.gamma": "norm1.gamma",
    "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
    "residual.3.gamma": "norm2.gamma",
    "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
    "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias",
}
_RESNET_TO_COMFY = {v: k for k, v in _RESNET_FROM_COMFY.items()}

_TOP_FROM_COMFY = {"conv1.": "quant_conv.", "conv2.": "post_quant_conv."}
_SIDE_FROM_COMFY = {"conv1.": "conv_in.", "head.0.": "norm_out.", "head.2.": "conv_out."}
_MIDDLE_FROM_COMFY = {"0": "resnets.0", "1": "attentions.0", "2": "resnets.1"}

_COMFY_BLOCK = re.compile(r"^(encoder|decoder)\.(downsamples|upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\.(.+)$")
_COMFY_MIDDLE = re.compile(r"^(encoder|decoder)\.middle\.(\d+)\.(.+)$")
_DIFFUSERS_BLOCK = re.compile(r"^(encoder|decoder)\.(down_blocks|up_blocks)\.(\d+)\.(resnets\.(\d+)|downsampler|upsampler)\.(.+)$")
_DIFFUSERS_MIDDLE = re.compile(r"^(encoder|decoder)\.mid_block\.(resnets\.\d+|attentions\.0)\.(.+)$")


def _vae_key_from_comfy(key: str) -> str:
    m = _COMFY_BLOCK.match(key)
    if m:
        side, _, block, index, rest = m.groups()
        kind = "down" if side == "encoder" else "up"
        if rest.startswith(("resample.", "time_conv.")):
            return f"{side}.{kind}_blocks.{block}.{kind}sampler.{rest}"
        return f"{side}.{kind}_blocks.{block}.resnets.{index}.{_RESNET_FROM_COMFY.get(rest, rest)}"
    m = _COMFY_MIDDLE.match(key)
    if m:
        side, index, rest = m.groups()
        target = _MIDDLE_FROM_COMFY.get(index, index)
        if target.startswith("resnets"):
            rest = _RESNET_FROM_COMFY.get(rest, rest)
        return f"{side}.mid_block.{target}.{rest}"
    for side in ("encoder.", "decoder."):
        if key.startswith(side):
            tail = key[len(side):]
            for old, new in _SIDE_FROM_COMFY.items():
                if tail.startswith(old):
                    return side + new + tail[len(old):]
            return key
    for old, new in _TOP_FROM_COMFY.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


def vae_from_comfy_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's Qwen-Image-2.1 VAE file -> AutoencoderKLQwenImage21's names.

    ComfyUI stores the causal convolutions as Conv3d weights with a temporal kernel of 1 ([out, in, 1, kh, kw]);
    diffusers' image-only QwenImage21CausalConv3d is a Conv2d, so that singleton axis is dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if value.dim() == 5 and value.shape[2] == 1:
            value = value.squeeze(2)
        out[_vae_key_from_comfy(key)] = value
    return out


def _resnet_counts(state_dict: Mapping[str, torch.Tensor]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], set[int]] = {}
    for key in state_dict:
        m = _DIFFUSERS_BLOCK.match(key)
        if m and m.group(5) is not None:
            counts.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(5)))
    return {k: max(v) + 1 for k, v in counts.items()}


def _vae_key_to_comfy(key: str, resnets: dict[tuple[str, str], int]) -> tuple[str, bool]:
    """Returns (comfy key, whether ComfyUI holds it in a CausalConv3d)."""
    m = _DIFFUSERS_BLOCK.match(key)
    if m:
        side, kind, block, sub, index, rest = m.groups()
        container = "downsamples" if side == "encoder" else "upsamples"
        if index is None:
            # the resampler follows the block's residual blocks in ComfyUI's Sequential
            position = resnets[(side, block)]
            return f"{side}.{container}.{block}.{container}.{position}.{rest}", rest.startswith("time_conv.")
        return f"{side}.{container}.{block}.{container}.{index}.{_RESNET_TO_COMFY.get(rest, rest)}", True
    m = _DIFFUSERS_MIDDLE.match(key)
    if m:
        side, sub, rest = m.groups()
        position = {"resnets.0": "0", "attentions.0": "1", "resnets.1": "2"}[sub]
        if sub.startswith("resnets"):
            return f"{side}.middle.{position}.{_RESNET_TO_COMFY.get(rest, rest)}", True
        return f"{side}.middle.{position}.{rest}", False
    for side in ("encoder.", "decoder."):
        if key.startswith(side):
            tail = key[len(side):]
            for comfy, diffusers in _SIDE_FROM_COMFY.items():
                if tail.startswith(diffusers):
                    return side + comfy + tail[len(diffusers):], True
            return key, False
    for comfy, diffusers in _TOP_FROM_COMFY.items():
        if key.startswith(diffusers):
            return comfy + key[len(diffusers):], True
    return key, False


def vae_comfy_key_namer(diffusers_keys) -> Callable[[str], str]:
    """diffusers key -> ComfyUI key, for error messages about a ComfyUI VAE file (needs the model's key set to place
    each resampler after its block's residual blocks)."""
    resnets = _resnet_counts(dict.fromkeys(diffusers_keys))
    return lambda key: _vae_key_to_comfy(key, resnets)[0]


def vae_to_comfy_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """AutoencoderKLQwenImage21's state dict -> ComfyUI's Wan-2.2-layout file with temporal-kernel-1 Conv3d weights
    (the layout ComfyUI's sd.py recognises as the Qwen-Image-2.1 VAE)."""
    resnets = _resnet_counts(state_dict)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        comfy_key, causal_conv = _vae_key_to_comfy(key, resnets)
        if causal_conv and key.endswith(".weight") and value.dim() == 4:
            value = value.unsqueeze(2)
        out[comfy_key] = value
    return out


# -------------------------------------------------------------------------------------------------- text encoder
# ComfyUI's qwen3vl_8b file uses transformers' own Qwen3-VL names (ComfyUI's sd.py detects it by
# `model.visual.deepstack_merger_list.0.norm.weight` and renames to its internal modules at load time). ComfyUI's
# internal names (`model.layers.*`, `visual.*`, `model.lm_head.*`) are accepted as well.

_INTERNAL_TO_TRANSFORMERS = (
    ("model.lm_head.", "lm_head."),
    ("visual.", "model.visual."),
)


def _text_key_from_comfy(key: str) -> str:
    if key.startswith(("model.language_model.", "model.visual.", "lm_head.")):
        return key
    for old, new in _INTERNAL_TO_TRANSFORMERS:
        if key.startswith(old):
            return new + key[len(old):]
    if key.startswith("model."):
        return "model.language_model." + key[len("model."):]
    return key


def text_encoder_from_comfy_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's Qwen3-VL file -> Qwen3VLForConditionalGeneration's names. `lm_head.weight` may be absent; the loader
    then ties it to the input embeddings."""
    return {_text_key_from_comfy(k): v for k, v in state_dict.items()}


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return False
    return a.data_ptr() == b.data_ptr() or torch.equal(a, b)


def text_encoder_to_comfy_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3VLForConditionalGeneration's state dict -> the ComfyUI file's keys (the same names). A tied `lm_head` is a
    second copy of the embedding table (1.2 GB at 8B scale) and is left out, as a tied checkpoint stores it once."""
    out = dict(state_dict)
    head, embed = out.get("lm_head.weight"), out.get("model.language_model.embed_tokens.weight")
    if head is not None and embed is not None and _same_tensor(head, embed):
        del out["lm_head.weight"]
    return out
