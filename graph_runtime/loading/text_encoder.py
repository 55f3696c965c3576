"""Load the Qwen3-VL text encoder (and its processor) from a diffusers folder or ComfyUI's single file, bf16 or INT8
ConvRot (`qwen3vl_8b_int8_convrot.safetensors`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import CheckpointError, shorten
from ..quantized import KEEP_INT8, ConvRotInt8Embedding, ConvRotInt8Linear, check_mode, read_layers
from .assemble import assign_weights, build_empty, check_against_model, check_fits, finish
from .checks import require_kind
from .comfy_layout import text_encoder_from_comfy_state_dict
from .config_infer import check_config_values, infer_text_encoder_config
from .detect import QWEN3VL_TEXT_ENCODER
from .gguf_files import is_gguf
from .int8_files import install_int8_layers, meta_weights, read_weights
from .processor import ACCEPTED_TOKENIZER_FOLDERS, load_processor, tokenizer_folder, tokenizer_folder_near
from .sources import resolve

BF16_FILE = "qwen3vl_8b_bf16.safetensors"
INT8_FILE = "qwen3vl_8b_int8_convrot.safetensors"
EXPECTED = (f"a Qwen3-VL text encoder: ComfyUI's models/text_encoders/{INT8_FILE} or {BF16_FILE}, a diffusers "
            "pipeline folder (with text_encoder/), or a transformers text_encoder/ folder")
LM_HEAD, EMBED = "lm_head.weight", "model.language_model.embed_tokens.weight"


def _folder_config(source):
    from transformers import Qwen3VLConfig

    model_type = source.config.get("model_type")
    if model_type != "qwen3_vl":
        what = "a Qwen2.5-VL (Qwen-Image 1.x)" if model_type == "qwen2_5_vl" else f"a {model_type!r}"
        raise CheckpointError(source.path, f"is {what} model folder (config.json model_type), not Qwen3-VL.", EXPECTED)
    return Qwen3VLConfig.from_dict(source.config)


# The config values the weights' shapes determine, per section of a Qwen3VLConfig.
_TEXT_SIZED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size")
_VISION_SIZED = ("depth", "hidden_size", "intermediate_size", "out_hidden_size", "num_position_embeddings",
                 "in_channels", "patch_size", "spatial_merge_size", "temporal_patch_size")


def _check_config_against_weights(source, config, shapes) -> None:
    """config.json against the weights beside it (`check_config_values`), section by section, and its DeepStack
    taps: one per merger the weights hold, each a vision block that exists."""
    where = source.path / "config.json"
    inferred = infer_text_encoder_config(shapes, source.path, EXPECTED)
    for section, keys in (("text_config", _TEXT_SIZED), ("vision_config", _VISION_SIZED)):
        given, wanted = getattr(config, section), getattr(inferred, section)
        check_config_values(where, {k: getattr(given, k, None) for k in keys}, {k: getattr(wanted, k) for k in keys},
                            EXPECTED, prefix=f"{section}.")
    taps, depth = config.vision_config.deepstack_visual_indexes, inferred.vision_config.depth
    mergers = len(inferred.vision_config.deepstack_visual_indexes)
    if (not isinstance(taps, (list, tuple)) or len(taps) != mergers
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < depth for t in taps)):
        raise CheckpointError(where, f"says vision_config.deepstack_visual_indexes={shorten(repr(taps))}: expected "
                                     f"{mergers} vision block numbers below {depth}, one per DeepStack merger of the "
                                     "weights beside it.", EXPECTED)


def _resolve_processor(source, given: Path, tokenizer_dir):
    if tokenizer_dir is not None:
        return load_processor(tokenizer_dir)
    candidates = []
    if source.config is not None:
        # a text_encoder/ folder's pipeline keeps the tokenizer one level up
        candidates = [given, source.path.parent]
    else:
        near = tokenizer_folder_near(source.path)
        candidates = [near] if near else []
    for candidate in candidates:
        if candidate is not None and tokenizer_folder(candidate) is not None:
            return load_processor(candidate)
    raise CheckpointError(source.path, "comes without a tokenizer and none was given (tokenizer_dir) or found next "
                                       "to it.", ACCEPTED_TOKENIZER_FOLDERS)


def _tie_head(model) -> None:
    """Tie the output head to the input embeddings: transformers' own tie for a float table; for an int8 table, a
    head reading the same int8 rows and scales (a float head cannot share an int8 Parameter)."""
    embed = model.get_input_embeddings()
    if isinstance(embed, ConvRotInt8Embedding):
        model.lm_head = ConvRotInt8Linear.sharing(embed)
    else:
        model.tie_weights()


def load_text_encoder(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", tokenizer_dir: str | os.PathLike | None = None,
                      quantized: str = KEEP_INT8, dequantize_device=None,
                      vision: str | os.PathLike | None = None):
    """Load `(Qwen3VLForConditionalGeneration, Qwen3VLProcessor)`; the model in eval mode, gradients off.

    `path`: a diffusers pipeline folder (text_encoder/ + processor/ or tokenizer/), a text_encoder/ folder, or
    ComfyUI's single file (transformers' Qwen3-VL key names; ComfyUI's internal names are accepted too). A single
    file's config is inferred from its shapes. Without an `lm_head.weight` the head is tied to the embeddings.
    `tokenizer_dir`: see `processor.ACCEPTED_TOKENIZER_FOLDERS`; when None it is looked for in the pipeline folder
    or next to the file. `quantized` ("int8" or "dequantize"): how an INT8 ConvRot file runs, as in
    `load_transformer`; in int8 mode every quantized Linear and Embedding of the file stays int8 (the conditioning
    is the same hidden state, through int8 GEMMs).

    A `.gguf` `path` is a Qwen3-VL language tower (llama.cpp's names), dequantized to `dtype` at load; `vision` then
    names the Qwen3-VL safetensors file whose vision tower (and tokenizer search) goes with it
    (gguf_text_encoder.py).
    """
    from transformers import Qwen3VLForConditionalGeneration

    check_mode(quantized)
    if is_gguf(path):
        from .gguf_text_encoder import load_gguf_text_encoder

        if vision is None:
            raise CheckpointError(path, "is a GGUF language tower without its vision tower: name the Qwen3-VL "
                                        "safetensors file to take it from.", EXPECTED)
        return load_gguf_text_encoder(path, vision, EXPECTED, dtype, device, quantized, dequantize_device,
                                      lambda source, given: _resolve_processor(source, given, tokenizer_dir))
    given = Path(path).expanduser()
    source = resolve(given, "text_encoder", EXPECTED)
    config = _folder_config(source) if source.config is not None else None
    require_kind(source, QWEN3VL_TEXT_ENCODER, EXPECTED, BF16_FILE, quantized_ok=True)
    layers = read_layers(source.files, source.header, EXPECTED)
    mapped_shapes = {k: tuple(v.shape) for k, v in text_encoder_from_comfy_state_dict(
        meta_weights(source.header.shapes, layers)).items()}
    if config is None:
        config = infer_text_encoder_config(mapped_shapes, source.path, EXPECTED)
    else:
        _check_config_against_weights(source, config, mapped_shapes)
    # The tokenizer is checked before any weight is read: a missing one should not cost a 16 GB load first.
    processor = _resolve_processor(source, given, tokenizer_dir)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        # a tied head is the embedding table itself; a stored copy of it is redundant
        mapped_shapes.pop(LM_HEAD, None)
    model = build_empty(lambda: Qwen3VLForConditionalGeneration(config))
    check_against_model(model, mapped_shapes, source.path, EXPECTED, may_be_absent=[LM_HEAD] if tied else [])

    check_fits(source.path, source.header, dtype, device, EXPECTED)

    loaded = read_weights(source, layers, text_encoder_from_comfy_state_dict, dtype, device, quantized,
                          dequantize_device=dequantize_device, expected=EXPECTED)
    if tied:
        loaded.tensors.pop(LM_HEAD, None)
        loaded.int8_layers.pop(LM_HEAD[: -len(".weight")], None)
    install_int8_layers(model, loaded.int8_layers, source.path, EXPECTED, output_dtype=dtype)
    assign_weights(model, loaded.tensors)
    del loaded
    if tied:
        _tie_head(model)
    return finish(model, source.path, EXPECTED, device), processor
