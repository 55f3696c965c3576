"""Open and validate a .safetensors file before anything is loaded from it.

`safetensors` itself reports a truncated or foreign file with a terse Rust error ("HeaderTooLarge",
"MetadataIncompleteBuffer") that names neither the file nor the cause. ComfyUI users mostly hit these with an
interrupted download or a `.ckpt` renamed to `.safetensors`, so the header is parsed here first and every failure
becomes a `CheckpointError` that says which file and what went wrong.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .errors import CheckpointError, shorten

# The reference implementation refuses headers above 100 MB; a "length" beyond that means the first 8 bytes are not a
# safetensors length at all.
MAX_HEADER_BYTES = 100_000_000

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}

TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


@dataclass
class SafetensorsHeader:
    """What a safetensors file declares, read without touching the tensor data."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}

    def meta_state_dict(self) -> dict[str, torch.Tensor]:
        """The file as `meta` tensors: key mappings and config inference run on these without reading any data."""
        out = {}
        for name, info in self.tensors.items():
            dtype = TORCH_DTYPES.get(info.dtype) or torch.uint8
            out[name] = torch.empty(info.shape, dtype=dtype, device="meta")
        return out


def _is_count(value) -> bool:
    """A non-negative JSON integer (a bool is not one, though Python's json gives it as a subclass of int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _sniff_foreign_format(head: bytes) -> str | None:
    if head.startswith(b"PK\x03\x04"):
        return ("is a zip archive, which is how torch.save writes a PyTorch .pt/.ckpt/.bin checkpoint; it is not a "
                "safetensors file (and loading pickled checkpoints can run arbitrary code, so it is not supported).")
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return ("is a Python pickle (a legacy PyTorch .ckpt/.pt/.bin checkpoint), not a safetensors file; pickled "
                "checkpoints can run arbitrary code and are not supported.")
    if head.startswith(b"GGUF"):
        return "is a GGUF file (llama.cpp / ComfyUI-GGUF quantized format), not a safetensors file."
    return None


def read_header(path: str | os.PathLike, expected: str | None = None) -> SafetensorsHeader:
    """Parse and validate the header of `path`; raise CheckpointError for anything that is not a whole safetensors
    file. `expected` is the component-specific sentence added to every error."""
    path = Path(path)
    if not os.path.exists(path):  # False, not an OSError, for a name too long for the file system
        raise CheckpointError(path, "does not exist.", expected)
    if path.is_dir():
        raise CheckpointError(path, "is a folder, not a .safetensors file.", expected)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        foreign = _sniff_foreign_format(head)
        if foreign:
            raise CheckpointError(path, foreign, expected)
        if len(head) < 8:
            raise CheckpointError(path, f"is only {size} bytes long: empty or cut off, not a safetensors file.",
                                  expected)
        (header_len,) = struct.unpack("<Q", head)
        if header_len == 0 or header_len > MAX_HEADER_BYTES:
            raise CheckpointError(path, "is not a safetensors file (its first 8 bytes are not a plausible header "
                                        "length).", expected)
        raw = f.read(header_len)
    if len(raw) < header_len:
        if raw[:1] == b"{":
            raise CheckpointError(path, f"is truncated: its header should be {header_len} bytes but the file ends "
                                        f"after {size} bytes (an interrupted download or copy?).", expected)
        raise CheckpointError(path, "is not a safetensors file (its first 8 bytes are not a plausible header "
                                    "length).", expected)
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(path, "has a header that is not valid JSON: it is not a safetensors file, or a "
                                    "damaged one.", expected) from None
    except RecursionError:
        # A real header is one flat object of flat entries; nesting deep enough to exhaust the parser is no header.
        raise CheckpointError(path, "has a header of deeply nested JSON: not a safetensors file.", expected) from None
    if not isinstance(parsed, dict):
        raise CheckpointError(path, "has a header that is not a JSON object: not a safetensors file.", expected)

    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(path, "has a __metadata__ entry that is not a JSON object of strings: a damaged file.",
                              expected)
    tensors: dict[str, TensorInfo] = {}
    ranges = []
    for name, entry in parsed.items():
        shown = shorten(repr(name))
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(path, f"has a malformed header entry for tensor {shown}: not a valid safetensors "
                                        "file.", expected) from None
        # The safetensors library refuses anything but JSON integers here ("invalid JSON in header"): a float
        # shape or a string offset is a damaged header, named before that library ever sees the file.
        if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
            raise CheckpointError(path, f"has a header entry for tensor {shown} whose shape "
                                        f"{shorten(repr(shape), 80)} is not a list of whole numbers: a damaged "
                                        "file.", expected)
        if not (_is_count(begin) and _is_count(end)):
            raise CheckpointError(path, f"has a header entry for tensor {shown} whose data_offsets "
                                        f"{shorten(repr([begin, end]), 80)} are not two whole numbers: a damaged "
                                        "file.", expected)
        shape = tuple(shape)
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(path, f"stores tensor {shown} as {shorten(repr(dtype))}, a dtype KV-Graph does not "
                                        f"read (one of {', '.join(DTYPE_SIZES)}): a damaged or foreign file.",
                                  expected)
        if end < begin or end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise CheckpointError(path, f"has an inconsistent header entry for tensor {shown} (its byte range does "
                                        f"not fit shape {list(shape)} of {dtype}): a damaged file.", expected)
        tensors[name] = TensorInfo(dtype, shape)
        ranges.append((begin, end, shown))
    # The tensors' byte ranges must tile the data exactly, in some order, as the safetensors format requires: two
    # tensors sharing bytes, or bytes belonging to none, is a damaged header.
    data_end = 0
    for begin, end, shown in sorted(ranges):
        if begin != data_end:
            what = "overlaps the tensor before it" if begin < data_end else "leaves a gap before it"
            raise CheckpointError(path, f"has data_offsets for tensor {shown} that {what} in the file: a damaged "
                                        "header.", expected)
        data_end = end
    available = size - 8 - header_len
    if available < data_end:
        raise CheckpointError(path, f"is truncated: its header describes {data_end} bytes of tensor data but only "
                                    f"{available} bytes follow it (an interrupted download or copy?).", expected)
    if available > data_end:
        raise CheckpointError(path, f"has {available - data_end} bytes after the {data_end} bytes of tensor data its "
                                    "header describes: a damaged file.", expected)
    return SafetensorsHeader(path=path, tensors=tensors, metadata=dict(metadata))


def read_headers(paths: Iterable[str | os.PathLike], expected: str | None = None) -> SafetensorsHeader:
    """Validate every shard of a sharded checkpoint and merge their headers (path is the first shard)."""
    paths = list(paths)
    merged: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for p in paths:
        header = read_header(p, expected)
        merged.update(header.tensors)
        metadata.update(header.metadata)
    return SafetensorsHeader(path=Path(paths[0]), tensors=merged, metadata=metadata)


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor read from a file as one that owns its memory. safetensors hands out CPU tensors backed by the
    file's memory map: a model holding them would read the file for its whole life, and a file truncated or
    rewritten in place (a new download over the old one) would kill the process with SIGBUS on the next read. Copied
    one tensor at a time, so the load never holds a second copy of the model."""
    return tensor.clone() if tensor.device.type == "cpu" else tensor


@contextlib.contextmanager
def openable_path(path: str | os.PathLike) -> Iterator[str]:
    """A name of `path` the safetensors library can open. It takes only UTF-8 names ("Path ... is not valid UTF-8"),
    while a file in a model folder may have any bytes in its name: such a file is opened here and handed over as
    its open descriptor's name under /proc/self/fd (or /dev/fd), which the library opens like any path."""
    name = os.fsdecode(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        yield name
        return
    folder = next((f for f in ("/proc/self/fd", "/dev/fd") if os.path.isdir(f)), None)
    if folder is None:
        raise CheckpointError(path, "has a name that is not valid UTF-8, which the safetensors library cannot open "
                                    "here.", "a file name in UTF-8: rename the file")
    fd = os.open(path, os.O_RDONLY)
    try:
        yield f"{folder}/{fd}"
    finally:
        os.close(fd)


def iter_tensors(paths: Iterable[str | os.PathLike], dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", names: Iterable[str] | None = None, own: bool = True,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, cast right after reading, so a cast never holds two copies of the model.

    Only floating-point tensors are cast: integer tensors (quantization scales, token ids) keep their type. Every
    tensor owns its memory (a cast copies; the rest are copied out of the file's memory map: see `owned`), unless
    `own=False`: then a tensor the caller keeps as it is must go through `owned` (a caller that casts or converts
    everything itself saves the copy).
    """
    from safetensors import safe_open

    wanted = None if names is None else set(names)
    target = torch.device(device)
    # Reading straight onto an accelerator skips a host copy of every tensor.
    open_device = str(target) if target.type != "cpu" else "cpu"
    for p in paths:
        with openable_path(p) as openable, safe_open(openable, framework="pt", device=open_device) as f:
            for name in f.keys():
                if wanted is not None and name not in wanted:
                    continue
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                elif own:
                    tensor = owned(tensor)
                yield name, tensor
