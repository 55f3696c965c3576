"""Load the Qwen3-VL text encoder (and its processor) from a diffusers folder or ComfyUI's single file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import CheckpointError
from .assemble import assign_weights, build_empty, check_against_model, finish
from .checks import require_kind
from .comfy_layout import text_encoder_from_comfy_state_dict
from .config_infer import infer_text_encoder_config
from .detect import QWEN3VL_TEXT_ENCODER
from .processor import ACCEPTED_TOKENIZER_FOLDERS, load_processor, tokenizer_folder, tokenizer_folder_near
from .safetensors_file import iter_tensors
from .sources import resolve

BF16_FILE = "qwen3vl_8b_bf16.safetensors"
EXPECTED = (f"a Qwen3-VL text encoder: ComfyUI's models/text_encoders/{BF16_FILE}, a diffusers pipeline folder "
            "(with text_encoder/), or a transformers text_encoder/ folder")
LM_HEAD, EMBED = "lm_head.weight", "model.language_model.embed_tokens.weight"


def _folder_config(source):
    from transformers import Qwen3VLConfig

    model_type = source.config.get("model_type")
    if model_type != "qwen3_vl":
        what = "a Qwen2.5-VL (Qwen-Image 1.x)" if model_type == "qwen2_5_vl" else f"a {model_type!r}"
        raise CheckpointError(source.path, f"is {what} model folder (config.json model_type), not Qwen3-VL.", EXPECTED)
    return Qwen3VLConfig.from_dict(source.config)


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


def load_text_encoder(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", tokenizer_dir: str | os.PathLike | None = None):
    """Load `(Qwen3VLForConditionalGeneration, Qwen3VLProcessor)`; the model in eval mode, gradients off.

    `path`: a diffusers pipeline folder (text_encoder/ + processor/ or tokenizer/), a text_encoder/ folder, or
    ComfyUI's single file (transformers' Qwen3-VL key names; ComfyUI's internal names are accepted too). A single
    file's config is inferred from its shapes. Without an `lm_head.weight` the head is tied to the embeddings.
    `tokenizer_dir`: see `processor.ACCEPTED_TOKENIZER_FOLDERS`; when None it is looked for in the pipeline folder
    or next to the file.
    """
    from transformers import Qwen3VLForConditionalGeneration

    given = Path(path).expanduser()
    source = resolve(given, "text_encoder", EXPECTED)
    config = _folder_config(source) if source.config is not None else None
    require_kind(source, QWEN3VL_TEXT_ENCODER, EXPECTED, BF16_FILE)
    # The tokenizer is checked before any weight is read: a missing one should not cost a 16 GB load first.
    processor = _resolve_processor(source, given, tokenizer_dir)

    mapped_shapes = {k: tuple(v.shape) for k, v in
                     text_encoder_from_comfy_state_dict(source.header.meta_state_dict()).items()}
    if config is None:
        config = infer_text_encoder_config(mapped_shapes, source.path, EXPECTED)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        # a tied head is the embedding table itself; a stored copy of it is redundant
        mapped_shapes.pop(LM_HEAD, None)
    model = build_empty(lambda: Qwen3VLForConditionalGeneration(config))
    check_against_model(model, mapped_shapes, source.path, EXPECTED, may_be_absent=[LM_HEAD] if tied else [])

    tensors = text_encoder_from_comfy_state_dict(dict(iter_tensors(source.files, dtype=dtype, device=device)))
    if tied:
        tensors.pop(LM_HEAD, None)
    assign_weights(model, tensors)
    del tensors
    if tied:
        model.tie_weights()
    return finish(model, source.path, EXPECTED, device), processor
