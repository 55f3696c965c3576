"""Weights that move between the host and the GPU without the round trip's cost.

The 8B text encoder (16.3 GB in bf16) is needed on the GPU for a few hundred milliseconds per changed prompt, and its
weights never change. Moving it with `module.to()` costs seconds each way (a device-to-host copy into fresh
pageable memory, then a pageable upload); a copy from page-locked (pinned) memory back to the GPU runs at the link's
full rate, many times faster (the measured times: docs/memory.md). So `PinnedWeights` keeps ONE page-locked host
copy of every parameter and buffer for the module's lifetime:

- `load(device)` allocates one device buffer, copies the host copy into it (one non-blocking copy, then one sync)
  and points every tensor at its slice;
- `offload()` points every tensor back at its slice of the host copy and drops the device buffer: no device-to-host
  copy at all, which is only right because nothing writes these weights on the GPU.

Both copies are single contiguous buffers, with each tensor at an aligned offset, so a load is one large transfer
and the host copy is pinned once (per-tensor pinning through the caching host allocator would round every tensor up
to a power of two). Tensors keep their Python identity (`tensor.data` is swapped), so tied weights and modules that
hold references stay consistent.

Where pinning is impossible or pointless (no CUDA, a CPU target, tensor subclasses, page-locking refused), the
module moves with ordinary `module.to()` calls instead; the reason is logged once and kept in `fallback_reason`.

A part of the module (`PinnedWeights.part`: a decoder layer, or everything outside the layers) can visit the device on
its own from its ranges of the same host copy (`WeightsPart`): the text encoder streamed by layer (layer_stream.py).

A transformer block of a partial load (streaming.py) streamed the eager way keeps its own host copy the same way:
`StreamedBlock` loads it before the block runs and drops it after (forward hooks: `ResidencyHooks`, which the text
encoder's streamed layers use too), and `block_on_device` does that for code that runs
the block's parts without calling the block (for blocks in device slots, stream_slots.py, it fills the block's slot).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

logger = logging.getLogger("kvgraph")

# Each tensor starts at a multiple of this many bytes in both buffers: what the caching allocator guarantees for
# separate allocations, so kernels that want aligned rows (vectorized loads, int8 GEMV) see the same alignment.
ALIGNMENT = 512


def _storage_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer once (a tied weight is one Parameter reached through two modules)."""
    seen, out = set(), []
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the whole storage behind `t` (views of one storage share it)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _Layout:
    """Where each region of the tensors' storages sits in the packed buffers, and how each tensor views its region.

    A region is the bytes of one storage that one group of overlapping tensors views: usually a whole storage, but
    tensors packed side by side in one buffer (a module packed here before) are a region each, so a part of the module
    (`WeightsPart`) can move without the rest."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        # Per region: (offset, nbytes, [(tensor, storage_offset within the region, size, stride), ...]).
        self.regions: list[tuple[int, int, list]] = []
        self._sources: list[int] = []  # per region: its first byte in its storage
        by_storage: dict[int, list[torch.Tensor]] = {}
        for t in tensors:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        offset = 0
        for group in by_storage.values():
            for lo, hi, members in _regions_of(group):
                self.regions.append((offset, hi - lo, [
                    (t, t.storage_offset() - lo // t.element_size(), tuple(t.shape), tuple(t.stride()))
                    for t in members]))
                self._sources.append(lo)
                offset += -(-(hi - lo) // ALIGNMENT) * ALIGNMENT
        self.nbytes = offset

    def move_into(self, buffer: torch.Tensor) -> None:
        """Copy every storage into its region of `buffer` (uint8, `nbytes`) and point its tensors there, one
        storage at a time, so each old storage can be freed before the next is copied."""
        for (start, nbytes, members), lo in zip(self.regions, self._sources):
            buffer[start:start + nbytes].copy_(_as_bytes(members[0][0])[lo:lo + nbytes])
            self._point(buffer, start, members)

    def point_at(self, buffer: torch.Tensor) -> None:
        """Make every tensor a view of its region of `buffer` (its `.data` swapped, its identity kept)."""
        for start, _nbytes, members in self.regions:
            self._point(buffer, start, members)

    def runs(self, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
        """The byte ranges of this layout that hold exactly `tensors`' storages, merged where they are adjacent: a
        submodule's weights (a decoder layer's) are one range. A storage shared with a tensor outside `tensors` is
        refused: its part could not move alone."""
        wanted = {id(t) for t in tensors}
        runs: list[list[int]] = []
        for start, nbytes, members in self.regions:
            inside = [id(m[0]) in wanted for m in members]
            if any(inside) and not all(inside):
                raise ValueError("a storage is shared between the part and the rest of the module")
            if all(inside):
                end = start + -(-nbytes // ALIGNMENT) * ALIGNMENT
                if runs and runs[-1][1] == start:
                    runs[-1][1] = end
                else:
                    runs.append([start, end])
        return [(a, b) for a, b in runs]

    def point_runs_at(self, runs: list[tuple[int, int]], buffer: torch.Tensor) -> None:
        """Point the tensors of `runs` (host offsets) at `buffer`, which holds those runs packed end to end."""
        placed = 0
        for a, b in runs:
            for start, _nbytes, members in self.regions:
                if a <= start < b:
                    self._point(buffer, placed + start - a, members)
            placed += b - a

    def point_runs_back(self, runs: list[tuple[int, int]], host: torch.Tensor) -> None:
        for a, b in runs:
            for start, _nbytes, members in self.regions:
                if a <= start < b:
                    self._point(host, start, members)

    @staticmethod
    def _point(buffer, start, members) -> None:
        storage = buffer.untyped_storage()
        for t, storage_offset, size, stride in members:
            view = torch.empty(0, dtype=t.dtype, device=buffer.device)
            view.set_(storage, start // t.element_size() + storage_offset, size, stride)
            t.data = view

    def points_into(self, buffer: torch.Tensor) -> bool:
        """Whether every tensor still views `buffer` where this layout put it (nobody moved or replaced it)."""
        base = buffer.data_ptr()
        for start, _nbytes, members in self.regions:
            for t, storage_offset, _size, _stride in members:
                if t.device != buffer.device or t.data_ptr() != base + start + storage_offset * t.element_size():
                    return False
        return True


def _regions_of(group: list[torch.Tensor]) -> list[tuple[int, int, list]]:
    """The byte ranges [lo, hi) of one storage that `group` (tensors viewing it) covers, overlapping views merged,
    with their tensors. Views at offsets that a region's start would misalign keep the whole storage as one region."""
    spans = []
    for t in group:
        size = t.element_size()
        extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        spans.append((t.storage_offset() * size, (t.storage_offset() + extent) * size, t))
    spans.sort(key=lambda span: span[0])
    merged: list[list] = []
    for lo, hi, t in spans:
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
            merged[-1][2].append(t)
        else:
            merged.append([lo, hi, [t]])
    if any((t.storage_offset() * t.element_size() - lo) % t.element_size() for lo, _hi, ts in merged for t in ts):
        return [(0, group[0].untyped_storage().nbytes(), list(group))]
    return [(lo, hi, ts) for lo, hi, ts in merged]


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock `buffer`'s memory in place (cudaHostRegister), so copies from it run at full bus speed."""
    status = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if status != 0:
        raise RuntimeError(f"cudaHostRegister returned {status}")


def _unpin(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
        pass


class _PinnedHostBuffer:
    """A pageable host allocation page-locked in place, unlocked when the last reference goes."""

    def __init__(self, nbytes: int):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        _pin(self.tensor)

    def __del__(self):
        if getattr(self, "tensor", None) is not None:
            _unpin(self.tensor.data_ptr())


class PinnedWeights:
    """One page-locked host copy of a module's weights; the device copy exists only while loaded.

    `device` is where `load()` puts the weights. `pin=False` keeps the host copy in ordinary memory (the tests use
    it to check the swap on a machine without CUDA; there the "device" may be the CPU). `log=False` leaves the
    logging to the caller (the block streamer keeps one copy per streamed block and says so once).
    """

    def __init__(self, module: torch.nn.Module, device, pin: bool = True, log: bool = True):
        self.device = torch.device(device)
        self.fallback_reason = self._unsupported(module, pin)
        self._module = module
        self._layout: _Layout | None = None
        self._host: torch.Tensor | None = None
        self._host_owner = None  # keeps the page-locked allocation alive (and unlocks it last)
        self._device_buffer: torch.Tensor | None = None
        self.pinned = False
        self.pin_failure: str | None = None  # why a wanted pinning failed (host_copy fell back to pageable)
        self.last_load_seconds = None
        self.last_offload_seconds = None
        self._log = log
        if self.fallback_reason is None:
            self._adopt(pin)
        if self.fallback_reason is not None and log:
            logger.info("KV-Graph: %s weights move with ordinary copies (no pinned host copy): %s.",
                        type(module).__name__, self.fallback_reason)

    @staticmethod
    def _unsupported(module, pin: bool) -> str | None:
        if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in _storage_tensors(module)):
            return "its weights include tensor subclasses, whose storage cannot be swapped"
        if not pin:
            return None
        device_types = {t.device.type for t in _storage_tensors(module)}
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if device_types - {"cpu", "cuda"}:
            return f"its weights are on {sorted(device_types)}"
        return None

    def _adopt(self, pin: bool) -> None:
        """Pack the module's current tensors (wherever they are) into one host buffer and point them at it."""
        layout = _Layout(_storage_tensors(self._module))
        start = time.perf_counter()
        try:
            owner = _PinnedHostBuffer(layout.nbytes) if pin else None
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            self.fallback_reason = f"page-locking {layout.nbytes / 2**30:.1f} GiB of host memory failed ({exc})"
            return
        host = owner.tensor if owner is not None else torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.move_into(host)
        self._layout, self._host, self._host_owner, self.pinned = layout, host, owner, owner is not None
        self._device_buffer = None
        if self._log:
            logger.info("KV-Graph: %s: %.1f GiB of weights in one %s host copy (%.1f s).", type(self._module).__name__,
                        layout.nbytes / 2**30, "pinned" if self.pinned else "pageable", time.perf_counter() - start)

    @property
    def host_bytes(self) -> int:
        """Host memory the copy holds (page-locked when `pinned`)."""
        return self._layout.nbytes if self._layout is not None else 0

    @property
    def loaded(self) -> bool:
        return self._device_buffer is not None

    def load(self, device=None, wait: bool = True) -> None:
        """Put the weights on `device` (default: the one given at construction), copying from the host copy.

        `wait=False` returns with the copy queued on the current stream: work queued after it on that stream reads
        the weights in order (the block streamer's way, so the host keeps queueing while the copy runs)."""
        device = torch.device(device) if device is not None else self.device
        if self.fallback_reason is not None:
            self._module.to(device)
            return
        self._check_still_ours()
        if self.fallback_reason is not None:
            self._module.to(device)
            return
        if self._device_buffer is not None and self._device_buffer.device == device:
            return
        start = time.perf_counter()
        buffer = torch.empty(self._layout.nbytes, dtype=torch.uint8, device=device)
        buffer.copy_(self._host, non_blocking=self.pinned)
        if buffer.is_cuda and wait:
            torch.cuda.current_stream(buffer.device).synchronize()
        self._layout.point_at(buffer)
        self._device_buffer = buffer
        self.last_load_seconds = time.perf_counter() - start

    def offload(self) -> None:
        """Point the weights back at the host copy and drop the device copy (no device-to-host copy)."""
        if self.fallback_reason is not None:
            self._module.to("cpu")
            return
        if self._device_buffer is None:
            return
        start = time.perf_counter()
        if not self._layout.points_into(self._device_buffer):
            # Someone moved or replaced tensors while loaded: their current values are the truth, so take them.
            logger.warning("KV-Graph: %s weights were changed on the device; copying them back instead of "
                           "dropping them.", type(self._module).__name__)
            self._device_buffer = None
            self._adopt(self.pinned)
            return
        self._layout.point_at(self._host)
        self._device_buffer = None
        self.last_offload_seconds = time.perf_counter() - start

    def part(self, tensors: list[torch.Tensor]) -> WeightsPart:
        """The part of this host copy that holds `tensors` (every storage they use, and nothing else's), to move on
        its own (layer_stream.py)."""
        if self._layout is None:
            raise TypeError(f"no host copy to take a part of: {self.fallback_reason}")
        self._check_still_ours()
        return WeightsPart(self, tensors)

    def _check_still_ours(self) -> None:
        """Before a load: the tensors must still view the host copy, or another mover took over since."""
        if self._device_buffer is None and not self._layout.points_into(self._host):
            logger.warning("KV-Graph: %s weights were moved outside their pinned copy; taking a new host copy.",
                           type(self._module).__name__)
            self._adopt(self.pinned)


class WeightsPart:
    """One part of a module's host copy (a decoder layer, or everything outside the layers) that visits the device on
    its own: `load()` copies its ranges of the host copy into one fresh device buffer, queued on the current stream
    (pinned: without blocking the host), and points its tensors there; `offload()` points them back and drops the
    buffer. No second host copy is made. The whole module must stay offloaded meanwhile."""

    def __init__(self, owner: "PinnedWeights", tensors: list[torch.Tensor]):
        self._owner = owner
        self.runs = owner._layout.runs(tensors)  # noqa: SLF001 - the part is the owner's own view
        self.nbytes = sum(b - a for a, b in self.runs)
        self._device_buffer: torch.Tensor | None = None

    @property
    def loaded(self) -> bool:
        return self._device_buffer is not None

    def load(self, device=None) -> None:
        owner = self._owner
        if owner.loaded:
            raise RuntimeError("the whole module is loaded: its parts cannot move on their own")
        device = torch.device(device) if device is not None else owner.device
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        placed = 0
        for a, b in self.runs:
            buffer[placed:placed + b - a].copy_(owner._host[a:b], non_blocking=owner.pinned)  # noqa: SLF001
            placed += b - a
        owner._layout.point_runs_at(self.runs, buffer)  # noqa: SLF001
        self._device_buffer = buffer

    def used_on(self, stream) -> None:
        """The device copy is read on `stream` too (it was copied on another): its memory is not reused before
        `stream` is done with it."""
        if self._device_buffer is not None and self._device_buffer.is_cuda:
            self._device_buffer.record_stream(stream)

    def offload(self) -> None:
        if self._device_buffer is None:
            return
        self._owner._layout.point_runs_back(self.runs, self._owner._host)  # noqa: SLF001
        self._device_buffer = None


class BlockResidency:
    """A forward pre-hook that puts a block's weights on the device for its run: `enter()` before, `exit()` after.
    `block_on_device` finds it among the block's hooks (the eager `StreamedBlock` below, the slot streamer's
    `stream_slots.SlotBlock`)."""

    def enter(self) -> None:
        raise NotImplementedError

    def exit(self) -> None:
        raise NotImplementedError


class ResidencyHooks(BlockResidency):
    """A module's forward pre-hook (the instance) and forward hook (`after`) that call `arrive()` before its run and
    `leave()` after it. A run entered again inside its own run (a wrapper calling it), or from another thread, arrives
    once and leaves when the last run ends. `remove()` takes the hooks off (and leaves, if a run was cut short)."""

    def __init__(self, module: torch.nn.Module):
        self._depth = 0
        self._lock = threading.Lock()
        self.handles = (module.register_forward_pre_hook(self),
                        module.register_forward_hook(self.after, always_call=True))

    def arrive(self) -> None:
        raise NotImplementedError

    def leave(self) -> None:
        raise NotImplementedError

    def __call__(self, module, args) -> None:
        self.enter()

    def after(self, module, args, output) -> None:
        self.exit()

    def enter(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self.arrive()

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self.leave()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        with self._lock:
            if self._depth:
                self._depth = 0
                self.leave()


def host_copy(module: torch.nn.Module, device, pin: bool) -> PinnedWeights:
    """`module`'s own host copy, packed from wherever its weights are now (a block of a whole load: straight from the
    device, with no second host copy on the way): pinned where `pin` and possible, else pageable (still no copy
    back); tensor subclasses keep no copy (the module is moved whole each way by `module.to`). The copy's
    `pin_failure` says why a wanted pinning failed."""
    weights = PinnedWeights(module, device, pin=pin, log=False)
    pin_failure = weights.fallback_reason if pin else None
    if weights.fallback_reason is not None and pin:
        weights = PinnedWeights(module, device, pin=False, log=False)
    if weights.fallback_reason is not None:
        module.to("cpu")
    weights.pin_failure = pin_failure
    return weights


class StreamedBlock(ResidencyHooks):
    """One block of a partial load (streaming.py) whose weights live on the host and visit the device while it runs.
    The instance is the block's forward pre-hook (`block_on_device` finds it there); `after` is its forward hook."""

    def __init__(self, block: torch.nn.Module, device: torch.device, pin: bool):
        self.weights = host_copy(block, device, pin)
        self.pin_failure = self.weights.pin_failure
        super().__init__(block)

    def arrive(self) -> None:
        self.weights.load(wait=False)

    def leave(self) -> None:
        self.weights.offload()


def block_on_device(block: torch.nn.Module):
    """Context manager around running `block` (a diffusers transformer block) by means other than its own forward:
    a streamed block's weights are on the device inside it; any other block is left alone."""
    hooks = block._forward_pre_hooks  # noqa: SLF001 - where torch keeps them; empty on a block that is not streamed
    streamed = next((h for h in hooks.values() if isinstance(h, BlockResidency)), None) if hooks else None
    return contextlib.nullcontext() if streamed is None else _entered(streamed)


@contextlib.contextmanager
def _entered(streamed: BlockResidency):
    streamed.enter()
    try:
        yield
    finally:
        streamed.exit()
