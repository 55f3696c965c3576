"""How much memory a new allocation can get, on the host (CPU) and on a CUDA device: what the memory budget
(graph_runtime/memory/sizes.py) checks against, what a graph capture checks before it allocates (decode/capture.py),
and the default bound of the ComfyUI nodes' model cache (graph_runtime/eviction.py).

psutil's figures where it is installed (ComfyUI requires it and reads the same ones), else /proc/meminfo; either is
capped by the container's memory limit (cgroup v2 or v1), which is what gets a process killed inside one.
"""

from __future__ import annotations

import torch

# cgroup v1 writes a huge number (near 2^63) for "no limit", v2 writes "max".
_NO_LIMIT = 1 << 60


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo figure (e.g. "MemAvailable:") in bytes, or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_total_bytes() -> int | None:
    """The machine's RAM (psutil, else /proc/meminfo), or the container's memory limit when that is smaller."""
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:
        total = _meminfo("MemTotal:")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read_int(limit_file)
        if limit is not None and limit < _NO_LIMIT:
            return limit if total is None else min(total, limit)
    return total


def host_available_bytes() -> int | None:
    """Memory a new host (CPU) allocation can get without swapping or being killed: what the OS reports available
    (psutil's figure, as ComfyUI reads it, else /proc/meminfo), capped by the container's memory limit less what it
    uses (cgroup v2 or v1). None where nothing reports it."""
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:
        available = _meminfo("MemAvailable:")
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            room = max(0, limit - usage)
            available = room if available is None else min(available, room)
            break
    return available


def device_free_bytes(device, exclude: int = 0) -> int | None:
    """Memory a new allocation on `device` can get: what the driver has free (capped by the process's memory
    fraction) plus what PyTorch's allocator holds unused, less `exclude` (e.g. graph pools, which only their graphs
    reuse). None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    reserved = torch.cuda.memory_reserved(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        free = min(free, max(0, int(fraction(index) * total) - reserved))
    return max(0, free + reserved - torch.cuda.memory_allocated(index) - exclude)
