"""The tiny transformer written as ComfyUI-GGUF files (`qwen_image21`), quantized with llama.cpp's `gguf` package.

The layout follows ComfyUI-GGUF's converter: ComfyUI's tensor names without the `model.diffusion_model.` prefix
(`img_mlp.gate_up` fused), 1-D tensors and the layers outside the blocks (embedders, the shared modulation, the output
head) in F32, the blocks' 2-D weights in the file's type. Only the types `gguf.quants.quantize` can write are offered
(K-quants and IQ types it reads but cannot write). The text encoder's language tower is written in llama.cpp's
`qwen3vl` names (its vision tower stays in the safetensors file).
"""

from __future__ import annotations

import os
from pathlib import Path

# The quantized types gguf 0.19 writes, each with a name for the file.
GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
# What `make-tiny --comfyui-models` writes into diffusion_models/ (the example workflow loads the Q8_0 one).
SHIPPED_TYPES = ("Q8_0", "Q4_0")
GGUF_ARCH = "qwen_image21"


def gguf_file_name(qtype: str) -> str:
    return f"qwen_image_2.1-{qtype}.gguf"


# The tiny Qwen3-VL language tower as a GGUF (its vision tower comes from text_encoders/qwen3vl_8b_bf16.safetensors).
TEXT_ENCODER_GGUF = "text_encoders/qwen3vl_8b-Q8_0.gguf"


def comfyui_gguf_paths(models_dir: str | os.PathLike, types=SHIPPED_TYPES) -> dict[str, Path]:
    return {t: Path(models_dir) / "diffusion_models" / gguf_file_name(t) for t in types}


def comfyui_text_encoder_gguf_path(models_dir: str | os.PathLike) -> Path:
    return Path(models_dir) / TEXT_ENCODER_GGUF


def _written(path: str | os.PathLike, arch: str, fill) -> Path:
    """A GGUF file of `arch` at `path`, its tensors added by `fill(writer)`; it appears under its name only once
    complete."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    fill(writer)
    writer.write_header_to_file(path=part)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(part, path)
    return path


def _write(tensors, path: str | os.PathLike, arch: str, qtype: str, quantized) -> Path:
    """Write {GGUF name: float tensor} to `path`, each in `qtype` where `quantized(name, tensor, type)` says so, else
    F32."""
    import gguf
    import torch
    from gguf.quants import quantize

    qt = gguf.GGMLQuantizationType[qtype]

    def fill(writer):
        for name, value in tensors.items():
            t = qt if quantized(name, value, qt) else gguf.GGMLQuantizationType.F32
            writer.add_tensor(name, quantize(value.detach().to(torch.float32).numpy(), t), raw_dtype=t)

    return _written(path, arch, fill)


def _splits_into_blocks(value, qtype) -> bool:
    import gguf

    return value.dim() == 2 and value.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def write_gguf_transformer(state_dict, path: str | os.PathLike, qtype: str, arch: str = GGUF_ARCH) -> Path:
    """Write a diffusers-named transformer state dict as a ComfyUI-GGUF file of type `qtype` (one of GGUF_TYPES)."""
    from .loading.comfy_layout import COMFY_DIFFUSION_PREFIX, transformer_to_comfy_state_dict

    comfy = transformer_to_comfy_state_dict(state_dict)
    tensors = {k.removeprefix(COMFY_DIFFUSION_PREFIX): v for k, v in comfy.items()}
    return _write(tensors, path, arch, qtype,
                  lambda name, value, qt: name.startswith("transformer_blocks.") and _splits_into_blocks(value, qt))


def write_comfyui_gguf_files(models_dir: str | os.PathLike, transformer, force: bool = False,
                             types=SHIPPED_TYPES) -> dict[str, Path]:
    """The tiny transformer (a module) as GGUF files in models_dir/diffusion_models, one per type."""
    from .tiny import check_writable

    files = comfyui_gguf_paths(models_dir, types)
    check_writable(list(files.values()), force)
    state_dict = transformer.state_dict()
    return {t: write_gguf_transformer(state_dict, path, t) for t, path in files.items()}


def write_gguf_language_tower(state_dict, path: str | os.PathLike, qtype: str, arch: str = "qwen3vl") -> Path:
    """Write a Qwen3VLForConditionalGeneration state dict's language tower as a llama.cpp-named GGUF of type `qtype`
    (2-D weights whose rows split into the type's blocks; the rest F32). The vision tower is left out: it is read
    from the model's safetensors file."""
    from .loading.gguf_text_encoder import gguf_language_name

    tensors = {name: v for k, v in state_dict.items() if (name := gguf_language_name(k)) is not None}
    return _write(tensors, path, arch, qtype, lambda name, value, qt: _splits_into_blocks(value, qt))


# ------------------------------------------------------------------------------------------------------ K-quants
# The gguf package reads K-quants but cannot write them (llama.cpp's quantizers are C). These build valid blocks for
# tests and the benchmark: a simple quantizer for Q4_K and Q6_K (the two types a Q4_K_M file uses for its Linears),
# following the block layouts of gguf's dequantizers, and blocks of random codes and scales for the other types.
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
QUANTIZERS = ("Q4_K", "Q6_K")
QK_K = 256


def _f16_at_least(values):
    """float16 values no smaller than `values` (>= 0): a scale rounded down would clip the block's extremes."""
    import torch

    out = values.to(torch.float16)
    return torch.where(out.float() < values, torch.nextafter(out, torch.full_like(out, float("inf"))), out)


def _bytes(*parts):
    """Per-block fields (uint8 / float16 / int8 tensors, [n, ...]) side by side as uint8 [n, block size]."""
    import torch

    return torch.cat([p.contiguous().view(torch.uint8).reshape(p.shape[0], -1) for p in parts], 1)


def quantize_q8_0(rows):
    """float [n, 32*k] -> Q8_0 bytes [n, 34*k] (gguf's layout: float16 d = amax / 127, then 32 int8 codes), on the
    tensor's device."""
    import torch

    x = rows.float().reshape(-1, 32)
    d = (x.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(d > 0, 1 / d.float().clamp(min=1e-30), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return _bytes(d.reshape(-1, 1), q).reshape(rows.shape[0], -1)


def quantize_q4_k(rows):
    """float [n, 256*k] -> Q4_K bytes [n, 144*k], on the tensor's device. Per 32-value sub-block s: values
    d*sc[s]*q - dmin*m[s], q in 0..15, 6-bit sc and m. The mins are rounded up and the scales chosen after them, so
    each sub-block's 16 levels cover its min(x, 0) .. max(x): every weight is within half a step of its level
    (step <= (range + dmin) / 15 + d)."""
    import torch

    x = torch.as_tensor(rows).float().reshape(-1, 8, 32)
    low = x.amin(-1).clamp(max=0)
    dmin = _f16_at_least((-low).amax(-1) / 63)
    dmin32 = dmin.float()[:, None]
    m = torch.where(dmin32 > 0, torch.ceil(-low / dmin32.clamp(min=1e-30)), 0).clamp(0, 63)
    floor = -dmin32 * m
    span = x.amax(-1) - floor
    d = _f16_at_least(span.amax(-1) / (15 * 63))
    d32 = d.float()[:, None]
    sc = torch.where(d32 > 0, torch.ceil(span / (15 * d32.clamp(min=1e-30))), 0).clamp(0, 63)
    step = (d32 * sc)[..., None]
    q = torch.where(step > 0, torch.round((x - floor[..., None]) / step.clamp(min=1e-30)), 0).clamp(0, 15)
    sc, m, q = sc.to(torch.uint8), m.to(torch.uint8), q.to(torch.uint8)
    scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], 1)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2j (low nibbles) and 2j+1 (high nibbles) share 32 bytes
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return _bytes(d.reshape(-1, 1), dmin.reshape(-1, 1), scales, qs).reshape(len(rows), -1)


def quantize_q6_k(rows):
    """float [n, 256*k] -> Q6_K bytes [n, 210*k], on the tensor's device. Per 16-value sub-block s: values
    d*sc[s]*(q - 32), q in 0..63, int8 sc rounded up so the levels cover the sub-block's amax: every weight within
    half a step (step <= amax/31 + d)."""
    import torch

    x = torch.as_tensor(rows).float().reshape(-1, 16, 16)
    amax = x.abs().amax(-1)
    d = _f16_at_least(amax.amax(-1) / (31 * 127))
    d32 = d.float()[:, None]
    sc = torch.where(d32 > 0, torch.ceil(amax / (31 * d32.clamp(min=1e-30))), 0).clamp(0, 127)
    step = (d32 * sc)[..., None]
    q = (torch.where(step > 0, torch.round(x / step.clamp(min=1e-30)), 0).clamp(-32, 31) + 32).to(torch.uint8)
    # element e = h*128 + nib*64 + p (p < 64) is ql[h*64 + p] >> 4*nib; e = h*128 + s*32 + r is qh[h*32 + r] >> 2*s
    flat = q.reshape(-1, 2, 128)
    ql = (flat[:, :, :64] & 0x0F) | ((flat[:, :, 64:] & 0x0F) << 4)
    hi = (flat >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return _bytes(ql.reshape(-1, 128), qh.reshape(-1, 64), sc.to(torch.int8), d.reshape(-1, 1)).reshape(len(rows), -1)


QUANTIZE = {"Q8_0": quantize_q8_0, "Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


# Where a type's float16 super-block scales sit in its block (the other bytes are codes and small scales: any value
# is valid), for random blocks with finite, moderate values.
_F16_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,),
                "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "IQ4_NL": (0,),
                "IQ4_XS": (0,)}
RANDOM_TYPES = tuple(_F16_OFFSETS) + ("IQ1_M",)


def random_blocks(qtype: str, n_blocks: int, seed: int = 0, scale: float = 2.0 ** -10):
    """`n_blocks` valid blocks of `qtype` (uint8 [n_blocks, type size]): random codes, the float16 scales set to
    `scale` times a random factor in [1, 2) (IQ1_M packs its scale in the top nibbles of its four 16-bit scales)."""
    import gguf
    import numpy as np

    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    d = (scale * (1 + rng.random(n_blocks))).astype(np.float16)
    if qtype == "IQ1_M":
        bits = d.view(np.uint16)
        words = blocks[:, size - 8:].copy().view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        blocks[:, size - 8:] = words.view(np.uint8)
        return blocks
    for offset in _F16_OFFSETS[qtype]:
        blocks[:, offset:offset + 2] = d.reshape(-1, 1).view(np.uint8)
    return blocks


def k_quant_bytes(values, qtype: str, seed: int = 0):
    """A float tensor's bytes in `qtype` as rows of 256 values: quantized for Q4_K / Q6_K, random blocks otherwise.
    [numel / 256, type size] uint8 (numpy)."""
    import gguf
    import torch

    flat = torch.as_tensor(values).float().reshape(-1, QK_K)
    if qtype in QUANTIZE:
        return QUANTIZE[qtype](flat).cpu().numpy()
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return random_blocks(qtype, flat.numel() // block, seed).reshape(flat.shape[0], -1)


def q4_k_m(name: str, value) -> str:
    """The type llama.cpp's Q4_K_M gives a block Linear: Q6_K for the value projection and the MLP's down
    projection (`attn.to_v`, `img_mlp.out`), Q4_K for the rest."""
    return "Q6_K" if name.endswith(("attn.to_v.weight", "img_mlp.out.weight")) else "Q4_K"


def write_k_quant_transformer(state_dict, path: str | os.PathLike, types, arch: str = GGUF_ARCH) -> Path:
    """A diffusers-named transformer state dict as a ComfyUI-GGUF file whose block Linears are `types(name, tensor)`
    (Q8_0, a K-quant or an IQ type; None: F32), quantized on the tensors' device (the GPU for the benchmark's
    full-size files). A weight whose rows do not split into blocks of 256 is stored as rows of 256 values with its
    shape in `comfy.gguf.orig_shape.<name>` (ComfyUI-GGUF's way for tensors reshaped to quantize them). The rest is
    F32."""
    import gguf
    import numpy as np
    import torch

    from .loading.comfy_layout import COMFY_DIFFUSION_PREFIX, transformer_to_comfy_state_dict
    from .loading.gguf_files import ORIG_SHAPE_FIELD

    comfy = transformer_to_comfy_state_dict(state_dict)
    tensors = {k.removeprefix(COMFY_DIFFUSION_PREFIX): v for k, v in comfy.items()}

    def fill(writer):
        for seed, (name, value) in enumerate(tensors.items()):
            qtype = types(name, value) if name.startswith("transformer_blocks.") and value.numel() % QK_K == 0 else None
            if qtype is None:
                writer.add_tensor(name, value.detach().to(torch.float32).cpu().numpy(),
                                  raw_dtype=gguf.GGMLQuantizationType.F32)
                continue
            data = k_quant_bytes(value.detach(), qtype, seed)
            if value.dim() == 2 and value.shape[-1] % QK_K == 0:
                data = data.reshape(value.shape[0], -1)  # rows kept: the shape is the stored one
            else:
                writer.add_array(ORIG_SHAPE_FIELD + name, list(value.shape))
            writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=gguf.GGMLQuantizationType[qtype])

    return _written(path, arch, fill)
