"""A Qwen3-VL-8B text encoder whose language tower is a GGUF file (llama.cpp's `qwen3vl` names, any type the gguf
package dequantizes) and whose vision tower comes from a Qwen3-VL safetensors file (ComfyUI's
`qwen3vl_8b_bf16.safetensors` or its INT8 ConvRot twin: only its `visual` tensors are read).

ComfyUI-GGUF pairs a GGUF language tower with the vision weights of an `mmproj` GGUF beside it; those vision files
are small (0.6 GB in bf16), so here the vision tower is read from the file a ComfyUI user has already. The language
tower is dequantized at load into the encoder's `dtype` one tensor at a time; the vision file's layers load as its
own loader loads them (int8 kept or dequantized, FP8 dequantized).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import torch

from ..errors import CheckpointError, shorten
from ..quantized import check_mode, read_layers
from .assemble import assign_weights, build_empty, check_against_model, finish
from .checks import require_kind
from .comfy_layout import text_encoder_from_comfy_state_dict
from .config_infer import infer_text_encoder_config
from .detect import QWEN3VL_TEXT_ENCODER
from .gguf_files import ARCH_FIELD, GGUFFile
from .int8_files import install_int8_layers, meta_weights, read_weights
from .sources import resolve

logger = logging.getLogger(__name__)
ARCHITECTURES = ("qwen3vl", "qwen3")
LANGUAGE = "model.language_model."
TOP = {"token_embd": LANGUAGE + "embed_tokens", "output_norm": LANGUAGE + "norm", "output": "lm_head"}
LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def language_key(name: str) -> str | None:
    """llama.cpp's tensor name -> Qwen3VLForConditionalGeneration's, or None for a name it does not have."""
    if m := _BLOCK.match(name):
        part = LAYER.get(m.group(2))
        return f"{LANGUAGE}layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    if (m := _TOP.match(name)) and m.group(1) in TOP:
        return f"{TOP[m.group(1)]}.{m.group(2)}"
    return None


def gguf_language_name(key: str) -> str | None:
    """The reverse of `language_key` (the tiny GGUF writer), None for a vision tensor."""
    for gguf_name, ours in TOP.items():
        if key.startswith(ours + "."):
            return gguf_name + key[len(ours):]
    prefix = LANGUAGE + "layers."
    if key.startswith(prefix):
        index, rest = key[len(prefix):].split(".", 1)
        for gguf_name, ours in LAYER.items():
            if rest.startswith(ours + "."):
                return f"blk.{index}.{gguf_name}{rest[len(ours):]}"
    return None


def _is_vision(key: str) -> bool:
    return text_encoder_from_comfy_state_dict({key: None}).popitem()[0].startswith("model.visual.")


def load_gguf_text_encoder(path: str | os.PathLike, vision_path: str | os.PathLike, expected: str,
                           dtype: torch.dtype = torch.bfloat16, device="cpu", quantized: str = "int8",
                           dequantize_device=None, processor_for=None):
    """`(Qwen3VLForConditionalGeneration, processor)`: the language tower from the GGUF at `path`, the vision tower
    from the safetensors file `vision_path`; `processor_for(source, given)` finds the tokenizer (the loader's own)."""
    from transformers import Qwen3VLForConditionalGeneration

    check_mode(quantized)
    file = GGUFFile(path, expected)
    if file.arch not in ARCHITECTURES:
        raise CheckpointError(path, f"is a GGUF file of architecture {file.arch!r} ({ARCH_FIELD}), not a Qwen3-VL "
                                    f"language tower ({' or '.join(map(repr, ARCHITECTURES))}).", expected)
    names = {}
    for name in file.tensors:
        key = language_key(name)
        if key is None:
            raise CheckpointError(path, f"has tensor {shorten(name)}, which a Qwen3-VL language tower does not "
                                        "have.", expected)
        names[key] = name
    given = Path(vision_path).expanduser()
    source = resolve(given, "text_encoder", expected)
    require_kind(source, QWEN3VL_TEXT_ENCODER, expected, "qwen3vl_8b_bf16.safetensors", quantized_ok=True)
    layers = read_layers(source.files, source.header, expected)
    processor = processor_for(source, given) if processor_for else None

    vision_shapes = {k: tuple(v.shape) for k, v in text_encoder_from_comfy_state_dict(
        meta_weights(source.header.shapes, layers, _is_vision)).items()}
    if not vision_shapes:
        raise CheckpointError(vision_path, "has no vision tower (model.visual.* tensors) to pair with the GGUF "
                                           f"language tower {Path(path).name}.", expected)
    shapes = {**vision_shapes, **{k: file.tensors[n].shape for k, n in names.items()}}
    config = infer_text_encoder_config(shapes, path, expected, lambda k: names.get(k, k))
    tied = "lm_head.weight" not in shapes  # the inferred config ties the head then
    model = build_empty(lambda: Qwen3VLForConditionalGeneration(config))
    check_against_model(model, shapes, path, expected, may_be_absent=["lm_head.weight"] if tied else [],
                        file_key=lambda k: names.get(k, k))

    loaded = read_weights(source, layers, text_encoder_from_comfy_state_dict, dtype, device, quantized,
                          dequantize_device=dequantize_device, expected=expected, keep=_is_vision)
    install_int8_layers(model, loaded.int8_layers, source.path, expected, output_dtype=dtype)
    start = time.perf_counter()
    for key, name in names.items():
        loaded.tensors[key] = file.read(name, dtype, dequantize_device or device).to(device)
    assign_weights(model, loaded.tensors)
    del loaded
    if tied:
        model.tie_weights()
    logger.info("KV-Graph: read the GGUF language tower %s (%s), dequantized to %s in %.1f s; vision tower from %s",
                path, file.describe_types(), str(dtype).removeprefix("torch."), time.perf_counter() - start,
                vision_path)
    return finish(model, path, expected, device), processor


# The vision tower's file when the user has several: ComfyUI's own Qwen3-VL files first (bf16, then INT8 ConvRot).
VISION_FILES = ("qwen3vl_8b_bf16.safetensors", "qwen3vl_8b_int8_convrot.safetensors")


def pick_vision_file(candidates) -> Path | None:
    """The Qwen3-VL safetensors file among `candidates` (paths) to take a GGUF language tower's vision tower from:
    one of VISION_FILES by name, else the first (sorted by name) whose header says Qwen3-VL; None if there is none."""
    from .detect import detect_checkpoint

    paths = sorted((Path(c) for c in candidates if str(c).lower().endswith(".safetensors")), key=lambda p: p.name)
    for name in VISION_FILES:
        for p in paths:
            if p.name == name:
                return p
    for p in paths:
        try:
            if detect_checkpoint(p) == QWEN3VL_TEXT_ENCODER:
                return p
        except CheckpointError:
            continue
    return None
