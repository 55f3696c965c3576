"""Refuse a checkpoint that is another model, or a quantized file of a component that has no quantized path."""

from __future__ import annotations

from ..errors import CheckpointError
from ..quantized.comfy_quant import first_record_format
from .detect import DESCRIPTIONS
from .sources import WeightSource


def require_kind(source: WeightSource, kind: str, expected: str, bf16_file: str, quantized_ok: bool = False) -> None:
    """`quantized_ok`: the component reads ComfyUI's INT8 ConvRot records (the DiT and the text encoder); their
    records are checked layer by layer by `quantized.read_layers`, which names the file and the key at fault."""
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
    if info.quantized and not quantized_ok:
        what = first_record_format(source.files, source.header) or "tensors ending .weight_scale"
        raise CheckpointError(source.path, f"is a quantized ComfyUI checkpoint ({what}); this component is only read "
                                           "in float.", f"the bf16 file {bf16_file}")
