"""GGUF files as ComfyUI-GGUF (city96's loader) writes and reads them, read with llama.cpp's `gguf` package.

The layout: `general.architecture` names the model (`qwen_image21` for the Qwen-Image-2.1 DiT); tensor names are the
ComfyUI single file's (the `model.diffusion_model.` prefix usually stripped, `img_mlp.gate_up` fused); a tensor's
shape is its GGUF dims reversed (GGUF lists the fastest-varying dimension first), unless a
`comfy.gguf.orig_shape.<name>` INT32 array gives the original shape (tensors reshaped to quantize them). Small
tensors (norms, biases) are usually F32 or F16, the Linear weights Q8_0, Q4_K, ...

Every type `gguf.quants.dequantize` knows is read, each tensor on its own, so the peak stays one tensor above the loaded
model: the float, legacy (Q8_0 ... Q5_1) and K-quant types by gguf_torch.py's torch port on the device the loader
names (the GPU where there is one: its raw bytes are copied there, and only the result is made), the IQ and other types
by gguf's numpy dequantizers on the CPU, straight from the file's memory map. The file is checked before any weight is
read: a truncated file, a tensor type the package does not know, or the wrong architecture fail with a CheckpointError
naming the file and the tensor.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, DependencyError, shorten
from . import gguf_torch
from .detect import COMFY_DIFFUSION_PREFIX

GGUF_SUFFIX = ".gguf"
ARCH_FIELD = "general.architecture"
ORIG_SHAPE_FIELD = "comfy.gguf.orig_shape."


def is_gguf(path: str | os.PathLike) -> bool:
    return os.fspath(path).lower().endswith(GGUF_SUFFIX)


class _Damaged(Exception):
    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def _checked_reader(path: Path):
    """gguf.GGUFReader, with each tensor's type and extent checked before the reader maps it, so a truncated file
    or an unknown type is reported with the tensor's name (the reader's own errors do not name it)."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = str(bytes(name_data), encoding="utf-8", errors="replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise _Damaged(f"stores tensor {shorten(name)} in GGML type {int(raw_dtype[0])}, which the gguf "
                                   f"package {gguf_version()} does not know.") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                count = int(np.prod(dims))
                end = int(start_offs + offset[0]) + count * type_size // block
                if count % block or end > size:
                    raise _Damaged(f"ends before the data of tensor {shorten(name)} ({end} bytes needed, the file has "
                                   f"{size}): the file is truncated (an interrupted download?).")
            return super()._build_tensors(start_offs, fields)

    return Reader(path, "r")


def gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: `name` as stored, `key` without the ComfyUI prefix, `shape` in torch's order."""

    name: str
    key: str
    shape: tuple[int, ...]
    qtype: object  # gguf.GGMLQuantizationType
    raw: object  # gguf.ReaderTensor

    @property
    def type_name(self) -> str:
        return self.qtype.name


class GGUFFile:
    """A GGUF file opened for reading (memory-mapped; nothing is dequantized until `read`)."""

    def __init__(self, path: str | os.PathLike, expected: str):
        self.path, self.expected = Path(path), expected
        if not self.path.is_file():
            raise CheckpointError(self.path, "does not exist or is not a file.", expected)
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise DependencyError(f"{self.path} is a GGUF file, which needs the gguf package: pip install gguf "
                                  "(the pack's requirements.txt lists it) into ComfyUI's Python.") from None
        try:
            self.reader = _checked_reader(self.path)
        except _Damaged as exc:
            raise CheckpointError(self.path, exc.problem, expected) from None
        except Exception as exc:  # noqa: BLE001 - the reader's own errors: bad magic, version, a cut header
            raise CheckpointError(self.path, f"is not a readable GGUF file ({shorten(str(exc))}).", expected) from None
        self.arch = self._string(ARCH_FIELD)
        names = [t.name for t in self.reader.tensors]
        self.prefix = COMFY_DIFFUSION_PREFIX if any(n.startswith(COMFY_DIFFUSION_PREFIX) for n in names) else ""
        self.tensors: dict[str, GGUFTensor] = {}
        for t in self.reader.tensors:
            if self.prefix and not t.name.startswith(self.prefix):
                continue  # ComfyUI-GGUF reads only the prefixed tensors of such a file
            key = t.name[len(self.prefix):]
            self.tensors[key] = GGUFTensor(t.name, key, self._shape(t), t.tensor_type, t)

    def _string(self, name: str) -> str | None:
        field = self.reader.get_field(name)
        if field is None:
            return None
        try:
            return str(field.contents())
        except Exception:  # noqa: BLE001 - a field of another type: reported as such by the caller's check
            return repr(field.types)

    def _shape(self, t) -> tuple[int, ...]:
        field = self.reader.get_field(ORIG_SHAPE_FIELD + t.name)
        stored = tuple(int(d) for d in reversed(t.shape.tolist()))
        if field is None:
            return stored
        try:
            shape = tuple(int(d) for d in field.contents())
        except Exception:  # noqa: BLE001
            shape = ()
        if not shape or int(np.prod(shape)) != int(np.prod(stored)):
            raise CheckpointError(self.path, f"gives tensor {shorten(t.name)} the original shape {list(shape)} "
                                             f"({ORIG_SHAPE_FIELD}{t.name}), which does not hold its "
                                             f"{int(np.prod(stored))} values.", self.expected)
        return shape

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: t.shape for k, t in self.tensors.items()}

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts

    def describe_types(self) -> str:
        return ", ".join(f"{name} x{n}" for name, n in sorted(self.type_counts().items()))

    def dequantized(self, key: str) -> np.ndarray:
        """The tensor's values as the file defines them (float32, or the stored float dtype), in torch's shape."""
        from gguf.quants import dequantize

        t = self.tensors[key]
        try:
            values = dequantize(t.raw.data, t.qtype)
        except NotImplementedError:
            raise CheckpointError(self.path, f"stores tensor {shorten(t.name)} as {t.type_name}, which the gguf package "
                                             f"{gguf_version()} cannot dequantize.", self.expected) from None
        return values.reshape(t.shape)

    def read(self, key: str, dtype: torch.dtype, at=None) -> torch.Tensor:
        """One tensor dequantized and cast to `dtype`, in memory of its own (not the file's map). `at` (a device,
        default the CPU): where a type with a torch port (gguf_torch.py: the float, legacy and K-quant types) is
        dequantized: its raw bytes go there and only the result is made; the others are dequantized by gguf on the
        CPU."""
        t = self.tensors[key]
        at = torch.device("cpu" if at is None else at)
        if t.type_name in gguf_torch.PORTS:
            with warnings.catch_warnings():  # the read-only map: only read from, then copied or dequantized
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                raw = torch.from_numpy(np.asarray(t.raw.data).reshape(-1).view(np.uint8))
            return gguf_torch.dequantize(raw.to(at), t.type_name, t.shape).to(dtype)
        values = self.dequantized(key)
        with warnings.catch_warnings():  # a float tensor straight from the read-only map: copied by the cast below
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(values)
        return tensor.to(at).to(dtype, copy=True)
