"""How much memory a new allocation can get, on the host (CPU) and on a CUDA device: what the memory budget
(graph_runtime/memory/sizes.py) checks against, what a graph capture checks before it allocates (decode/capture.py),
and the default bound of the ComfyUI nodes' model cache (graph_runtime/eviction.py).

`KVGRAPH_EMULATE_CARD_GB` caps a CUDA device's figure to a smaller card's size (`emulate_card` also caps PyTorch's
allocator there), so the plans of an 8-24 GB card run on a larger one.

psutil's figures where it is installed (ComfyUI requires it and reads the same ones), else /proc/meminfo; either is
capped by the limits of the memory cgroups the process runs in (v2 or v1, found through /proc/self), which is what
gets a process killed inside a container or a systemd scope.
"""

from __future__ import annotations

import os

import torch

# cgroup v1 writes a huge number (near 2^63) for "no limit", v2 writes "max".
_NO_LIMIT = 1 << 60
# Where the process's cgroups are named (/proc/self/cgroup) and mounted (/proc/self/mountinfo); tests point this at a
# fake tree.
PROC_SELF = "/proc/self"
# Per cgroup version: its limit file and its usage file.
_V2_FILES = ("memory.max", "memory.current")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes")


def _read_int(path) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_lines(path) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _memory_mounts(proc_self: str) -> list[tuple[str, str, tuple[str, str]]]:
    """(mount root inside the hierarchy, mount point, the version's files) of each mounted memory hierarchy: the
    cgroup2 one and a cgroup v1 one holding the memory controller. Without mountinfo: the usual places."""
    lines = _read_lines(os.path.join(proc_self, "mountinfo"))
    if not lines:
        return [("/", "/sys/fs/cgroup", _V2_FILES), ("/", "/sys/fs/cgroup/memory", _V1_FILES)]
    mounts = []
    for line in lines:
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if tail[0] == "cgroup2":
            mounts.append((root, point, _V2_FILES))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mounts.append((root, point, _V1_FILES))
    return mounts


def _memory_cgroups(proc_self: str) -> list[tuple[str, tuple[str, str]]]:
    """The folders of every memory cgroup that bounds this process (its own and each ancestor within the mount),
    each with its version's files. A cgroup path not found under its mount (a container that mounts only its own
    cgroup, as the hierarchy's root) leaves the mount point itself."""
    groups = {}
    for line in _read_lines(os.path.join(proc_self, "cgroup")):
        parts = line.split(":", 2)
        if len(parts) == 3:
            groups["v2" if parts[0] == "0" and parts[1] == "" else parts[1]] = parts[2]
    found = []
    for root, point, files in _memory_mounts(proc_self):
        path = groups.get("v2") if files is _V2_FILES else next(
            (p for c, p in groups.items() if "memory" in c.split(",")), None)
        relative = path if path is not None else "/"
        if root != "/" and (relative + "/").startswith(root.rstrip("/") + "/"):
            relative = relative[len(root.rstrip("/")):]
        parts = [p for p in relative.split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = os.path.join(point, *parts[:depth])
            if os.path.isdir(folder):
                found.append((folder, files))
    return found


def cgroup_memory(proc_self: str | None = None) -> tuple[int, int] | None:
    """(limit, room) of the memory cgroups this process runs in (v2 `memory.max` / `memory.current`, v1
    `memory.limit_in_bytes` / `memory.usage_in_bytes`, found through /proc/self/cgroup and /proc/self/mountinfo):
    the smallest limit among them and the least any of them has left (limit less usage); None when none is
    limited. What gets a process killed in a container, whatever the host has free."""
    limit = room = None
    for folder, (limit_file, usage_file) in _memory_cgroups(PROC_SELF if proc_self is None else proc_self):
        value = _read_int(os.path.join(folder, limit_file))
        if value is None or value >= _NO_LIMIT:
            continue
        usage = _read_int(os.path.join(folder, usage_file)) or 0
        limit = value if limit is None else min(limit, value)
        left = max(0, value - usage)
        room = left if room is None else min(room, left)
    return None if limit is None else (limit, room)


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
    """The machine's RAM (psutil, else /proc/meminfo), or the memory cgroup's limit when that is smaller."""
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:
        total = _meminfo("MemTotal:")
    cgroup = cgroup_memory()
    if cgroup is not None:
        return cgroup[0] if total is None else min(total, cgroup[0])
    return total


def host_available_bytes() -> int | None:
    """Memory a new host (CPU) allocation can get without swapping or being killed: what the OS reports available
    (psutil's figure, as ComfyUI reads it, else /proc/meminfo), capped by what the memory cgroups this process runs
    in have left (`cgroup_memory`). None where nothing reports it."""
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:
        available = _meminfo("MemAvailable:")
    cgroup = cgroup_memory()
    if cgroup is not None:
        return cgroup[1] if available is None else min(available, cgroup[1])
    return available


# Caps every CUDA device's memory to a card of this many GB (e.g. 8, 12, 16, 24), so the plans of a small card run
# and are measured on a large one.
EMULATE_CARD_ENV = "KVGRAPH_EMULATE_CARD_GB"


def gb_setting(name: str, expected: str) -> float | None:
    """The environment setting `name` as a positive, finite number of GB (the pack's settings in GB: a card's size,
    a link's rate), or None when unset or empty; anything else is refused naming the setting and `expected`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}={text!r} is invalid: expected {expected}")
    return value


def emulated_card_bytes() -> int | None:
    """The card size `KVGRAPH_EMULATE_CARD_GB` asks to emulate, in bytes (GB = 10^9, as cards are sold), or None
    when unset or empty."""
    gb = gb_setting(EMULATE_CARD_ENV, "a card size in GB, e.g. 8, 12, 16 or 24")
    return None if gb is None else int(gb * 1e9)


def emulate_card(device, card_bytes: int | None = None) -> int | None:
    """Make `device` behave like a card of `card_bytes` (default `emulated_card_bytes()`): PyTorch's allocator
    refuses to reserve beyond it (the per-process memory fraction), as a real card of that size would run out.
    Returns the card's bytes, or None when there is nothing to emulate. `device_free_bytes` honours the cap
    without this; the allocator's limit makes an allocation past it fail too."""
    card = emulated_card_bytes() if card_bytes is None else int(card_bytes)
    device = torch.device(device)
    if card is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.mem_get_info(index)[1]
    if card > total:
        raise ValueError(f"cannot emulate a {card / 1e9:g} GB card on {device}, which has {total / 1e9:.1f} GB")
    torch.cuda.set_per_process_memory_fraction(card / total, index)
    return card


def device_free_bytes(device, exclude: int = 0) -> int | None:
    """Memory a new allocation on `device` can get: what the driver has free (capped by the process's memory
    fraction, and by the emulated card's size when `KVGRAPH_EMULATE_CARD_GB` is set) plus what PyTorch's allocator
    holds unused, less `exclude` (e.g. graph pools, which only their graphs reuse). None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    reserved = torch.cuda.memory_reserved(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        free = min(free, max(0, int(fraction(index) * total) - reserved))
    card = emulated_card_bytes()
    if card is not None:
        # On a card of that size, what this process has not reserved is all that is free (other processes and the
        # CUDA context of the large card are not counted).
        free = min(free, max(0, card - reserved))
    return max(0, free + reserved - torch.cuda.memory_allocated(index) - exclude)


def emulated_card_room(device) -> int | None:
    """What `device` has free on the emulated card (`device_free_bytes`), or None when no card is emulated: a
    caller that is handed its own figure (ComfyUI's, for a partial load) takes the smaller."""
    if emulated_card_bytes() is None:
        return None
    return device_free_bytes(device)
