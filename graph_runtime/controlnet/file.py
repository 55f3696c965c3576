"""The Fun ControlNet Union file of Qwen-Image-2.1 in its released (ComfyUI native) key layout, read and written.

Keys (D = model width, H = MLP width, d = head size, N control blocks):
    control_img_in.weight [D, 129], control_img_in.bias [D]
    control_blocks.0.before_proj.weight [D, D], .bias [D]
    control_blocks.{j}.after_proj.weight [D, D], .bias [D]
    control_blocks.{j}.attn.to_q / to_k / to_v / to_out.0 .weight [D, D]
    control_blocks.{j}.attn.norm_q / norm_k .weight [d]
    control_blocks.{j}.img_mlp.gate_up.weight [2H, D] (gate rows first), or img_mlp.gate_layer / img_mlp.proj
        .weight [H, D] each; control_blocks.{j}.img_mlp.out.weight [D, H]
Every other key, a missing key, a wrong shape or a quantized layer (`.weight_scale` / `.comfy_quant`) is refused with
the file and the key named: a file that matched only in part would run a different network without saying so.
"""

from __future__ import annotations

import os
import re

import torch

from ..errors import CheckpointError
from ..safetensors_file import iter_tensors, read_header
from .model import CONTROL_CHANNELS, FunControlNet

EXPECTED = ("a Qwen-Image-2.1 Fun ControlNet Union file (keys control_img_in.* and control_blocks.N.*, as ComfyUI's "
            "Load Model Patch reads it)")
_BLOCK_KEY = re.compile(r"control_blocks\.(\d+)\.(.+)")


def _block_shapes(dim: int, head_dim: int, hidden: int, fused: bool, first: bool) -> dict[str, tuple]:
    shapes = {f"attn.{name}.weight": (dim, dim) for name in ("to_q", "to_k", "to_v", "to_out.0")}
    shapes.update({"attn.norm_q.weight": (head_dim,), "attn.norm_k.weight": (head_dim,),
                   "img_mlp.out.weight": (dim, hidden), "after_proj.weight": (dim, dim), "after_proj.bias": (dim,)})
    if fused:
        shapes["img_mlp.gate_up.weight"] = (2 * hidden, dim)
    else:
        shapes.update({"img_mlp.gate_layer.weight": (hidden, dim), "img_mlp.proj.weight": (hidden, dim)})
    if first:
        shapes.update({"before_proj.weight": (dim, dim), "before_proj.bias": (dim,)})
    return shapes


def expected_shapes(shapes: dict[str, tuple], path) -> tuple[dict[str, tuple], dict]:
    """The full key -> shape map a file with these `control_img_in` / block-0 shapes must have, and its config."""
    for key in ("control_img_in.weight", "control_blocks.0.attn.norm_q.weight", "control_blocks.0.img_mlp.out.weight"):
        if key not in shapes:
            if any(k.endswith((".weight_scale", ".comfy_quant")) for k in shapes):
                raise CheckpointError(path, "is a quantized file.", "the bf16 (or fp16/fp32) Fun ControlNet file")
            raise CheckpointError(path, f"has no key {key!r}.", EXPECTED)
    in_shape = shapes["control_img_in.weight"]
    if len(in_shape) != 2 or in_shape[1] != CONTROL_CHANNELS:
        raise CheckpointError(path, f"key 'control_img_in.weight' has shape {list(in_shape)}.",
                              f"[width, {CONTROL_CHANNELS}]: the Union model's 129 control channels (control latents, "
                              "mask, inpaint latents); other Fun ControlNet variants are not supported")
    dim = in_shape[0]
    head_dim = shapes["control_blocks.0.attn.norm_q.weight"][0]
    hidden = shapes["control_blocks.0.img_mlp.out.weight"][-1]
    fused = "control_blocks.0.img_mlp.gate_up.weight" in shapes
    if dim % head_dim or hidden % dim:
        raise CheckpointError(path, f"has width {dim}, head size {head_dim} and MLP width {hidden}.",
                              "a width that is a multiple of the head size and of which the MLP width is a multiple")
    count = 0
    while f"control_blocks.{count}.after_proj.weight" in shapes:
        count += 1
    if count == 0:
        raise CheckpointError(path, "has no key 'control_blocks.0.after_proj.weight'.", EXPECTED)
    want = {"control_img_in.weight": (dim, CONTROL_CHANNELS), "control_img_in.bias": (dim,)}
    for j in range(count):
        for name, shape in _block_shapes(dim, head_dim, hidden, fused, j == 0).items():
            want[f"control_blocks.{j}.{name}"] = shape
    config = dict(num_blocks=count, inner_dim=dim, head_dim=head_dim, mlp_ratio=hidden // dim)
    return want, config


def check_shapes(shapes: dict[str, tuple], path) -> dict:
    """The config of a file with these key shapes, or a CheckpointError naming the first key that does not match."""
    want, config = expected_shapes(shapes, path)
    for key in sorted(shapes):
        if key not in want:
            if key.endswith((".weight_scale", ".comfy_quant")):
                raise CheckpointError(path, f"has a quantized layer ({key!r}).",
                                      "the bf16 (or fp16/fp32) Fun ControlNet file")
            raise CheckpointError(path, f"has an unexpected key {key!r} for a {config['num_blocks']}-block file.",
                                  EXPECTED)
    for key, shape in want.items():
        if key not in shapes:
            raise CheckpointError(path, f"has no key {key!r}.", EXPECTED)
        if tuple(shapes[key]) != shape:
            raise CheckpointError(path, f"key {key!r} has shape {list(shapes[key])}.", f"shape {list(shape)}")
    return config


def to_module_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """File keys -> `FunControlNet` keys (the fused MLP split into diffusers' gate_layer / proj, gate rows first)."""
    out = {}
    for key, value in tensors.items():
        match = _BLOCK_KEY.fullmatch(key)
        if match is None:
            out[key] = value
            continue
        j, name = match.groups()
        if name.startswith("before_proj."):
            out[name] = value
        elif name.startswith("after_proj."):
            out[f"after_proj.{j}.{name.removeprefix('after_proj.')}"] = value
        elif name == "img_mlp.gate_up.weight":
            gate, up = value.chunk(2, dim=0)
            out[f"blocks.{j}.img_mlp.gate_layer.weight"] = gate
            out[f"blocks.{j}.img_mlp.proj.weight"] = up
        else:
            out[f"blocks.{j}.{name}"] = value
    return out


def to_file_state_dict(net: FunControlNet, fused: bool = True) -> dict[str, torch.Tensor]:
    """`FunControlNet` -> the released file layout (the reverse of `to_module_state_dict`)."""
    out = {}
    for key, value in net.state_dict().items():
        parts = key.split(".")
        if parts[0] == "before_proj":
            out[f"control_blocks.0.{key}"] = value
        elif parts[0] == "after_proj":
            out[f"control_blocks.{parts[1]}.after_proj.{parts[2]}"] = value
        elif parts[0] == "blocks":
            j, name = parts[1], ".".join(parts[2:])
            if fused and name == "img_mlp.proj.weight":
                continue
            if fused and name == "img_mlp.gate_layer.weight":
                up = net.state_dict()[f"blocks.{j}.img_mlp.proj.weight"]
                out[f"control_blocks.{j}.img_mlp.gate_up.weight"] = torch.cat([value, up], dim=0)
            else:
                out[f"control_blocks.{j}.{name}"] = value
        else:
            out[key] = value
    return out


def load_fun_controlnet(path: str | os.PathLike, dtype: torch.dtype | None = None) -> FunControlNet:
    """Read a Fun ControlNet Union file (checked key by key before any data is read) into a `FunControlNet` on the
    CPU, in the file's dtype unless `dtype` is given."""
    header = read_header(path, EXPECTED)
    config = check_shapes(header.shapes, header.path)
    tensors = dict(iter_tensors([header.path], dtype=dtype))
    state = to_module_state_dict(tensors)
    with torch.device("meta"):
        net = FunControlNet(**config, name=os.path.basename(os.fspath(path)))
    net.load_state_dict(state, assign=True, strict=True)
    return net
