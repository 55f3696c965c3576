"""Refuse a checkpoint that is another model, or a quantized variant this runtime cannot run yet."""

from __future__ import annotations

import json

from ..errors import CheckpointError
from .detect import DESCRIPTIONS
from .safetensors_file import read_small_tensor
from .sources import WeightSource


def _quant_format(source: WeightSource) -> str:
    """The `format` in the first `.comfy_quant` blob (a few bytes of JSON), e.g. "int8_tensorwise"; ComfyUI's
    int8_convrot files say `"convrot": true` next to it."""
    key = next((k for k in source.header.tensors if k.endswith(".comfy_quant")), None)
    if key is None:
        return "int8_convrot"
    for file in source.files:
        try:
            blob = read_small_tensor(file, key)
        except Exception:
            continue
        try:
            config = json.loads(bytes(blob.flatten().tolist()).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            break
        name = str(config.get("format", "comfy_quant"))
        return name + (" + convrot" if config.get("convrot") else "")
    return "int8_convrot"


def require_kind(source: WeightSource, kind: str, expected: str, bf16_file: str) -> None:
    info = source.info
    if info.kind == "unknown":
        names = sorted(source.header.tensors)[:3]
        raise CheckpointError(source.path, f"does not look like {DESCRIPTIONS[kind]}: its tensor names match no model "
                                           f"this pack knows (first: {', '.join(names) or 'no tensors'}).", expected)
    if info.kind != kind:
        extra = ""
        if info.kind == "qwen-image-1.x-transformer":
            extra = " Qwen-Image 1.x and 2.1 checkpoints are not interchangeable."
        raise CheckpointError(source.path, f"is {info.description}, not {DESCRIPTIONS[kind]}.{extra}", expected)
    if info.quantized:
        raise CheckpointError(
            source.path,
            f"is a quantized ComfyUI checkpoint ({_quant_format(source)}: tensors ending .weight_scale/.comfy_quant). "
            "Quantized variants such as int8_convrot are not supported yet; use the bf16 release instead.",
            f"the bf16 file {bf16_file}",
        )
