"""Read and check the per-layer quantization records of ComfyUI's mixed-precision checkpoints.

Next to each quantized layer `P` a ComfyUI file stores `P.weight` (int8 `[out, in]`), `P.weight_scale` and
`P.comfy_quant`: a uint8 tensor holding JSON such as `{"format": "int8_tensorwise", "convrot": true,
"convrot_groupsize": 256}` (ComfyUI's `comfy/ops.py` also reads `convrot` / `convrot_groupsize` from a nested
`"params"` dict, and `"full_precision_matrix_mult": true` asks for the layer to be dequantized and run in high
precision). Layers without a record are ordinary float tensors. Everything a loader needs is checked here, before
any weight is read, so a bad file fails with the file and the key at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..safetensors_file import iter_tensors
from .block_formats import BLOCK_FORMATS, check_layer, group_size, logical_shape, sidecars
from .int8_convrot import group_size_problem

INT8_TENSORWISE = "int8_tensorwise"
# FP8 layers (ComfyUI's "fp8 scaled" files): an e4m3 / e5m2 weight times its `.weight_scale`. They are dequantized at
# load (the precision then quantizes the float weights as it does a bf16 file's).
FLOAT8_FORMATS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
# comfy-kitchen's W4A16/AWQ, NVFP4 and MXFP8 layers: dequantized at load by comfy-kitchen (block_formats.py).
SUPPORTED_FORMATS = (INT8_TENSORWISE, *FLOAT8_FORMATS, *BLOCK_FORMATS)
RECORD, SCALE, WEIGHT = ".comfy_quant", ".weight_scale", ".weight"
INPUT_SCALE = ".input_scale"  # an FP8 layer's activation scale: not needed once the weight is dequantized
LEGACY_FP8_MARKER = "scaled_fp8"
DEFAULT_GROUP_SIZE = 256  # what ComfyUI assumes when a record says convrot without a group size
_FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class LayerQuant:
    """One quantized layer as its record describes it. `prefix`: the layer's name in the file (without `.weight`)."""

    prefix: str
    format: str
    convrot: bool
    group_size: int  # the ConvRot group (int8), or the AWQ quantization group (awq_w4a16)
    full_precision: bool = False  # "full_precision_matrix_mult": dequantize, do not run the int8 GEMM

    @property
    def describe(self) -> str:
        return describe_format(self.format, self.convrot, self.group_size)

    @property
    def is_float8(self) -> bool:
        return self.format in FLOAT8_FORMATS

    @property
    def dequantized_at_load(self) -> bool:
        """FP8 and comfy-kitchen's block formats: there is no path from a file's layer of these to our int8 or FP8
        layers, so the loaders dequantize them into float weights."""
        return self.format != INT8_TENSORWISE


def describe_format(fmt: str, convrot: bool, group_size: int) -> str:
    return f"int8 ConvRot (group {group_size})" if fmt == INT8_TENSORWISE and convrot else fmt


def record_tensor(group_size: int | None, convrot: bool = True, **extra) -> torch.Tensor:
    """The `.comfy_quant` tensor ComfyUI writes for an int8_tensorwise layer."""
    record = {"format": INT8_TENSORWISE, **extra}
    if convrot:
        record.update(convrot=True, convrot_groupsize=group_size)
    return torch.tensor(list(json.dumps(record).encode("utf-8")), dtype=torch.uint8)


def parse_record(blob: torch.Tensor, path, key: str, expected: str | None = None) -> dict:
    try:
        record = json.loads(bytes(blob.flatten().to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise CheckpointError(path, f"has a {key} that is not a JSON quantization record.", expected) from None
    if not isinstance(record, dict):
        raise CheckpointError(path, f"has a {key} that is not a JSON object.", expected)
    return record


def _layer_quant(record: dict, prefix: str, path, expected) -> LayerQuant:
    key = prefix + RECORD
    fmt = record.get("format")
    if fmt not in SUPPORTED_FORMATS:
        raise CheckpointError(path, f"quantizes {prefix} as {fmt!r} ({key}), a format KV-Graph cannot read; it reads "
                                    f"ComfyUI's {INT8_TENSORWISE} (INT8 ConvRot), float8_e4m3fn / float8_e5m2 "
                                    f"(FP8 scaled) and {' / '.join(BLOCK_FORMATS)} records.", expected)
    if fmt in BLOCK_FORMATS:
        return LayerQuant(prefix=prefix, format=fmt, convrot=False, group_size=group_size(record))
    params = record.get("params") if isinstance(record.get("params"), dict) else {}
    convrot = bool(record.get("convrot", params.get("convrot", False)))
    group = record.get("convrot_groupsize", params.get("convrot_groupsize", DEFAULT_GROUP_SIZE))
    if convrot and (isinstance(group, bool) or not isinstance(group, int)):
        raise CheckpointError(path, f"has convrot_groupsize {group!r} in {key}: not an integer.", expected)
    return LayerQuant(prefix=prefix, format=fmt, convrot=convrot, group_size=int(group) if convrot else 0,
                      full_precision=bool(record.get("full_precision_matrix_mult", False)))


def read_layers(files: list[Path], header, expected: str | None = None) -> dict[str, LayerQuant]:
    """{file layer prefix: LayerQuant} for every quantized layer of a (possibly sharded) checkpoint, checked against
    the header: a record of a supported format, an int8 2-D weight, a float scale of a shape comfy-kitchen accepts
    (`[out, 1]`, `[out]`, `[1]` or a scalar) and a group size that can rotate the layer's input features. Every
    int8 weight needs a record and every scale a record. Raises CheckpointError naming the file and the key."""
    tensors = header.tensors
    path = header.path
    legacy = next((k for k in tensors if k.rsplit(".", 1)[-1] == LEGACY_FP8_MARKER), None)
    if legacy is not None:
        raise CheckpointError(path, f"is an older scaled-FP8 file ({legacy}, *.scale_weight), a format KV-Graph cannot "
                                    "read; ComfyUI's float8_e4m3fn comfy_quant files and the bf16 file load.", expected)
    records = [k for k in tensors if k.endswith(RECORD)]
    blobs = dict(iter_tensors(files, names=records)) if records else {}
    layers: dict[str, LayerQuant] = {}
    for key in sorted(records):
        prefix = key[: -len(RECORD)]
        layer = _layer_quant(parse_record(blobs[key], path, key, expected), prefix, path, expected)
        if layer.format in BLOCK_FORMATS:
            check_layer(layer.format, prefix, layer.group_size, tensors, path, expected)
            layers[prefix] = layer
            continue
        weight, scale = tensors.get(prefix + WEIGHT), tensors.get(prefix + SCALE)
        if weight is None:
            raise CheckpointError(path, f"has {key} but no {prefix + WEIGHT}.", expected)
        stored = FLOAT8_FORMATS.get(layer.format, "I8")
        if weight.dtype != stored or len(weight.shape) != 2:
            what = "an int8" if stored == "I8" else f"a {stored}"
            raise CheckpointError(path, f"has {prefix + WEIGHT} of {weight.dtype} {list(weight.shape)} where {key} "
                                        f"promises {what} [out, in] weight.", expected)
        if scale is None:
            raise CheckpointError(path, f"has no {prefix + SCALE} for the int8 weight {prefix + WEIGHT} ({key}): "
                                        "the file is incomplete.", expected)
        rows = weight.shape[0]
        if scale.dtype not in _FLOAT_DTYPES or tuple(scale.shape) not in ((rows, 1), (rows,), (1,), ()):
            raise CheckpointError(path, f"has {prefix + SCALE} of {scale.dtype} {list(scale.shape)}; expected a float "
                                        f"scale per output row [{rows}, 1] (or [{rows}], or one scalar).", expected)
        problem = group_size_problem(layer.group_size, weight.shape[1], layer.convrot)
        if problem:
            raise CheckpointError(path, f"has an unsupported ConvRot group size for {prefix} ({key}): {problem}.",
                                  expected)
        layers[prefix] = layer
    owned_sidecars = {k for layer in layers.values() for k in sidecar_keys(layer, tensors)}
    for key, info in tensors.items():
        if key in owned_sidecars:
            continue
        if key.endswith(SCALE) and key[: -len(SCALE)] not in layers:
            raise CheckpointError(path, f"has {key} without {key[: -len(SCALE)] + RECORD}: a scaled format KV-Graph "
                                        f"does not read (only {INT8_TENSORWISE} records with their scales).", expected)
        if key.endswith(INPUT_SCALE) and key[: -len(INPUT_SCALE)] not in layers:
            raise CheckpointError(path, f"has {key} without {key[: -len(INPUT_SCALE)] + RECORD}.", expected)
        if info.dtype in ("I8", "U8") and not key.endswith(RECORD) and not (
                key.endswith(WEIGHT) and key[: -len(WEIGHT)] in layers):
            raise CheckpointError(path, f"has the {info.dtype} tensor {key} without a quantization record "
                                        f"({key.rsplit('.', 1)[0] + RECORD}).", expected)
    return layers


def sidecar_keys(layer: LayerQuant, tensors) -> list[str]:
    """The file keys that belong to the layer besides its weight: the record, the scales, optional input scales."""
    keys = [layer.prefix + RECORD, layer.prefix + SCALE, layer.prefix + INPUT_SCALE]
    if layer.format in BLOCK_FORMATS:
        keys += sidecars(layer.format, layer.prefix, tensors).values()
    return [k for k in keys if k in tensors]


def weight_shape(layer: LayerQuant, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The float weight's shape for a layer stored as `stored` (packed 4-bit formats hold two values a byte)."""
    return logical_shape(layer.format, stored) if layer.format in BLOCK_FORMATS else stored


def check_scale(scale: torch.Tensor, path, key: str, expected: str | None = None) -> None:
    """A layer's scales must be finite and not all zero: all-zero scales dequantize the whole layer to zero (and
    NaN/inf ones to NaN), which no quantizer writes for a trained layer, so the file is damaged."""
    if not bool(torch.isfinite(scale).all()):
        raise CheckpointError(path, f"has NaN or infinite values in {key}: a damaged file.", expected)
    if not bool(scale.any()):
        raise CheckpointError(path, f"has all-zero scales in {key}: every weight of that layer would be 0, which no "
                                    "quantizer writes for a trained layer (a damaged or wrongly converted file).",
                              expected)


def first_record_format(files: list[Path], header) -> str | None:
    """What the first quantization record in the file says, for detection ("int8 ConvRot (group 256)",
    "nvfp4", ...); None without records."""
    key = next((k for k in sorted(header.tensors) if k.endswith(RECORD)), None)
    if key is None:
        return None
    try:
        record = parse_record(dict(iter_tensors(files, names=[key]))[key], header.path, key)
    except CheckpointError:
        return "unreadable comfy_quant record"
    params = record.get("params") if isinstance(record.get("params"), dict) else {}
    convrot = bool(record.get("convrot", params.get("convrot", False)))
    group = record.get("convrot_groupsize", params.get("convrot_groupsize", DEFAULT_GROUP_SIZE))
    return describe_format(str(record.get("format")), convrot, group)
