"""Where a request's prefix K/V live between the prefill and the decode steps: its *placement*.

- `gpu`: every block's `[B, P + T, H, D]` K and V buffer on the device, prefix rows written by the prefill (the
  layout graph entries always had; no `PrefixStore`).
- `int8`: every block's prefix rows as int8 with one fp32 scale per token and head on the device, dequantized before
  the block's attention into one shared working `[B, P + T, H, D]` K and V buffer, whose target rows the step writes.
- `host`: every block's prefix rows in pinned host memory, copied into two working buffers in turn on a copy stream,
  each copy overlapped with the previous block's compute and ordered by events (inside a captured step too).
- `recompute`: no prefix cache; every step runs the whole joint sequence (engine.py), the last resort.

`auto` is not a placement but a request to choose one: the memory budget resolves it (graph_runtime/memory).
A `PrefixStore` is either a graph entry's (static, what its captured step reads) or a request's own (when it holds
no entry: its eager steps read it). `DecodeStep.forward` drives one through `begin_step`, `before_block`,
`after_block` and `end_step`; the prefill writes into `prefix_rows(i)` and calls `stash(i)` after each block.
"""

from __future__ import annotations

import logging

import torch

from ..errors import InputError
from ..kernels.kv_int8 import dequantize_rows, quantize_rows

logger = logging.getLogger("kvgraph")

AUTO = "auto"
GPU, INT8, HOST, RECOMPUTE = "gpu", "int8", "host", "recompute"
PLACEMENTS = (GPU, INT8, HOST, RECOMPUTE)  # in the order `auto` tries them
PLACEMENT_CHOICES = (AUTO, *PLACEMENTS)
STORED = (INT8, HOST)  # the placements a PrefixStore holds

_logged: set[str] = set()  # process-wide: a refused pinning is a property of the machine, said once


def check_placement(value, name: str = "prefix_placement", choices=PLACEMENT_CHOICES) -> str:
    if value not in choices:
        raise InputError(name, value, "one of " + ", ".join(choices))
    return value


def working_slots(placement: str) -> int:
    """Working buffers a stored placement needs: the int8 rows are dequantized in the step's own stream right before
    the block reads them, so one is enough; host copies run one block ahead, so they alternate between two."""
    return 2 if placement == HOST else 1


def store_bytes(placement: str, batch: int, prefix: int, target: int, heads: int, head_dim: int, blocks: int,
                itemsize: int) -> tuple[int, int]:
    """`(device bytes, host bytes)` of a request's K/V buffers under `placement` (prefix and target rows), for the
    memory budget. `recompute` holds none; `gpu` holds every block's `[B, P + T]` K and V on the device."""
    row = heads * head_dim
    if placement == RECOMPUTE:
        return 0, 0
    if placement == GPU:
        return 2 * blocks * batch * (prefix + target) * row * itemsize, 0
    working = 2 * working_slots(placement) * batch * (prefix + target) * row * itemsize
    if placement == INT8:
        return working + 2 * blocks * batch * prefix * (row + 4 * heads), 0
    if placement == HOST:
        return working, 2 * blocks * batch * prefix * row * itemsize
    raise ValueError(f"unknown prefix placement {placement!r}")


def _pinned_empty(shape, dtype) -> tuple[torch.Tensor, bool]:
    """Page-locked host memory (what an asynchronous copy, and a captured one, needs), or pageable memory where the
    system refuses to pin it."""
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True), True
    except RuntimeError as exc:
        if "pinned" not in _logged:
            _logged.add("pinned")
            logger.warning("KV-Graph: pinned host memory refused (%s): the host prefix is copied synchronously, "
                           "and its steps decode eagerly on CUDA.", f"{type(exc).__name__}: {exc}"[:200])
        return torch.empty(shape, dtype=dtype), False


def release_host_cache() -> None:
    """Hand pinned host memory that no tensor uses any more back to the system: PyTorch's pinned-memory allocator keeps
    freed blocks cached, so a dropped host prefix (gigabytes) would otherwise stay locked in this process."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        # A freed pinned block whose last copy's event has not completed stays cached through emptyCache; the copies
        # that used a dropped prefix are done once the device is (never while a graph is being captured).
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        empty()


class PrefixStore:
    """One request's (or graph entry's) prefix K/V under a stored placement, and the working buffers a step reads."""

    def __init__(self, placement: str, batch: int, prefix_len: int, target_tokens: int, heads: int, head_dim: int,
                 blocks: int, dtype: torch.dtype, device):
        if placement not in STORED:
            raise ValueError(f"a PrefixStore holds an int8 or host prefix, not {placement!r}")
        self.placement, self.prefix_len, self.dtype = placement, prefix_len, dtype
        self.device = torch.device(device)
        stored = (batch, prefix_len, heads, head_dim)
        work = (batch, prefix_len + target_tokens, heads, head_dim)
        self.pinned = False
        # Outside inference mode, as a graph entry's buffers: copy_ into them is legal from any grad mode.
        with torch.inference_mode(False):
            slots = working_slots(placement)
            self.work_k = [torch.zeros(work, dtype=dtype, device=self.device) for _ in range(slots)]
            self.work_v = [torch.zeros(work, dtype=dtype, device=self.device) for _ in range(slots)]
            if placement == INT8:
                self.k = [torch.zeros(stored, dtype=torch.int8, device=self.device) for _ in range(blocks)]
                self.v = [torch.zeros(stored, dtype=torch.int8, device=self.device) for _ in range(blocks)]
                scale = (batch, prefix_len, heads, 1)
                self.k_scale = [torch.zeros(scale, dtype=torch.float32, device=self.device) for _ in range(blocks)]
                self.v_scale = [torch.zeros(scale, dtype=torch.float32, device=self.device) for _ in range(blocks)]
            else:
                on_cuda = self.device.type == "cuda"
                if not on_cuda and "no-cuda" not in _logged:
                    _logged.add("no-cuda")
                    logger.info("KV-Graph: no CUDA device: the host prefix is copied synchronously before each "
                                "block.")
                made = [_pinned_empty(stored, dtype) if on_cuda else (torch.empty(stored, dtype=dtype), False)
                        for _ in range(2 * blocks)]
                self.pinned = on_cuda and all(pinned for _, pinned in made)
                self.k = [t for t, _ in made[:blocks]]
                self.v = [t for t, _ in made[blocks:]]
                self.k_scale = self.v_scale = []
        self._streamed = self.pinned  # copies on a side stream, overlapped; else synchronous, in order
        if self._streamed:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._copied = [torch.cuda.Event() for _ in range(slots)]
            self._used = [torch.cuda.Event() for _ in range(slots)]
        self._order: list[int] = []

    # -- what the budget and the status read ------------------------------------------------------------------------

    def _tensors(self):
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    @property
    def device_bytes(self) -> int:
        own = [*self.work_k, *self.work_v] + (self._tensors() if self.placement == INT8 else [])
        return sum(t.numel() * t.element_size() for t in own)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors()) if self.placement == HOST else 0

    # -- the prefill -----------------------------------------------------------------------------------------------

    def prefix_rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where block `i`'s prefix pass writes its K/V rows: the prefix rows of a working buffer."""
        slot = i % len(self.work_k)
        return self.work_k[slot][:, : self.prefix_len], self.work_v[slot][:, : self.prefix_len]

    def stash(self, i: int) -> None:
        """Block `i`'s prefix rows, just written into `prefix_rows(i)`, into the store: quantized, or copied to the
        host (stream-ordered: the next block that reuses the working buffer writes after the copy)."""
        k_rows, v_rows = self.prefix_rows(i)
        if self.placement == INT8:
            quantize_rows(k_rows, self.k[i], self.k_scale[i])
            quantize_rows(v_rows, self.v[i], self.v_scale[i])
        else:
            self.k[i].copy_(k_rows, non_blocking=self.pinned)
            self.v[i].copy_(v_rows, non_blocking=self.pinned)

    def finish_prefill(self) -> None:
        """The host copies have landed before anything on the host reads them (`copy_from`)."""
        if self.placement == HOST and self.pinned:
            torch.cuda.current_stream(self.device).synchronize()

    def copy_from(self, other: "PrefixStore") -> None:
        """Take `other`'s prefix (a request's own store into a graph entry's)."""
        other.finish_prefill()
        if self.placement == HOST and self.device.type == "cuda":
            # Host rows are written by the CPU, outside stream order: a replay of the entry's previous owner may
            # still be reading them.
            torch.cuda.synchronize(self.device)
        for dst, src in zip(self._tensors(), other._tensors()):
            dst.copy_(src)

    # -- one decode step (DecodeStep.forward) ----------------------------------------------------------------------

    def working(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V buffers the `position`-th block of the step attends over."""
        slot = position % len(self.work_k)
        return self.work_k[slot], self.work_v[slot]

    def begin_step(self, order: list[int]) -> None:
        """A step over blocks `order` starts: the first blocks' host copies go out (one per working buffer)."""
        self._order = order
        if self.placement == HOST and self._streamed:
            stream = torch.cuda.current_stream(self.device)
            # Fork: the copy stream starts after what the step's stream did before (the previous step's reads).
            self._copy_stream.wait_stream(stream)
            for position in range(min(len(self.work_k), len(order))):
                self._copy(position)

    def before_block(self, position: int) -> None:
        """The prefix rows of the `position`-th block are in its working buffer before it runs."""
        i = self._order[position]
        k, v = self.working(position)
        if self.placement == INT8:
            dequantize_rows(self.k[i], self.k_scale[i], k[:, : self.prefix_len])
            dequantize_rows(self.v[i], self.v_scale[i], v[:, : self.prefix_len])
        elif self._streamed:
            torch.cuda.current_stream(self.device).wait_event(self._copied[position % len(self.work_k)])
        else:
            k[:, : self.prefix_len].copy_(self.k[i])
            v[:, : self.prefix_len].copy_(self.v[i])

    def after_block(self, position: int) -> None:
        """The `position`-th block is done with its working buffer: the copy for the block that reuses it may
        start (after this block's compute, beside the next block's)."""
        later = position + len(self.work_k)
        if self.placement == HOST and self._streamed and later < len(self._order):
            slot = position % len(self.work_k)
            self._used[slot].record(torch.cuda.current_stream(self.device))
            self._copy_stream.wait_event(self._used[slot])
            self._copy(later)

    def end_step(self) -> None:
        """Join: the step's stream waits for the copy stream (a capture must end with every stream joined)."""
        if self.placement == HOST and self._streamed:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)

    def _copy(self, position: int) -> None:
        i, slot = self._order[position], position % len(self.work_k)
        with torch.cuda.stream(self._copy_stream):
            for dst, src in ((self.work_k[slot], self.k[i]), (self.work_v[slot], self.v[i])):
                for b in range(src.shape[0]):  # each batch's prefix rows are contiguous: one plain copy each
                    dst[b, : self.prefix_len].copy_(src[b], non_blocking=True)
            self._copied[slot].record(self._copy_stream)
