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


def _write(tensors, path: str | os.PathLike, arch: str, qtype: str, quantized) -> Path:
    """Write {GGUF name: float tensor} to `path`, each in `qtype` where `quantized(name, tensor, type)` says so, else
    F32; the file appears under its name only once complete."""
    import gguf
    import torch
    from gguf.quants import quantize

    qt = gguf.GGMLQuantizationType[qtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, value in tensors.items():
        t = qt if quantized(name, value, qt) else gguf.GGMLQuantizationType.F32
        writer.add_tensor(name, quantize(value.detach().to(torch.float32).numpy(), t), raw_dtype=t)
    writer.write_header_to_file(path=part)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(part, path)
    return path


def _splits_into_blocks(value, qtype) -> bool:
    import gguf

    return value.dim() == 2 and value.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def write_gguf_transformer(state_dict, path: str | os.PathLike, qtype: str, arch: str = GGUF_ARCH) -> Path:
    """Write a diffusers-named transformer state dict as a ComfyUI-GGUF file of type `qtype` (one of GGUF_TYPES)."""
    from .loading.comfy_layout import COMFY_DIFFUSION_PREFIX, transformer_to_comfy_state_dict

    tensors = {k.removeprefix(COMFY_DIFFUSION_PREFIX): v for k, v in transformer_to_comfy_state_dict(state_dict).items()}
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
