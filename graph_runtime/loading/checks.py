"""Refuse a checkpoint that is another model, a quantized file of a component that has no quantized path, or one
whose weights are stored as integers or booleans."""

from __future__ import annotations

from ..errors import CheckpointError, shorten
from ..quantized.comfy_quant import first_record_format
from .detect import DESCRIPTIONS
from .sources import WeightSource

# The dtypes a weight of these models can be stored in (cast to the load dtype as they are read).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# Quantized layers' int8 weights and their uint8 records, which `quantized.read_layers` checks key by key.
QUANTIZED_DTYPES = ("I8", "U8", "F8_E8M0")  # F8_E8M0: MXFP8 block scales
_SHOW = 3


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
    not_float = [(k, t.dtype) for k, t in sorted(source.header.tensors.items()) if t.dtype not in FLOAT_DTYPES
                 and not (quantized_ok and t.dtype in QUANTIZED_DTYPES)]
    if not_float:
        shown = ", ".join(f"{shorten(k)} ({dtype})" for k, dtype in not_float[:_SHOW])
        raise CheckpointError(source.path, f"stores {len(not_float)} tensor(s) as integers or booleans where the model "
                                           f"needs floating-point weights: {shown}. A damaged or wrongly converted "
                                           "file.", expected)
