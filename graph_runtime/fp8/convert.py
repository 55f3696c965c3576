"""Precision of the transformer blocks' Linears: bf16 (as loaded) or FP8, whole or by group.

Groups, per block: `qkv` (attn.to_q/k/v), `out` (attn.to_out), `mlp_in` (img_mlp.gate_layer, img_mlp.proj) and
`mlp_down` (img_mlp.out): together 98% of the decode step's FLOPs. The embeddings, the modulation and the final
projection stay in the model's dtype. Precisions:

- `auto` (the default): resolved at load to one of the others (auto.py).
- `bf16`: nothing converted.
- `fp8`: every group.
- `fp8-attn`: the attention's Linears only, the MLP kept bf16 (the group others found most sensitive to FP8).
- `fp8-no-out`: every group but `to_out`, whose input is the attention output that none of our kernels produce
  (FP8 there costs one small quantization pass; this measures it).
- `fp8:<groups>`: the listed groups, e.g. `fp8:qkv,mlp_down` (to find which groups tolerate FP8).
- `int8`: every group as INT8 ConvRot W8A8 (group 256, per-channel weight scales), quantized at load as ComfyUI's
  INT8 files are made, run on our INT8 GEMM; an INT8 file keeps its own int8 weights.

`apply_precision` converts in place and frees the float weights (the product's switch, at load); `block_linears` and
`install` are its two halves, which the benchmark also uses to swap quantized copies in beside the float weights.
"""

from __future__ import annotations

import time

import torch

from ..errors import InputError
from ..quantized.int8_convrot import ConvRotInt8Linear, is_int8_linear
from .precisions import AUTO, GROUPS, INT8, PRECISIONS, groups_of
from .linear import Fp8Linear, is_fp8_linear

INT8_GROUP = 256  # the ConvRot group ComfyUI's INT8 files use, and the one our fused kernels rotate

def linear_names(precision: str) -> list[str]:
    """Dotted names, inside a block, of the Linears `precision` converts."""
    return [name for group in groups_of(precision) for name in GROUPS[group]]


def _slot(block: torch.nn.Module, dotted: str) -> tuple[torch.nn.Module, str]:
    *path, leaf = dotted.split(".")
    parent = block
    for part in path:
        parent = getattr(parent, part)
    return parent, leaf


def module_at(block: torch.nn.Module, dotted: str) -> torch.nn.Module:
    parent, leaf = _slot(block, dotted)
    return getattr(parent, leaf)


def block_linears(transformer, precision: str) -> dict[tuple[int, str], torch.nn.Linear]:
    """The float Linears `precision` converts, by (block index, dotted name); each checked convertible."""
    modules = {}
    for i, block in enumerate(transformer.transformer_blocks):
        for name in linear_names(precision):
            linear = module_at(block, name)
            if type(linear) is not torch.nn.Linear:
                raise InputError(f"transformer_blocks.{i}.{name}", type(linear).__name__,
                                 "a plain torch.nn.Linear to quantize (this one is already converted or wrapped)")
            if linear.in_features % 16 or linear.out_features % 16:
                raise InputError(f"transformer_blocks.{i}.{name}", (linear.out_features, linear.in_features),
                                 "FP8 GEMM dimensions that are multiples of 16")
            modules[(i, name)] = linear
    return modules


def install(transformer, modules: dict) -> dict:
    """Put `modules` in their block slots; returns the modules they replaced, by the same keys."""
    replaced = {}
    blocks = transformer.transformer_blocks
    for (i, name), module in modules.items():
        parent, leaf = _slot(blocks[i], name)
        replaced[(i, name)] = getattr(parent, leaf)
        setattr(parent, leaf, module)
    return replaced


def int8_group(in_features: int) -> int:
    """ComfyUI's ConvRot group (256) where it divides the layer's input, else the largest power of 4 that does (small
    test models); those layers run through comfy-kitchen, since our kernels rotate groups of 256 only."""
    group = INT8_GROUP
    while group > 4 and in_features % group:
        group //= 4
    return group


def int8_factory(device=None):
    """Quantizes a float Linear to INT8 ConvRot on `device` (a GPU rotates a 7 B model's weights in seconds where the
    CPU takes minutes) and leaves the int8 weight where the Linear was."""
    def factory(linear):
        home = linear.weight.device
        work = torch.nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        work.weight = torch.nn.Parameter(linear.weight.detach().to(device or home), requires_grad=False)
        layer = ConvRotInt8Linear.from_linear(work, int8_group(linear.in_features))
        layer.bias = linear.bias
        return layer.to(home)

    return factory


def apply_precision(transformer, precision: str, device=None) -> dict:
    """Convert the block Linears to `precision` in place; their float weights are freed. Returns what was done.
    `device`: where `int8` quantizes (default: where the weights are)."""
    if precision == AUTO:
        raise InputError("precision", precision, "a precision resolved for the device and weights first "
                                                 "(resolve_precision)")
    start = time.perf_counter()
    before = _block_linear_bytes(transformer)
    factory = int8_factory(device) if precision == INT8 else Fp8Linear.from_linear
    modules = {}
    for (i, name), linear in block_linears(transformer, precision).items():
        modules[(i, name)] = factory(linear)
        install(transformer, {(i, name): modules[(i, name)]})  # one at a time: the float weight is freed as we go
    return {"precision": precision, "linears": len(modules), "block_linear_bytes_before": before,
            "block_linear_bytes_after": _block_linear_bytes(transformer),
            "seconds": round(time.perf_counter() - start, 2)}


def precision_of(transformer) -> str:
    """`int8` when every block Linear is int8 (an INT8 file kept int8, or a float file quantized at load), else the
    precision whose groups are exactly the FP8 ones (read off the first block), else `fp8:<groups>`."""
    block = transformer.transformer_blocks[0]
    if all(is_int8_linear(module_at(block, n)) for names in GROUPS.values() for n in names):
        return INT8
    converted = {group for group, names in GROUPS.items() if all(is_fp8_linear(module_at(block, n)) for n in names)}
    for name, groups in PRECISIONS.items():
        if name != INT8 and converted == set(groups):
            return name
    return "fp8:" + ",".join(g for g in GROUPS if g in converted)


def _block_linear_bytes(transformer) -> int:
    total = 0
    for block in transformer.transformer_blocks:
        for names in GROUPS.values():
            for name in names:
                module = module_at(block, name)
                total += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    return total
