"""Find a Qwen tokenizer and wrap it in a Qwen3VLProcessor.

A ComfyUI text-encoder file carries no tokenizer. Inside ComfyUI the nodes pass ComfyUI's bundled Qwen tokenizer
folder (comfy/text_encoders/qwen25_tokenizer: vocab.json, merges.txt, tokenizer_config.json); outside it the tokenizer
comes from a diffusers pipeline folder or sits next to the file.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError

ACCEPTED_TOKENIZER_FOLDERS = (
    "a Qwen tokenizer folder: a diffusers pipeline folder (its processor/ or tokenizer/), such a processor/ or "
    "tokenizer/ folder, or a folder with tokenizer.json or vocab.json + merges.txt such as ComfyUI's "
    "comfy/text_encoders/qwen25_tokenizer"
)
# Qwen's special tokens sit at fixed ids that the text encoder's embedding table is trained for.
REQUIRED_TOKEN_IDS = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                      "<|image_pad|>": 151655}

# A chat template rendering each turn as `<|im_start|>{role}\n{text}<|im_end|>\n`, images as vision blocks: what
# Qwen3-VL's own template renders for the turns the Qwen-Image pipeline builds.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or ((folder / "vocab.json").is_file()
                                                     and (folder / "merges.txt").is_file())


def tokenizer_folder(path: str | os.PathLike) -> Path | None:
    """The folder holding tokenizer files: `path` itself, or its processor/ or tokenizer/ subfolder."""
    path = Path(path)
    for candidate in (path, path / "processor", path / "tokenizer"):
        if candidate.is_dir() and _has_tokenizer(candidate):
            return candidate
    return None


def tokenizer_folder_near(file: Path) -> Path | None:
    """A tokenizer next to a single-file text encoder: in its folder, processor/ or tokenizer/ beside it, or a
    folder named like the file without its suffix."""
    return tokenizer_folder(file.parent) or (tokenizer_folder(file.with_suffix("")) if file.with_suffix("").is_dir()
                                             else None)


def _check_special_tokens(folder: Path, tokenizer) -> None:
    wrong = {t: i for t, i in REQUIRED_TOKEN_IDS.items() if tokenizer.convert_tokens_to_ids(t) != i}
    if wrong:
        shown = ", ".join(f"{t} (id {i})" for t, i in wrong.items())
        raise CheckpointError(folder, f"holds a tokenizer without Qwen's special tokens at their ids: {shown}.",
                              ACCEPTED_TOKENIZER_FOLDERS)


def build_processor(tokenizer):
    """Qwen3-VL's processor around `tokenizer`, with Qwen3-VL's image settings (16 px patches, 2x2 merge, mean/std
    0.5) and CHAT_TEMPLATE."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 64 * 64, "longest_edge": 16777216},
    )
    video_processor = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                            chat_template=CHAT_TEMPLATE)


def load_processor(path: str | os.PathLike):
    """A Qwen3VLProcessor from `path` (see ACCEPTED_TOKENIZER_FOLDERS).

    A saved processor (processor_config.json next to the tokenizer) is loaded as saved. A bare tokenizer is wrapped
    with Qwen3-VL's image settings and a chat template that renders the turns the Qwen-Image pipeline builds:
    ComfyUI's bundled tokenizer carries Qwen2.5's text-only template, which would render list-style message
    content as text.
    """
    from transformers import AutoTokenizer, Qwen2TokenizerFast, Qwen3VLProcessor

    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, "does not exist.", ACCEPTED_TOKENIZER_FOLDERS)
    folder = tokenizer_folder(path)
    if folder is None:
        raise CheckpointError(path, "has no tokenizer (tokenizer.json, or vocab.json + merges.txt).",
                              ACCEPTED_TOKENIZER_FOLDERS)
    if (folder / "processor_config.json").is_file() or (folder / "preprocessor_config.json").is_file():
        try:
            processor = Qwen3VLProcessor.from_pretrained(str(folder), local_files_only=True)
        except Exception:  # a processor saved by another class or version: rebuild around its tokenizer below
            processor = None
        if processor is not None:
            _check_special_tokens(folder, processor.tokenizer)
            return processor
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception:
        try:
            tokenizer = Qwen2TokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:
            raise CheckpointError(folder, f"holds tokenizer files that do not load as a Qwen tokenizer ({exc}).",
                                  ACCEPTED_TOKENIZER_FOLDERS) from None
    _check_special_tokens(folder, tokenizer)
    return build_processor(tokenizer)
