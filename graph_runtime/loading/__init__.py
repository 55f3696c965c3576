"""Model loading for Qwen-Image-2.1: diffusers folders and ComfyUI's single files, with errors that name the file.

Public API:
    load_transformer(path, dtype, device, quantized="int8") -> diffusers.QwenImage21Transformer2DModel
    load_vae(path, dtype, device) -> diffusers.AutoencoderKLQwenImage21
    load_text_encoder(path, dtype, device, tokenizer_dir=None, quantized="int8")
        -> (Qwen3VLForConditionalGeneration, Qwen3VLProcessor)
    load_processor(tokenizer_dir) -> Qwen3VLProcessor
    load_pipeline_folder(path, dtype, device, components) -> QwenImageModels
    default_scheduler_config() -> dict
    detect_checkpoint(path) -> str, inspect_checkpoint(path) -> CheckpointInfo
and the ComfyUI layout maps in `comfy_layout`.
"""

from .comfy_layout import (
    text_encoder_from_comfy_state_dict,
    text_encoder_to_comfy_state_dict,
    transformer_from_comfy_state_dict,
    transformer_to_comfy_state_dict,
    vae_from_comfy_state_dict,
    vae_to_comfy_state_dict,
)
from .detect import CheckpointInfo, detect_checkpoint, inspect_checkpoint
from .folder import QwenImageModels, default_scheduler_config, load_pipeline_folder
from .processor import load_processor
from ..safetensors_file import read_header
from .text_encoder import load_text_encoder
from .transformer import load_transformer
from .vae import load_vae

__all__ = [
    "CheckpointInfo",
    "QwenImageModels",
    "default_scheduler_config",
    "detect_checkpoint",
    "inspect_checkpoint",
    "load_pipeline_folder",
    "load_processor",
    "load_text_encoder",
    "load_transformer",
    "load_vae",
    "read_header",
    "text_encoder_from_comfy_state_dict",
    "text_encoder_to_comfy_state_dict",
    "transformer_from_comfy_state_dict",
    "transformer_to_comfy_state_dict",
    "vae_from_comfy_state_dict",
    "vae_to_comfy_state_dict",
]
