"""Say which model a checkpoint is from its tensor names and shapes alone (the safetensors header, no data read).

The point is the error message: when a user picks the wrong file in a ComfyUI dropdown, "this is a Qwen-Image 1.x
transformer, not 2.1" is actionable where "missing key transformer_blocks.0.img_mlp.gate_layer.weight" is not. The
signatures follow the keys ComfyUI's own detection keys on (see docs/checkpoints.md), so a file ComfyUI recognises is
recognised here the same way.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Mapping

from ..safetensors_file import read_header

COMFY_DIFFUSION_PREFIX = "model.diffusion_model."

QWEN21_TRANSFORMER = "qwen-image-2.1-transformer"
QWEN21_VAE = "qwen-image-2.1-vae"
QWEN3VL_TEXT_ENCODER = "qwen3vl-text-encoder"

DESCRIPTIONS = {
    QWEN21_TRANSFORMER: "a Qwen-Image-2.1 transformer (diffusion model)",
    QWEN21_VAE: "the Qwen-Image-2.1 VAE",
    QWEN3VL_TEXT_ENCODER: "a Qwen3-VL text encoder",
    "qwen-image-1.x-transformer": "a Qwen-Image 1.x transformer (the 20B dual-stream MMDiT, a different architecture "
                                  "from 2.1)",
    "qwen2.5vl-text-encoder": "a Qwen2.5-VL text encoder (the one Qwen-Image 1.x uses, not Qwen3-VL)",
    "wan-vae": "a Wan 2.1 / Qwen-Image 1.x VAE (16 latent channels, 8x compression)",
    "wan2.2-vae": "a Wan 2.2 video VAE (48 latent channels)",
    "sd-vae": "a Stable Diffusion / SDXL / FLUX-style VAE (AutoencoderKL)",
    "sdxl-unet": "an SDXL UNet",
    "sd-unet": "a Stable Diffusion 1.x/2.x UNet",
    "flux-transformer": "a FLUX transformer",
    "clip-text-encoder": "a CLIP text encoder",
    "t5-text-encoder": "a T5 text encoder",
    "llm-text-encoder": "a language-model text encoder other than Qwen3-VL",
    "unknown": "an unrecognised model",
}


@dataclass(frozen=True)
class CheckpointInfo:
    """kind: one of DESCRIPTIONS' keys. layout: whose key names the file uses ("comfyui", "diffusers",
    "transformers", "comfyui-internal", or "" when irrelevant). quantized: the quantization marker found, if any.
    prefix: a key prefix the loaders strip ("model.diffusion_model." in ComfyUI diffusion-model files)."""

    kind: str
    layout: str = ""
    quantized: str | None = None
    prefix: str = ""

    @property
    def description(self) -> str:
        return DESCRIPTIONS.get(self.kind, self.kind)


def quantization_marker(keys) -> str | None:
    """ComfyUI's mixed-precision formats (int8_convrot, fp8 scaled, nvfp4...) store per-layer `.weight_scale`
    tensors and a `.comfy_quant` JSON blob next to the quantized weight."""
    for k in keys:
        if k.endswith(".comfy_quant"):
            return "comfy_quant"
    for k in keys:
        if k.endswith(".weight_scale"):
            return "weight_scale"
    return None


def _strip(shapes: Mapping[str, tuple], prefix: str) -> dict[str, tuple]:
    return {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}


_QWEN21_MLP = re.compile(r"^transformer_blocks\.\d+\.img_mlp\.(gate_up|proj|gate_layer)\.weight$")


def _transformer_kind(shapes: Mapping[str, tuple]) -> tuple[str, str] | None:
    keys = shapes.keys()
    # ComfyUI requires txt_in.text_norm, modulation.1, block 0's norm_q, img_in, proj_out and an img_mlp weight. A
    # file with the shared modulation and single-stream MLPs but some of those missing is still taken as a damaged
    # 2.1 transformer, so the error names the missing tensors instead of calling it unknown.
    mlp = [m.group(1) for k in keys if (m := _QWEN21_MLP.match(k))]
    if mlp and ("modulation.1.weight" in keys or "txt_in.text_norm.weight" in keys):
        return QWEN21_TRANSFORMER, "comfyui" if "gate_up" in mlp else "diffusers"
    if "txt_norm.weight" in keys and ("transformer_blocks.0.img_mod.1.weight" in keys
                                      or "transformer_blocks.0.txt_mod.1.weight" in keys):
        return "qwen-image-1.x-transformer", ""
    if "double_blocks.0.img_attn.qkv.weight" in keys or (
            "x_embedder.weight" in keys and "single_transformer_blocks.0.attn.to_q.weight" in keys):
        return "flux-transformer", ""
    if "input_blocks.0.0.weight" in keys:
        return ("sdxl-unet" if "label_emb.0.0.weight" in keys else "sd-unet"), "ldm"
    if "conv_in.weight" in keys and "down_blocks.0.resnets.0.conv1.weight" in keys and "time_embedding.linear_1.weight" in keys:
        return ("sdxl-unet" if "add_embedding.linear_1.weight" in keys else "sd-unet"), "diffusers"
    return None


def _vae_kind(shapes: Mapping[str, tuple]) -> tuple[str, str] | None:
    keys = shapes.keys()
    # ComfyUI's Wan-family layout (comfy/ldm/wan): RMS-norm gammas inside `residual` Sequentials.
    if "decoder.middle.0.residual.0.gamma" in keys:
        if "decoder.upsamples.0.upsamples.0.residual.2.weight" in keys:
            # Qwen-Image-2.1 is built with temporal kernel 1 (sd.py reads it off decoder.head.2.weight); Wan 2.2
            # has 3-frame kernels. Any other causal conv tells the same when the head is absent.
            for name in ("decoder.head.2.weight", "decoder.conv1.weight", "encoder.conv1.weight"):
                conv = shapes.get(name, ())
                if len(conv) == 5:
                    return (QWEN21_VAE if conv[2] == 1 else "wan2.2-vae"), "comfyui"
            return "wan2.2-vae", "comfyui"
        return "wan-vae", "comfyui"
    # diffusers' Wan-family layout (AutoencoderKLWan / AutoencoderKLQwenImage / AutoencoderKLQwenImage21).
    if "decoder.mid_block.resnets.0.norm1.gamma" in keys:
        # AutoencoderKLQwenImage21's causal convs are Conv2d (4-D weights); the video VAEs' are Conv3d (5-D)
        conv = next((shapes[n] for n in ("decoder.conv_out.weight", "decoder.conv_in.weight", "encoder.conv_in.weight")
                     if n in shapes), ())
        if len(conv) == 4:
            return QWEN21_VAE, "diffusers"
        z_dim = shapes.get("post_quant_conv.weight", (0,))[0]
        return ("wan2.2-vae" if z_dim == 48 else "wan-vae"), "diffusers"
    if "decoder.conv_in.weight" in keys and ("decoder.up.0.block.0.conv1.weight" in keys
                                             or "decoder.up_blocks.0.resnets.0.norm1.weight" in keys):
        return "sd-vae", ""
    return None


def _text_encoder_kind(shapes: Mapping[str, tuple]) -> tuple[str, str] | None:
    keys = shapes.keys()
    # DeepStack mergers exist only in Qwen3-VL; ComfyUI's sd.py keys its Qwen3-VL detection on the same tensor.
    if "model.visual.deepstack_merger_list.0.norm.weight" in keys:
        return QWEN3VL_TEXT_ENCODER, "transformers"
    if "visual.deepstack_merger_list.0.norm.weight" in keys and "model.layers.0.self_attn.q_proj.weight" in keys:
        return QWEN3VL_TEXT_ENCODER, "comfyui-internal"
    # q/k norms are Qwen3's (Qwen2.5-VL has none): a vision tower next to them without DeepStack is a damaged
    # Qwen3-VL file, left for the missing-tensor check to describe
    if "model.language_model.layers.0.self_attn.q_norm.weight" in keys and any(
            k.startswith("model.visual.") for k in keys):
        return QWEN3VL_TEXT_ENCODER, "transformers"
    if ("model.layers.0.self_attn.k_proj.bias" in keys
            or "model.language_model.layers.0.self_attn.k_proj.bias" in keys):
        return "qwen2.5vl-text-encoder", ""
    if "text_model.encoder.layers.0.mlp.fc1.weight" in keys:
        return "clip-text-encoder", ""
    if "encoder.block.0.layer.0.SelfAttention.k.weight" in keys:
        return "t5-text-encoder", ""
    if "model.layers.0.self_attn.q_proj.weight" in keys or "model.language_model.layers.0.self_attn.q_proj.weight" in keys:
        return "llm-text-encoder", ""
    return None


def inspect_shapes(shapes: Mapping[str, tuple]) -> CheckpointInfo:
    """Classify a checkpoint from {tensor name: shape}."""
    quantized = quantization_marker(shapes.keys())
    prefix = ""
    candidates = shapes
    if any(k.startswith(COMFY_DIFFUSION_PREFIX) for k in shapes):
        prefix = COMFY_DIFFUSION_PREFIX
        candidates = _strip(shapes, prefix)
    for classify in (_transformer_kind, _vae_kind, _text_encoder_kind):
        found = classify(candidates)
        if found:
            kind, layout = found
            if kind == QWEN21_TRANSFORMER and prefix:
                layout = "comfyui"
            return CheckpointInfo(kind=kind, layout=layout, quantized=quantized, prefix=prefix)
    return CheckpointInfo(kind="unknown", quantized=quantized, prefix=prefix)


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Classify a .safetensors file from its header (validated first: a truncated or foreign file raises
    CheckpointError); a quantized file's format is read from its first `.comfy_quant` record (a few bytes)."""
    from ..quantized.comfy_quant import first_record_format

    header = read_header(path)
    info = inspect_shapes(header.shapes)
    if info.quantized == "comfy_quant":
        info = replace(info, quantized=first_record_format([header.path], header))
    return info


def detect_checkpoint(path: str | os.PathLike) -> str:
    """Name what a .safetensors file is ("qwen-image-2.1-transformer", "qwen-image-2.1-vae", "qwen3vl-text-encoder",
    "qwen-image-1.x-transformer", "sdxl-unet", "flux-transformer", "wan-vae", "sd-vae", ..., "unknown")."""
    return inspect_checkpoint(path).kind


# ComfyUI-GGUF's `general.architecture` strings -> what the file is; a file without one (stable-diffusion.cpp's) is
# classified from its tensor names, as ComfyUI-GGUF does.
GGUF_ARCHITECTURES = {
    "qwen_image21": QWEN21_TRANSFORMER,
    "qwen_image": "qwen-image-1.x-transformer",
    "flux": "flux-transformer",
    "sdxl": "sdxl-unet",
    "sd1": "sd-unet",
    "t5": "t5-text-encoder",
    "t5encoder": "t5-text-encoder",
    "qwen2vl": "qwen2.5vl-text-encoder",
    "llama": "llm-text-encoder",
}


def inspect_gguf_shapes(arch: str | None, shapes: Mapping[str, tuple]) -> CheckpointInfo:
    """Classify a GGUF file from its architecture string and {tensor name (prefix stripped): shape}."""
    if arch in (None, "pig"):
        return replace(inspect_shapes(shapes), quantized="gguf")
    return CheckpointInfo(kind=GGUF_ARCHITECTURES.get(arch, "unknown"), layout="comfyui", quantized="gguf")
