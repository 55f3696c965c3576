"""Running the transformer with only part of its weights on the GPU: what a partial (lowvram) load gets.

When the device has room for only part of the transformer, `BlockStreamer` keeps everything but the transformer
blocks (embeddings, modulation, output layers: small) and as many whole blocks as the byte budget allows on the device,
and every other block in host memory: one page-locked copy per block where pinning works, so its upload runs at the
link's full rate. `plan_stream` decides how many blocks stay resident for a budget (`plan_with` takes a count decided
elsewhere); `StreamPlan` says what that puts on the device.

The streamed blocks take turns in `plan.slots` fixed device buffers (two by default, three optionally;
stream_slots.py): every parameter and buffer of a streamed block is a view into its slot, so the weights' addresses
never change. Each step copies every streamed block into its slot on a copy stream, the first ones before the step's
first kernel, each later one as soon as the block before it in the same slot has run, ordered by events; the step's
kernels wait only for the block they are about to run. The copies and events are captured with the decode step, so
a streamed model replays a CUDA graph like a whole one (its graph key names the streamed blocks and the slots), at
about max(its compute, the streamed bytes / the host-to-device bandwidth). The prefix pass and eager steps run the
same schedule uncaptured; anything else that runs a block (diffusers' own forward, patched or ControlNet loops) fills
its slot first through the block's pre-hook or `placement.block_on_device`. A step that cannot be captured still
streams correctly, eagerly, with its reason counted and logged once: no CUDA, or page-locking refused (then the
slots are filled from pageable memory, synchronously).

`plan.slots == 0` is the eager way this replaced, kept to compare against (`python -m bench.streaming`): a fresh
device copy of each streamed block before it runs and dropped after (placement.StreamedBlock, forward hooks), every
step eager (decode/eligibility.py answers BLOCK_HOOKS or WEIGHTS_OFF_GPU).

Writes to weights go to the host copies (a LoRA merge, lora/merge.py, through `stream_slots.weights_on_host`): a slot
is overwritten every step. `stop()` removes the hooks, frees the slots and gives every streamed block tensors of its
own again: on a given device (a whole load follows) or on the host (an unload); the owner (loaded.py) releases the
graphs captured over the slots first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .report import block_sizes, gib, module_bytes
from .placement import StreamedBlock
from .stream_slots import SlotStreamer

logger = logging.getLogger("kvgraph")


# Device slots the streamed blocks take turns in (stream_slots.py): two let one block's upload overlap the compute of
# the block before it; three give an upload a whole block more of slack. 0 is the eager way (a fresh device copy per
# block per step, no graphs), kept to compare against.
DEFAULT_SLOTS = 2
SLOT_CHOICES = (0, 1, 2, 3)


def check_slots(slots) -> int:
    if slots not in SLOT_CHOICES:
        raise ValueError(f"stream slots {slots!r} is invalid: expected one of {', '.join(map(str, SLOT_CHOICES))} "
                         "(0: the eager per-block copies)")
    return int(slots)


@dataclass(frozen=True)
class StreamPlan:
    """Which blocks stay on the device under a byte budget: `resident_blocks` of `blocks`; the others (`streamed`,
    spread over the step) take turns in `slots` device buffers of `largest_block` bytes each (0: the eager way, one
    block's copy at a time)."""

    budget: int  # bytes the caller may put on the device
    total: int  # bytes of the whole transformer
    resident: int  # bytes kept on the device: everything outside the blocks, plus the resident blocks
    resident_blocks: int
    blocks: int
    largest_block: int  # bytes of the largest streamed block: the size of one slot
    slots: int = DEFAULT_SLOTS

    @property
    def streamed_blocks(self) -> int:
        return self.blocks - self.resident_blocks

    @property
    def streamed(self) -> tuple[int, ...]:
        """The indices of the streamed blocks (`streamed_indices`)."""
        return streamed_indices(self.blocks, self.streamed_blocks)

    @property
    def buffer_bytes(self) -> int:
        """Device memory the streamed blocks take beside `resident`: the slots (or, the eager way, one block's
        copy)."""
        return _buffers(self.slots, self.streamed_blocks) * self.largest_block

    @property
    def device_bytes(self) -> int:
        """Weights on the device during a step: the resident part and the slots."""
        return self.resident + self.buffer_bytes

    def describe(self, device="the GPU") -> str:
        how = (f"through {_buffers(self.slots, self.streamed_blocks)} device slots, uploads overlapped with compute "
               "and captured with the step" if self.slots else "one at a time; steps run eagerly")
        return (f"{gib(self.device_bytes)} of {gib(self.total)} of the transformer on {device}: "
                f"{self.streamed_blocks} of {self.blocks} blocks stream from the host every step {how} "
                f"({gib(self.resident)} stays on the device)")


def streamed_indices(blocks: int, streamed: int) -> tuple[int, ...]:
    """Which of `blocks` blocks stream when `streamed` of them do: spread evenly over the step, the last block
    among them. A streamed block's upload can only start once the block that used its slot before has run, so
    streamed blocks in a row leave the copy stream waiting on each other while the resident blocks before them
    ran with the link idle; spread out, each upload runs behind the resident blocks between them, and the step
    costs about max(its compute, the uploads) instead of the resident blocks' compute plus the uploads."""
    if not 0 <= streamed <= blocks:
        raise ValueError(f"streamed blocks {streamed} is out of range: expected 0 to {blocks}")
    return tuple((j + 1) * blocks // streamed - 1 for j in range(streamed)) if streamed else ()


def _buffers(slots: int, streamed: int) -> int:
    return max(1, min(slots, streamed)) if streamed else 0


def plan_stream(transformer: torch.nn.Module, budget: float, slots: int = DEFAULT_SLOTS) -> StreamPlan | None:
    """The plan for putting at most `budget` bytes of `transformer`'s weights on the device (the slots included),
    or None when the whole model fits (then it should simply be loaded whole). Everything outside the blocks always
    stays on the device, even where it alone exceeds the budget: the plan's `resident` says how much that is."""
    slots = check_slots(slots)
    total, sizes = block_sizes(transformer)
    if budget >= total:
        return None
    outside = total - sum(sizes)
    # The most resident blocks whose bytes plus the slots' fit (fewer resident blocks means more streamed ones,
    # never more slot bytes, so the first count from the top that fits is the answer).
    count = 0
    for resident_blocks in range(len(sizes) - 1, -1, -1):
        streamed = set(streamed_indices(len(sizes), len(sizes) - resident_blocks))
        rest = [size for i, size in enumerate(sizes) if i in streamed]
        need = outside + sum(sizes) - sum(rest) + _buffers(slots, len(rest)) * max(rest)
        if need <= budget:
            count = resident_blocks
            break
    return plan_with(transformer, count, slots, budget=budget)


def plan_with(transformer: torch.nn.Module, resident_blocks: int, slots: int = DEFAULT_SLOTS,
              budget: float | None = None) -> StreamPlan | None:
    """The plan that keeps `resident_blocks` blocks on the device and streams the others (`streamed_indices`), for a
    planner that decided the count itself (graph_runtime/memory); None when that is every block. `budget` defaults
    to what the plan puts there."""
    slots = check_slots(slots)
    total, sizes = block_sizes(transformer)
    if not 0 <= resident_blocks <= len(sizes):
        raise ValueError(f"resident_blocks {resident_blocks} is out of range: expected 0 to {len(sizes)}")
    if resident_blocks == len(sizes):
        return None
    rest = [sizes[i] for i in streamed_indices(len(sizes), len(sizes) - resident_blocks)]
    resident = total - sum(rest)
    largest = max(rest)
    budget = resident + _buffers(slots, len(sizes) - resident_blocks) * largest if budget is None else budget
    return StreamPlan(budget=int(budget), total=total, resident=resident, resident_blocks=resident_blocks,
                      blocks=len(sizes), largest_block=largest, slots=slots)


class BlockStreamer:
    """Puts `transformer` on `device` within `plan` (`plan_stream`): `start()` moves the weights and sets up the
    streamed blocks (device slots, `stream_slots.SlotStreamer`; with `plan.slots == 0` the eager per-block copies),
    `stop()` undoes it. `pin=None`: page-lock the host copies where the device is a CUDA device."""

    def __init__(self, transformer: torch.nn.Module, device, plan: StreamPlan, pin: bool | None = None):
        self.transformer = transformer
        self.device = torch.device(device)
        self.plan = plan
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._streamed: list[StreamedBlock] = []  # the eager way's hooks
        self.slots: SlotStreamer | None = None  # the slot way's streamer

    @property
    def active(self) -> bool:
        return bool(self._streamed) or self.slots is not None

    @property
    def host_bytes(self) -> int:
        """Host memory the streamed blocks' copies hold."""
        if self.slots is not None:
            return self.slots.host_bytes
        return sum(s.weights.host_bytes for s in self._streamed)

    @property
    def buffer_bytes(self) -> int:
        """Device memory the streamed blocks take beside the resident weights (the slots; the eager way: at most
        one block's copy, while it runs)."""
        return self.slots.buffer_bytes if self.slots is not None else self.plan.buffer_bytes

    @property
    def pinned(self) -> bool:
        """Whether every streamed block's host copy is page-locked."""
        if self.slots is not None:
            return self.slots.pinned
        return bool(self._streamed) and all(s.weights.pinned for s in self._streamed)

    @property
    def graph_reason(self) -> str | None:
        """Why the streamed steps cannot be captured (None when they can: the slot way with pinned host copies on
        CUDA)."""
        if self.slots is not None:
            return self.slots.graph_reason
        return "streamed blocks are copied the eager way (stream slots 0)"

    def start(self) -> "BlockStreamer":
        # Outside inference mode (ComfyUI loads models under `torch.inference_mode()`): the slots, the host copies and
        # the parameters viewing them are written in place by every later step, pass and LoRA merge, which run
        # outside it, and an inference tensor refuses in-place writes there.
        with torch.inference_mode(False):
            return self._start()

    def _start(self) -> "BlockStreamer":
        blocks = list(self.transformer.transformer_blocks)
        streamed_at = set(self.plan.streamed)
        # Streamed blocks first: if they were on the device (a whole load before), their memory is free before the
        # rest arrives.
        streamed = []
        try:
            if self.plan.slots:
                try:
                    self.slots = SlotStreamer({i: blocks[i] for i in sorted(streamed_at)}, self.device,
                                              self.plan.slots, self.pin)
                except TypeError as exc:  # tensor subclasses (GGUF): moved whole each way, the eager way
                    logger.info("KV-Graph: streamed blocks cannot use device slots (%s); they are copied one at a "
                                "time and their steps run eagerly.", exc)
            if self.slots is None:
                for i in sorted(streamed_at):
                    streamed.append(StreamedBlock(blocks[i], self.device, self.pin))
            for i, block in enumerate(blocks):
                if i not in streamed_at:
                    block.to(self.device)
            for child in self.transformer.children():
                if child is not self.transformer.transformer_blocks:
                    child.to(self.device)
            for name, tensor in (*self.transformer._parameters.items(), *self.transformer._buffers.items()):
                if tensor is not None:
                    tensor.data = tensor.data.to(self.device)
        except BaseException:
            for s in streamed:
                s.remove()
            if self.slots is not None:
                self.slots.stop()
                self.slots = None
            raise
        self._streamed = streamed
        reasons = {s.pin_failure or s.weights.fallback_reason for s in streamed} - {None}
        if reasons:
            logger.info("KV-Graph: streamed blocks are uploaded from pageable host memory (no pinned copy): %s.",
                        "; ".join(sorted(reasons)))
        return self

    def stop(self, device=None) -> None:
        """End streaming. Every streamed block gets tensors of its own again: on `device` when given (a whole load
        follows), else its host copy (what an unload expects); the slots are freed."""
        streamed, self._streamed = self._streamed, []
        slots, self.slots = self.slots, None
        if slots is not None:
            slots.stop(device)
            return
        if streamed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no upload still reads a host copy that is about to be unlocked
        for s in streamed:
            s.remove()
        if device is not None:
            blocks = list(self.transformer.transformer_blocks)
            for i in self.plan.streamed:
                blocks[i].to(device)
