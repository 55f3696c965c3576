"""ComfyUI's own LoRA loaders (LoraLoader's model side, LoraLoaderModelOnly, stacks of them) on the pack's MODEL.

Core's loader reads the file, maps its keys to the MODEL's weights (`comfy.lora.model_lora_keys_unet` over the
MODEL's state dict: `diffusion_model.<diffusers name>` and `lora_unet_<name with underscores>`) and calls
`add_patches({weight key: adapter}, strength)` on a clone. ComfyUI would then write the patched weights itself when it
loads the model: into new tensors (0.8.0) or on each cast while streaming (0.33.0's dynamic VRAM), never at the
addresses the captured graphs read. So the MODEL takes the patches as one more entry of its LoRA chain instead, merged
in place by its runs exactly as a KV-Graph Load LoRA node's file is (graph_runtime/lora), restored bit for bit when
the chain changes; graphs keep replaying.

What cannot be merged that way is refused when the loader runs, naming what it is: other adapter kinds (LoHa, LoKr,
OFT, ...), DoRA and LoCon mid weights, weight replacements, and model merging (which scales the weights themselves).
"""

from __future__ import annotations

import comfy.weight_adapter

from ...graph_runtime.errors import KVGraphError
from ...graph_runtime.lora import LoraChoice, WeightPatch
from ...graph_runtime.lora.in_memory import lora_from_patches

MODEL_PREFIX = "diffusion_model."  # core's key for the MODEL's transformer weights
LABEL = "a LoRA from core's LoRA loader"
USE_KVGRAPH = ("Load it with KV-Graph Load LoRA instead, which reads PEFT/diffusers, kohya, DiffSynth, LyCORIS and "
               "ComfyUI's fused layouts and merges the same way.")
MERGING_REFUSED = ("KV-Graph: model merging nodes cannot patch a KV-Graph MODEL: they scale its weights, which its "
                   "captured graphs read in place. Core LoRA loaders and KV-Graph Load LoRA work on it.")


def core_lora_choice(transformer, patches: dict, strength_patch: float, strength_model: float):
    """(LoraChoice, the keys taken) for what a core LoRA loader hands `ModelPatcher.add_patches`. Keys that name no
    weight of the transformer are left out, as core's own `add_patches` leaves them (core logs them: "NOT LOADED");
    a LoRA of which nothing is left, or whose MLP would be merged in part, is refused."""
    if strength_model != 1.0 or any(isinstance(value, list) for value in patches.values()):
        raise KVGraphError(MERGING_REFUSED)
    params = {name for name, _ in transformer.named_parameters()}
    changes: dict[str, list[WeightPatch]] = {}
    taken = []
    for key, value in patches.items():
        if not isinstance(key, str):  # (key, offset[, function]): a change to part of a fused weight
            raise KVGraphError(f"KV-Graph: core's LoRA loader asked to patch part of {key[0]!r}, which the KV-Graph "
                               f"MODEL cannot merge. {USE_KVGRAPH}")
        name = key[len(MODEL_PREFIX):] if key.startswith(MODEL_PREFIX) else None
        if name not in params:
            continue
        changes.setdefault(name, []).append(_weight_patch(key, value))
        taken.append(key)
    if not changes:
        raise KVGraphError("KV-Graph: core's LoRA loader matched none of this LoRA's keys to the KV-Graph MODEL's "
                           "weights (on this MODEL it maps `diffusion_model.<layer>` and `lora_unet_<layer>` names of "
                           f"diffusers' Qwen-Image-2.1 layers; see ComfyUI's log for the keys it did not load). "
                           f"{USE_KVGRAPH}")
    _check_whole_mlp(changes)
    return LoraChoice(lora_from_patches(LABEL, changes, transformer), float(strength_patch)), taken


def _weight_patch(key: str, value) -> WeightPatch:
    if isinstance(value, comfy.weight_adapter.WeightAdapterBase):
        kind, weights = value.name, value.weights
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):  # ("diff", (tensor, ...))
        kind, weights = value
    else:
        raise KVGraphError(f"KV-Graph: a core node asked to patch {key!r} with a {type(value).__name__}, which the "
                           f"KV-Graph MODEL cannot merge in place. {USE_KVGRAPH}")
    if kind == "lora":
        up, down, alpha, mid, dora_scale, reshape = weights[:6]
        extra = [what for what, present in (("LoCon mid weights", mid), ("DoRA scales", dora_scale),
                                            ("a weight reshape", reshape)) if present is not None]
        if extra:
            raise KVGraphError(f"KV-Graph: this LoRA has {' and '.join(extra)} (on {key!r}), which the KV-Graph "
                               f"MODEL does not merge. {USE_KVGRAPH}")
        # core's math: up @ down times alpha / rank (1 without an alpha) times the strength.
        scale = 1.0 if alpha is None else float(alpha) / down.shape[0]
        return WeightPatch(up=up, down=down, scale=scale)
    if kind == "diff" and weights and hasattr(weights[0], "shape"):
        return WeightPatch(diff=weights[0])
    what = {"set": "a weight replacement (set_weight)"}.get(kind, f"a {kind} adapter")
    raise KVGraphError(f"KV-Graph: this LoRA patches {key!r} with {what}, which the KV-Graph MODEL does not merge "
                       f"(it merges LoRA pairs and weight differences). {USE_KVGRAPH}")


def _check_whole_mlp(changes: dict) -> None:
    """A block whose MLP output projection is patched while neither input projection is: the file addresses
    ComfyUI's fused `img_mlp.gate_up`, which core's loader cannot map onto this MODEL's separate gate and up
    weights (its log lists the keys). Merged, the LoRA would be applied in part."""
    for name in changes:
        if name.endswith(".img_mlp.out.weight"):
            block = name[: -len("out.weight")]
            if f"{block}gate_layer.weight" not in changes and f"{block}proj.weight" not in changes:
                raise KVGraphError(
                    f"KV-Graph: this LoRA changes {block}out but not that MLP's gate and up projections: it was made "
                    "for ComfyUI's fused `img_mlp.gate_up` weight, which core's LoRA loader cannot map onto the "
                    "KV-Graph MODEL (its log lists those keys as not loaded), so it would merge in part. "
                    f"{USE_KVGRAPH}")
