"""Load the Qwen-Image-2.1 DiT from a ComfyUI-GGUF file (`qwen_image21`, any type the gguf package dequantizes).

The file is checked whole before a weight is read (architecture, tensor names and shapes against the model its shapes
describe); then each tensor is dequantized, cast to the load dtype and placed, one at a time. The result is an
ordinary float model: the loader's precision (`auto`: int8 ConvRot where our INT8 GEMM runs) quantizes it as it does
a bf16 file's weights.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from ..errors import CheckpointError, KVGraphError
from ..free_memory import host_available_bytes
from .assemble import assign_weights, build_empty, check_against_model, finish
from .comfy_layout import transformer_comfy_key, transformer_from_comfy_state_dict
from .config_infer import infer_transformer_config
from .detect import DESCRIPTIONS, QWEN21_TRANSFORMER, inspect_gguf_shapes
from .gguf_files import ARCH_FIELD, GGUFFile, is_gguf

logger = logging.getLogger(__name__)
GGUF_ARCH = "qwen_image21"


def open_gguf_transformer(path: str | os.PathLike, expected: str) -> GGUFFile:
    """The file, refused unless it is a Qwen-Image-2.1 DiT."""
    file = GGUFFile(path, expected)
    info = inspect_gguf_shapes(file.arch, file.shapes)
    if info.kind != QWEN21_TRANSFORMER:
        said = f"{ARCH_FIELD} is {file.arch!r}" if file.arch else "judged from its tensor names"
        raise CheckpointError(path, f"is a GGUF file of {info.description} ({said}), not {GGUF_ARCH} "
                                    f"({DESCRIPTIONS[QWEN21_TRANSFORMER]}).", expected)
    return file


def load_bytes(file: GGUFFile, dtype: torch.dtype, int8: bool = False) -> tuple[int, int]:
    """(the loaded weights' bytes, the load's extra peak: the largest tensor dequantized in fp32, and with `int8` the
    largest block in `dtype`, whose Linears are then held as int8, about one byte a weight)."""
    counts = {k: math.prod(t.shape) for k, t in file.tensors.items()}
    largest = max(counts.values(), default=0) * 4
    if not int8:
        return sum(counts.values()) * dtype.itemsize, largest
    blocks: dict[int, int] = {}
    for key, count in counts.items():
        blocks[_block_of(key)] = blocks.get(_block_of(key), 0) + count
    outside = blocks.pop(-1, 0)
    return outside * dtype.itemsize + sum(blocks.values()), largest + max(blocks.values(), default=0) * dtype.itemsize


def check_host_memory(file: GGUFFile, dtype: torch.dtype, device, int8: bool = False) -> None:
    """Refuse, before anything is allocated, a load whose weights cannot fit in the host memory available (priced as
    if every tensor were dequantized on the host, as the types without a torch port are; with `device` a GPU only one
    tensor at a time stays there)."""
    weights, peak = load_bytes(file, dtype, int8)
    need = peak + (weights if torch.device(device).type == "cpu" else 0)
    available = host_available_bytes()
    if available is not None and need > available:
        raise KVGraphError(f"KV-Graph: loading {file.path} dequantized to {str(dtype).removeprefix('torch.')} needs "
                           f"{need / 2**30:.2f} GiB of host memory, and {available / 2**30:.2f} GiB is available. "
                           "Nothing was allocated: free host memory, or load it in a smaller dtype.")


def int8_while_read(path, resolved) -> bool:
    """Whether a transformer load should make the blocks INT8 ConvRot as it reads a GGUF file (`resolved`: a
    ResolvedPrecision): a GGUF file converted to int8, so the peak stays near the int8 model's size rather than
    the whole dequantized model's. Both the loader node and the command line decide it here."""
    return path is not None and is_gguf(path) and resolved.converts and resolved.precision == "int8"


def _block_of(key: str) -> int:
    """The block a model key belongs to, -1 for the tensors outside the blocks (read first)."""
    return int(key.split(".")[1]) if key.startswith("transformer_blocks.") else -1


def load_gguf_transformer(path: str | os.PathLike, dtype: torch.dtype, device, expected: str, int8_on=None,
                          dequantize_device=None):
    """`diffusers.QwenImage21Transformer2DModel` in `dtype` on `device`, from a GGUF file (see the module docstring).

    `int8_on` (a device): the blocks' Linears become INT8 ConvRot as `apply_precision(model, "int8", int8_on)` makes
    them, each block as soon as its weights are read, so the float weights of one block at most are held at a time
    (the peak stays near the int8 model's size instead of the float model's). `dequantize_device`: where each tensor
    is dequantized (default `int8_on`, else `device`; a GPU does it in a fraction of the CPU's time)."""
    from diffusers import QwenImage21Transformer2DModel

    file = open_gguf_transformer(path, expected)
    meta = {k: torch.empty(shape, device="meta") for k, shape in file.shapes.items()}
    mapped = {k: tuple(v.shape) for k, v in transformer_from_comfy_state_dict(meta).items()}
    stored = {t.name: t.shape for t in file.tensors.values()}

    def file_key(key: str) -> str:
        return transformer_comfy_key(key, file.prefix)

    config = infer_transformer_config(mapped, path, expected, file_key)
    model = build_empty(lambda: QwenImage21Transformer2DModel.from_config(config))
    check_against_model(model, mapped, path, expected, file_key=file_key, file_shapes=stored)

    check_host_memory(file, dtype, device, int8_on is not None)
    start = time.perf_counter()
    if int8_on is not None:
        from ..fp8.convert import install, int8_factory, linear_names, module_at

        quantize, names = int8_factory(int8_on), linear_names("int8")
    at = dequantize_device or int8_on or device
    by_block: dict[int, list[str]] = {}
    for key in file.tensors:
        by_block.setdefault(_block_of(key), []).append(key)
    for index in sorted(by_block):
        tensors = {}
        for key in by_block[index]:
            tensors.update(transformer_from_comfy_state_dict({key: file.read(key, dtype, at).to(device)}))
        assign_weights(model, tensors)
        del tensors
        if int8_on is not None and index >= 0:
            block = model.transformer_blocks[index]
            install(model, {(index, name): quantize(module_at(block, name)) for name in names})
    logger.info("KV-Graph: read GGUF %s (%s), dequantized on %s to %s in %.1f s", path, file.describe_types(), at,
                str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return finish(model, path, expected, device)
