"""Tiny synthetic LoRA files in each key layout published Qwen-Image-2.1 LoRAs use, and the reference merge.

Each writer draws random factors per weight of the tiny transformer, writes them under that layout's names, and
returns what it wrote as plain (weight name -> [(B, A, scale)] or [diff]) data, so a test can compute the merged
weights with its own math (`reference_weights`), independently of graph_runtime.lora.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 4
BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
                 "img_mlp.out")
TOP_LINEARS = ("img_in", "txt_in.in_layer", "modulation.1", "proj_out")


def _factors(generator, rows, cols, rank=RANK, std=0.2):
    return torch.randn(rows, rank, generator=generator) * std, torch.randn(rank, cols, generator=generator) * std


def _shape(model, module):
    return tuple(model.get_parameter(f"{module}.weight").shape)


def _blocks(model):
    return range(len(model.transformer_blocks))


def write_layout(path: Path, layout: str, model, seed: int = 0, dtype=torch.float32) -> dict:
    """Write `layout` for `model` to `path`; returns {weight name: [("pair", B, A, scale) | ("diff", D)]}."""
    generator = torch.Generator().manual_seed(seed)
    tensors, metadata, expected = {}, {"format": "pt"}, {}

    def pair(module, names, alpha=None, alpha_key=None, scale=1.0):
        up, down = _factors(generator, *_shape(model, module))
        tensors[names[0]], tensors[names[1]] = up, down
        if alpha is not None:
            tensors[alpha_key] = torch.tensor(float(alpha))
            scale = alpha / RANK
        expected.setdefault(f"{module}.weight", []).append(("pair", up, down, scale))

    modules = [f"transformer_blocks.{i}.{m}" for i in _blocks(model) for m in BLOCK_LINEARS]
    if layout == "peft":  # diffusers / PEFT: no alpha, so scale 1
        for m in modules:
            pair(m, (f"transformer.{m}.lora_B.weight", f"transformer.{m}.lora_A.weight"))
    elif layout == "peft_metadata":  # diffusers' save_lora_weights: alpha in the adapter config, one pattern
        config = {"transformer.r": RANK, "transformer.lora_alpha": 8, "transformer.use_rslora": False,
                  "transformer.alpha_pattern": {"attn.to_q": 2}}
        metadata["lora_adapter_metadata"] = json.dumps(config)
        for m in modules:
            pair(m, (f"transformer.{m}.lora_B.weight", f"transformer.{m}.lora_A.weight"),
                 scale=(2 if m.endswith("attn.to_q") else 8) / RANK)
    elif layout == "kohya":  # ComfyUI / kohya: diffusion_model. prefix, lora_up/lora_down + alpha
        for i, m in enumerate(modules):
            pair(m, (f"diffusion_model.{m}.lora_up.weight", f"diffusion_model.{m}.lora_down.weight"),
                 alpha=1 + i % 4, alpha_key=f"diffusion_model.{m}.alpha")
    elif layout == "kohya_flat":  # lora_unet_ underscored names, the top-level Linears too
        for m in modules + list(TOP_LINEARS):
            flat = "lora_unet_" + m.replace(".", "_")
            pair(m, (f"{flat}.lora_up.weight", f"{flat}.lora_down.weight"), alpha=2, alpha_key=f"{flat}.alpha")
    elif layout == "lycoris":
        for m in modules:
            flat = "lycoris_" + m.replace(".", "_")
            pair(m, (f"{flat}.lora_up.weight", f"{flat}.lora_down.weight"), alpha=4, alpha_key=f"{flat}.alpha")
    elif layout == "diffsynth":  # PEFT's adapter name left in, no prefix
        for m in modules:
            pair(m, (f"{m}.lora_B.default.weight", f"{m}.lora_A.default.weight"))
    elif layout == "comfy_fused_mlp":  # trained on ComfyUI's fused gate_up weight (gate rows first)
        for i in _blocks(model):
            block = f"transformer_blocks.{i}"
            rows, cols = _shape(model, f"{block}.img_mlp.gate_layer")
            up, down = _factors(generator, 2 * rows, cols)
            stem = f"diffusion_model.{block}.img_mlp.gate_up"
            tensors[f"{stem}.lora_B.weight"], tensors[f"{stem}.lora_A.weight"] = up, down
            tensors[f"{stem}.alpha"] = torch.tensor(2.0)
            expected[f"{block}.img_mlp.gate_layer.weight"] = [("pair", up[:rows], down, 2 / RANK)]
            expected[f"{block}.img_mlp.proj.weight"] = [("pair", up[rows:], down, 2 / RANK)]
            pair(f"{block}.attn.to_v", (f"diffusion_model.{block}.attn.to_v.lora_B.weight",
                                        f"diffusion_model.{block}.attn.to_v.lora_A.weight"))
    elif layout == "diff":  # full-weight differences, a norm's scale too; a zero bias difference is ignored
        for m in modules[:3] + ["transformer_blocks.0.attn.norm_q"]:
            diff = torch.randn(_shape(model, m), generator=generator) * 0.05
            tensors[f"diffusion_model.{m}.diff"] = diff
            expected[f"{m}.weight"] = [("diff", diff)]
        tensors[f"diffusion_model.{modules[0]}.diff_b"] = torch.zeros(_shape(model, modules[0])[0])
    else:
        raise ValueError(layout)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    if dtype != torch.float32:  # the reference reads what the file holds
        expected = {k: [tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in item) for item in items]
                    for k, items in expected.items()}
    return expected


LAYOUTS = ("peft", "peft_metadata", "kohya", "kohya_flat", "lycoris", "diffsynth", "comfy_fused_mlp", "diff")


def reference_weights(model, expected_by_file) -> dict[str, torch.Tensor]:
    """W = round(fp32(W0) + sum of strength * (scale * B @ A | D)) per changed weight, for [(strength, expected)]."""
    out = {}
    for strength, expected in expected_by_file:
        for name, items in expected.items():
            total = out.setdefault(name, model.get_parameter(name).detach().float().clone())
            for item in items:
                if item[0] == "pair":
                    _, up, down, scale = item
                    total += strength * scale * (up.float() @ down.float())
                else:
                    total += strength * item[1].float()
    dtype = next(model.parameters()).dtype
    return {name: total.to(dtype) for name, total in out.items()}


def write_keys(path: Path, keys: dict) -> Path:
    """A file with exactly `keys` ({name: shape}), random values."""
    generator = torch.Generator().manual_seed(1)
    save_file({k: torch.randn(shape, generator=generator) if shape else torch.tensor(1.0)
               for k, shape in keys.items()}, str(path))
    return path
