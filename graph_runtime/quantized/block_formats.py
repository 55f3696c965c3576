"""comfy-kitchen's block formats in ComfyUI mixed-precision files: W4A16/AWQ, NVFP4 and MXFP8 records, read and
dequantized at load with comfy-kitchen's own layouts (the loaders then treat them as a float file's weights).

Each layer `P` carries `P.weight` plus the sidecars its format names (the tensors ComfyUI's `comfy/ops.py` pops):

- `awq_w4a16`: `P.weight` int8 `[N, K/2]` (two uint4 a byte), `P.weight_scale` and `P.weight_zero` (or
  `P.weight_zeros`) `[K/G, N]`; `(q - 8) * scale + zero`, the group G from the record (default 64);
- `nvfp4`: `P.weight` uint8 `[N, K/2]` (two e2m1 a byte), `P.weight_scale` e4m3 block scales (16 weights, cuBLAS'
  swizzled layout), `P.weight_scale_2` fp32; `e2m1 * block scale * weight_scale_2`;
- `mxfp8`: `P.weight` e4m3 `[N, K]`, `P.weight_scale` e8m0 block scales (32 weights, swizzled); `e4m3 * 2^e`.

`input_scale` (an activation scale) is not needed once the weight is float; an NVFP4 `pre_quant_scale` (AWQ-style
smoothing: ComfyUI multiplies the input by it) is folded into the weight's columns. Every check here runs on the
header, before a weight is read, so a bad file fails naming the file and the key.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from .kitchen import require

AWQ_W4A16, NVFP4, MXFP8 = "awq_w4a16", "nvfp4", "mxfp8"
BLOCK_FORMATS = (AWQ_W4A16, NVFP4, MXFP8)
LABELS = {AWQ_W4A16: "W4A16/AWQ", NVFP4: "NVFP4", MXFP8: "MXFP8"}
# The oldest comfy-kitchen these were checked with (the one ComfyUI 0.33.0 pins): its three layouts dequantize on
# the CPU as on the GPU.
BLOCK_LAYOUTS = "0.2.31"
AWQ_DEFAULT_GROUP = 64  # what ComfyUI assumes when the record names none
SCALE, SCALE_2, ZERO, ZEROS = ".weight_scale", ".weight_scale_2", ".weight_zero", ".weight_zeros"
PRE_QUANT_SCALE = ".pre_quant_scale"
_WEIGHT_DTYPES = {AWQ_W4A16: ("I8", "U8"), NVFP4: ("U8",), MXFP8: ("F8_E4M3",)}
_FLOAT = ("F32", "BF16", "F16")


def group_size(record: dict) -> int:
    params = record.get("params") if isinstance(record.get("params"), dict) else {}
    return record.get("group_size", params.get("group_size", AWQ_DEFAULT_GROUP))


def logical_shape(fmt: str, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The float weight's shape: packed formats hold two values a byte."""
    rows, cols = stored
    return (rows, cols * 2) if fmt in (AWQ_W4A16, NVFP4) else (rows, cols)


def sidecars(fmt: str, prefix: str, tensors) -> dict[str, str]:
    """{role: file key} of the layer's sidecars present in the file (`zero` is whichever spelling the file uses)."""
    names = {"scale": prefix + SCALE}
    if fmt == NVFP4:
        names["scale_2"] = prefix + SCALE_2
        if prefix + PRE_QUANT_SCALE in tensors:
            names["pre_quant_scale"] = prefix + PRE_QUANT_SCALE
    if fmt == AWQ_W4A16:
        names["zero"] = prefix + (ZERO if prefix + ZERO in tensors else ZEROS)
    return names


def check_layer(fmt: str, prefix: str, group: int, tensors, path, expected) -> None:
    """The weight's dtype and 2-D shape, each sidecar present with a shape that fits it, a usable AWQ group size."""
    record = prefix + ".comfy_quant"
    weight = tensors.get(prefix + ".weight")
    if weight is None:
        raise CheckpointError(path, f"has {record} but no {prefix}.weight.", expected)
    if weight.dtype not in _WEIGHT_DTYPES[fmt] or len(weight.shape) != 2:
        raise CheckpointError(path, f"has {prefix}.weight of {weight.dtype} {list(weight.shape)} where {record} "
                                    f"promises a {fmt} weight ({' or '.join(_WEIGHT_DTYPES[fmt])}, 2-D).", expected)
    names = sidecars(fmt, prefix, tensors)
    missing = [key for key in names.values() if key not in tensors]
    if missing:
        what = " / ".join(prefix + s for s in (ZERO, ZEROS)) if fmt == AWQ_W4A16 and names["zero"] in missing else \
            missing[0]
        raise CheckpointError(path, f"has no {what} for the {fmt} layer {prefix} ({record}): the file is "
                                    "incomplete.", expected)
    rows, cols = logical_shape(fmt, tuple(weight.shape))
    if fmt == AWQ_W4A16:
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or cols % group:
            raise CheckpointError(path, f"has group_size {group!r} in {record}: not a positive divisor of the "
                                        f"layer's {cols} input features.", expected)
        for role in ("scale", "zero"):
            info = tensors[names[role]]
            if info.dtype not in _FLOAT or tuple(info.shape) != (cols // group, rows):
                raise CheckpointError(path, f"has {names[role]} of {info.dtype} {list(info.shape)}; expected a float "
                                            f"[{cols // group}, {rows}] (input groups of {group}, output rows).",
                                      expected)
    if fmt == NVFP4:
        info = tensors[names["scale_2"]]
        if info.dtype not in _FLOAT or int(torch.Size(info.shape).numel()) != 1:
            raise CheckpointError(path, f"has {names['scale_2']} of {info.dtype} {list(info.shape)}; expected one "
                                        "float (the tensor's scale).", expected)
        pre = names.get("pre_quant_scale")
        if pre is not None and (tensors[pre].dtype not in _FLOAT or tuple(tensors[pre].shape) != (cols,)):
            raise CheckpointError(path, f"has {pre} of {tensors[pre].dtype} {list(tensors[pre].shape)}; expected a "
                                        f"float [{cols}] (one per input feature).", expected)
    if fmt in (NVFP4, MXFP8):
        block = 16 if fmt == NVFP4 else 32
        info = tensors[names["scale"]]
        blocks = rows * (cols // block)
        if (info.dtype not in ("F8_E4M3", "F8_E8M0", "U8") or cols % block
                or int(torch.Size(info.shape).numel()) < blocks):
            raise CheckpointError(path, f"has {names['scale']} of {info.dtype} {list(info.shape)}; expected "
                                        f"{'e4m3' if fmt == NVFP4 else 'e8m0'} block scales, one per {block} weights "
                                        f"of the [{rows}, {cols}] weight.", expected)


def dequantize(fmt: str, weight: torch.Tensor, parts: dict[str, torch.Tensor], group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The layer's float weight in `dtype`, by comfy-kitchen's own dequantization of its layout (on the tensors'
    device: the loaders pass the GPU when there is one)."""
    require(f"Reading a {LABELS[fmt]} layer", BLOCK_LAYOUTS)
    from comfy_kitchen.tensor import TensorCoreAWQW4A16Layout, TensorCoreMXFP8Layout, TensorCoreNVFP4Layout

    shape = logical_shape(fmt, tuple(weight.shape))
    if fmt == AWQ_W4A16:
        params = TensorCoreAWQW4A16Layout.Params(scale=parts["scale"].to(dtype), zeros=parts["zero"].to(dtype),
                                                 orig_dtype=dtype, orig_shape=shape, group_size=group)
        return TensorCoreAWQW4A16Layout.dequantize(weight.view(torch.int8), params)
    if fmt == NVFP4:
        params = TensorCoreNVFP4Layout.Params(scale=parts["scale_2"].float().reshape(()),
                                              block_scale=parts["scale"].view(torch.float8_e4m3fn),
                                              orig_dtype=dtype, orig_shape=shape)
        out = TensorCoreNVFP4Layout.dequantize(weight, params)[: shape[0], : shape[1]]
        pre = parts.get("pre_quant_scale")
        # ComfyUI scales the input by it before the matmul: the same as scaling the weight's columns
        return out if pre is None else (out.float() * pre.float()).to(dtype)
    params = TensorCoreMXFP8Layout.Params(scale=parts["scale"].view(torch.float8_e8m0fnu), orig_dtype=dtype,
                                          orig_shape=shape)
    return TensorCoreMXFP8Layout.dequantize(weight, params)[: shape[0], : shape[1]]
