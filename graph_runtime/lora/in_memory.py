"""A LoRA handed over as tensors already in memory, not as a file: ComfyUI's own LoRA loaders read the file and map
its keys to the model's weights themselves, and the MODEL turns what they hand it into one of these (see
nodes/comfyui/core_lora.py). It is checked against the loaded transformer as a file is, and merged in place by the
same `LoraMerge` as a KV-Graph Load LoRA node's file.

Identity: the tensors themselves. The `LoraFile` holds them, so while it is alive (the merged set holds its choices)
no other tensor can have their ids; the same tensors handed over again (ComfyUI's loader keeps the file it read) are
the same LoRA and merge nothing new.
"""

from __future__ import annotations

import math

import torch

from ..errors import CheckpointError, shorten
from .file import LoraFile, WeightPatch

EXPECTED = "LoRA pairs or weight differences whose shapes match the Qwen-Image-2.1 transformer's weights"


def lora_from_patches(label: str, patches: dict[str, list[WeightPatch]], transformer: torch.nn.Module) -> LoraFile:
    """`patches` (parameter name of `transformer` -> its changes) as a LoRA the merge takes; `label` names it in
    messages and the status. Raises CheckpointError naming `label` and the weight when a change does not fit."""
    shapes = {name: tuple(p.shape) for name, p in transformer.named_parameters()}
    for name, items in patches.items():
        if name not in shapes:
            raise CheckpointError(label, f"changes {shorten(repr(name))}, which the transformer does not have.",
                                  EXPECTED)
        for patch in items:
            _check(label, name, patch, shapes[name])
    identity = ("in memory", label, tuple(sorted(
        (name, tuple((id(p.up), id(p.down), id(p.diff), p.scale) for p in items)) for name, items in patches.items())))
    return LoraFile(path=label, identity=identity, patches=dict(patches))


def _check(label: str, name: str, patch: WeightPatch, shape: tuple[int, ...]) -> None:
    tensors = [t for t in (patch.up, patch.down, patch.diff) if t is not None]
    if not math.isfinite(patch.scale):
        raise CheckpointError(label, f"has an alpha that is not a finite number for {name!r}: a damaged file.",
                              EXPECTED)
    if patch.diff is not None:
        if tuple(patch.diff.shape) != shape:
            raise CheckpointError(label, f"has a difference of shape {list(patch.diff.shape)} for {name!r}, which has "
                                         f"{list(shape)}: a LoRA for a model of another size?", EXPECTED)
    else:
        up, down = patch.up, patch.down
        if (up is None or down is None or up.dim() != 2 or down.dim() != 2 or len(shape) != 2
                or up.shape[1] != down.shape[0] or (up.shape[0], down.shape[1]) != shape):
            found = [list(t.shape) for t in (up, down) if t is not None]
            raise CheckpointError(label, f"has factors {found} for {name!r} that do not make a {list(shape)} weight: "
                                         "a LoRA for a model of another size?", EXPECTED)
        if down.shape[0] == 0:
            raise CheckpointError(label, f"has a rank-0 pair for {name!r}: the file is damaged or empty.", EXPECTED)
    # Merged, a NaN would turn the model's output NaN, and the sampler could only blame the weights.
    if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors):
        raise CheckpointError(label, f"has NaN or infinite values for {name!r}: a damaged file.", EXPECTED)
