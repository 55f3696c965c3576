"""How LoRA files name the layers they change, and which of our transformer's weights each name means.

The layouts Qwen-Image-2.1 LoRAs are published and trained in (each has a tiny synthetic file in
tests/test_lora_files.py):

- PEFT / diffusers: `transformer.<module>.lora_A.weight` and `.lora_B.weight`; the alpha, when there is one, in the
  file's `lora_adapter_metadata` (what diffusers' `save_lora_weights` writes), else none (scale 1).
- kohya / ComfyUI: `diffusion_model.<module>.lora_down.weight`, `.lora_up.weight` and `.alpha`; the same with
  underscored names (`lora_unet_transformer_blocks_0_attn_to_q`), and LyCORIS' `lycoris_` names.
- DiffSynth-Studio: `<module>.lora_A.default.weight` (PEFT's adapter name left in the key), no prefix.
- ComfyUI stores the SwiGLU gate and up projections fused as `img_mlp.gate_up` (gate rows first); a LoRA trained
  on that weight is split by rows onto diffusers' `gate_layer` and `proj`, which LoRAs can also address directly.
- Full weight differences: `<module>.diff` (any weight, 2-D or a norm's 1-D scale); `.diff_b` would change a
  bias, and this model has none.

The module names are diffusers' `QwenImage21Transformer2DModel` names, which ComfyUI's single file uses too (with
`model.diffusion_model.` in front and the fused MLP); the lookup table is built from the loaded model itself, so it
covers exactly the weights that exist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

# What a key's last part says it is. Longer suffixes first: `.lora_A.default.weight` also ends like others.
DOWN, UP, ALPHA, DIFF, DIFF_BIAS = "down", "up", "alpha", "diff", "diff_b"
SUFFIXES = (
    (".lora_A.default.weight", DOWN), (".lora_B.default.weight", UP),
    (".lora_A.weight", DOWN), (".lora_B.weight", UP),
    (".lora_down.weight", DOWN), (".lora_up.weight", UP),
    (".lora.down.weight", DOWN), (".lora.up.weight", UP),
    (".alpha", ALPHA), (".diff_b", DIFF_BIAS), (".diff", DIFF),
)

# Prefixes in front of a dotted module name, and in front of an underscored one.
DOTTED_PREFIXES = ("", "transformer.", "diffusion_model.", "model.diffusion_model.", "base_model.model.",
                   "transformer.base_model.model.")
FLAT_PREFIXES = ("lora_unet_", "lycoris_", "lora_transformer_")

FUSED_MLP, GATE, UP_PROJ = "img_mlp.gate_up", "img_mlp.gate_layer", "img_mlp.proj"

# Adapter kinds other than a plain low-rank pair or a difference: merging them needs other math, so a file using one
# is refused by name rather than merged wrong.
UNSUPPORTED = (
    (".dora_scale", "DoRA (weight-decomposed LoRA)"),
    (".lora_magnitude_vector", "DoRA (weight-decomposed LoRA)"),
    (".lora_mid.", "LoCon/Tucker mid weights (a convolution LoRA)"),
    (".hada_w", "LyCORIS LoHa"),
    (".lokr_", "LyCORIS LoKr"),
    (".oft_", "OFT"),
    (".w_norm", "norm weights in ComfyUI's w_norm layout"),
)

# Key fragments (dots as underscores, lower case) that only another model's LoRA has, most specific first. They are
# read only when some key matched nothing, to say what the file was made for.
FOREIGN_MODELS = (
    ("FLUX", ("double_blocks", "single_blocks", "single_transformer_blocks", "ff_context", "x_embedder",
              "context_embedder", "norm1_context")),
    ("Stable Diffusion 3", ("joint_blocks", "context_block")),
    ("Qwen-Image 1.x (the dual-stream model: img_mod/txt_mod, txt_mlp and add_q_proj/to_add_out per block)",
     ("img_mod", "txt_mod", "txt_mlp", "img_mlp_net", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
      "txt_norm1")),
    ("Stable Diffusion 1.x / SDXL", ("down_blocks", "up_blocks", "mid_block", "input_blocks", "output_blocks",
                                     "middle_block", "lora_te1_", "lora_te2_", "text_model")),
    # A language model's layer names (a LoRA for a text encoder, e.g. ComfyUI's lora_te_ keys): before Wan, whose
    # blocks also have self_attn, but never q_proj/gate_proj under it.
    ("a text encoder (language-model layers such as self_attn.q_proj and mlp.gate_proj)",
     ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_o_proj", "mlp_gate_proj",
      "mlp_up_proj", "mlp_down_proj", "lora_te_", "text_encoder")),
    ("Wan", ("self_attn", "cross_attn")),
    ("Z-Image / Lumina 2", ("noise_refiner", "context_refiner", "adaln_modulation")),
)


@dataclass(frozen=True)
class Target:
    """One weight a LoRA key changes: the parameter, and which of the LoRA's output rows land in it (a fused
    gate_up LoRA's rows are split between two weights; None: all of them)."""

    param: str
    rows: slice | None = None


def split_key(key: str) -> tuple[str, str] | None:
    """(module stem, kind) for a key in one of the known layouts, else None."""
    for suffix, kind in SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], kind
    return None


def unsupported_kind(key: str) -> str | None:
    for marker, what in UNSUPPORTED:
        if marker in key:
            return what
    return None


def foreign_model(keys: Iterable[str]) -> tuple[str, str] | None:
    """(model family, an example key) when the keys carry another model's layer names."""
    keys = list(keys)
    flat = [k.lower().replace(".", "_") for k in keys]
    for family, markers in FOREIGN_MODELS:
        for key, normalized in zip(keys, flat):
            if any(marker in normalized for marker in markers):
                return family, key
    return None


def weight_aliases(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[Target, ...]]:
    """Every name a LoRA may use for a weight of the model, given the model's parameter shapes by name.

    Each `<module>.weight` is reachable under every dotted and underscored prefix; each block's fused
    `img_mlp.gate_up` maps to its gate rows in `gate_layer` and its up rows in `proj`.
    """
    stems: dict[str, tuple[Target, ...]] = {}
    for param in shapes:
        if param.endswith(".weight"):
            stems[param[: -len(".weight")]] = (Target(param),)
    for stem in list(stems):
        if stem.endswith(GATE):
            block = stem[: -len(GATE)]
            gate, up = f"{block}{GATE}.weight", f"{block}{UP_PROJ}.weight"
            if up in shapes and shapes[gate] == shapes[up]:
                rows = shapes[gate][0]
                stems[block + FUSED_MLP] = (Target(gate, slice(0, rows)), Target(up, slice(rows, 2 * rows)))
    aliases = {}
    for stem, targets in stems.items():
        for prefix in DOTTED_PREFIXES:
            aliases[prefix + stem] = targets
        flat = stem.replace(".", "_")
        for prefix in FLAT_PREFIXES:
            aliases[prefix + flat] = targets
    return aliases


def peft_scale(metadata: Mapping[str, object], module: str, rank: int) -> float | None:
    """The scale PEFT's adapter config gives `module` (alpha / rank, or alpha / sqrt(rank) with rsLoRA), from the
    `lora_adapter_metadata` JSON diffusers writes; None when the file carries no such config."""
    alpha = metadata.get("lora_alpha")
    if alpha is None:
        return None
    # PEFT matches a pattern against the end of the module name, on dot boundaries.
    for pattern, value in (metadata.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return float(alpha) / (rank ** 0.5 if metadata.get("use_rslora") else rank)
