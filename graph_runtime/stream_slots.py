"""Fixed device slots for the streamed blocks of a partial load, and the upload protocol a step runs over them.

A partial load (streaming.py) keeps some blocks resident and streams the others (spread over the step) from the
host every step.
`SlotStreamer` gives the streamed blocks a fixed place on the device: two (or three) slot buffers, each as large as
the largest streamed block's weights. Every tensor of a streamed block (an int8 ConvRot layer's int8 `weight` and
fp32 `weight_scale`, an FP8 Linear's e4m3 weight and scale, plain bf16 weights) is packed into one host buffer with
aligned offsets (page-locked where CUDA can pin it), and the block's parameters and buffers are views into slot
`position % slots` at those same offsets. Loading a block is then one copy of its packed bytes into its slot, and the
weights' addresses never change, so a CUDA graph captured over a streamed step stays valid for as long as the
streamer lives.

A step (or the prefix pass) runs a `StreamPass` around its block loop:

- `start()`, before any other work of the step: the copy stream waits for the compute stream (nothing the step
  queued earlier still reads a slot), then the first block of each slot is copied in, so those uploads overlap
  img_in, the modulation and the resident blocks;
- `before(i)`: the compute stream waits on block i's "ready" event, recorded on the copy stream after its copy;
- `after(i)`: a "free" event is recorded on the compute stream after block i, and the next block that uses the same
  slot is copied in on the copy stream once that event has passed;
- `finish()`: the compute stream waits for the copy stream, so a captured graph joins every stream it forked.

Copies from page-locked memory on a side stream, event records and event waits are all capturable: captured, the
whole schedule becomes graph edges and a replay runs the uploads behind the compute with no host work. Without a
copy stream (no CUDA, or pinning refused: `graph_reason` says why) the same calls copy on the compute stream, in the
same order, which is also what the CPU tests exercise.

Code that runs a streamed block outside such a pass (diffusers' own block forward, a ControlNet's or a patched
block loop) goes through the block's forward pre-hook or `placement.block_on_device`: the block's bytes are copied
into its slot on the current stream each time, never trusting what a slot held before (a graph replay rewrites the
slots without telling the host).

Writes to weights must land in the host copy, which every step copies from: `SlotStreamer.weights_on_host()` points
the streamed blocks at their host copies for the duration (a LoRA merge, lora/merge.py) and back at their slots
after, at the same addresses, so captured graphs stay valid and read the merged weights on their next replay.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from .placement import BlockResidency, _Layout, _PinnedHostBuffer, _storage_tensors

logger = logging.getLogger("kvgraph")

# Reason strings double as the decode statistics' keys (decode/eligibility.py counts them).
UNPINNED = "streamed blocks' host copies are not page-locked (their uploads cannot be captured)"
NOT_CUDA = "streamed blocks are not on a CUDA device"


class SlotBlock(BlockResidency):
    """The forward pre-hook of one streamed block: its bytes are copied into its slot before each call, for every
    caller that runs the block outside a `StreamPass` (diffusers' forward, `block_on_device`)."""

    def __init__(self, streamer: "SlotStreamer", index: int):
        self.streamer, self.index = streamer, index

    def __call__(self, module, args) -> None:
        self.enter()

    def enter(self) -> None:
        self.streamer.fill(self.index)

    def exit(self) -> None:
        pass


class SlotStreamer:
    """Streams `blocks` (index -> diffusers block, the streamed ones, in order) through `slots` device buffers on
    `device`. `pin`: page-lock the host copies (copies then run on a copy stream and can be captured)."""

    def __init__(self, blocks: dict[int, torch.nn.Module], device, slots: int = 2, pin: bool = True):
        if not blocks:
            raise ValueError("SlotStreamer: no streamed blocks given")
        self.device = torch.device(device)
        self.order = sorted(blocks)
        self.slot_count = max(1, min(int(slots), len(self.order)))
        self.position = {index: j for j, index in enumerate(self.order)}
        self.blocks = blocks
        self.graph_reason: str | None = None
        self.pin_failure: str | None = None
        self._layouts: dict[int, _Layout] = {}
        self._hosts: dict[int, torch.Tensor] = {}
        self._owners = []  # the page-locked allocations (unlocked when the last reference goes)
        for index in self.order:
            tensors = _storage_tensors(blocks[index])
            if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
                raise TypeError(f"block {index} holds tensor subclasses, whose storage cannot live in a slot")
            self._layouts[index] = _Layout(tensors)
        # Host copies first: a block that was on the device (a whole load before) frees its memory before the slots
        # are allocated.
        pin = pin and self.device.type == "cuda" and torch.cuda.is_available()
        for index in self.order:
            layout = self._layouts[index]
            owner = None
            if pin and self.pin_failure is None:
                try:
                    owner = _PinnedHostBuffer(layout.nbytes)
                except (RuntimeError, torch.OutOfMemoryError) as exc:
                    self.pin_failure = f"page-locking {layout.nbytes / 2**20:.0f} MiB of host memory failed ({exc})"
            host = owner.tensor if owner is not None else torch.empty(layout.nbytes, dtype=torch.uint8)
            layout.move_into(host)
            self._hosts[index] = host
            if owner is not None:
                self._owners.append(owner)
        self.pinned = pin and self.pin_failure is None
        self.slot_bytes = max(layout.nbytes for layout in self._layouts.values())
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(self.slot_count)]
        # Each block's destination: the first `nbytes` of its slot, as a view made once.
        self._targets = {index: self.slots[self.slot_of(index)][:self._layouts[index].nbytes] for index in self.order}
        for index in self.order:
            self._layouts[index].point_at(self.slots[self.slot_of(index)])
        if self.device.type != "cuda":
            self.graph_reason = NOT_CUDA
        elif not self.pinned:
            self.graph_reason = UNPINNED
        self.copy_stream = torch.cuda.Stream(self.device) if self.pinned else None
        if self.graph_reason == UNPINNED:
            logger.info("KV-Graph: streamed blocks are copied into their slots synchronously from pageable host "
                        "memory (%s); their steps run eagerly.", self.pin_failure or "pinning not asked for")
        self.handles = [blocks[index].register_forward_pre_hook(SlotBlock(self, index)) for index in self.order]
        self._on_host = 0
        # One pass (or replay of a captured one) at a time: the slots are shared by every run of the model, so two
        # prompts sampled at once on other threads take turns for their steps (a whole model's weights, read-only,
        # need no such turn). Taken before the graphs' lock wherever both are held.
        self.lock = threading.RLock()

    # -- what the rest of the runtime reads -----------------------------------------------------------------------

    def slot_of(self, index: int) -> int:
        return self.position[index] % self.slot_count

    @property
    def host_bytes(self) -> int:
        return sum(layout.nbytes for layout in self._layouts.values())

    @property
    def buffer_bytes(self) -> int:
        """Device memory the slots hold."""
        return self.slot_bytes * self.slot_count

    def graph_key(self) -> tuple:
        """What a captured step's key carries about streaming: which blocks stream, through how many slots."""
        return (tuple(self.order), self.slot_count)

    # -- the protocol ---------------------------------------------------------------------------------------------

    def fill(self, index: int) -> None:
        """Copy block `index` into its slot on the current stream (outside a pass: ordered after whatever the
        stream queued, which includes every earlier pass's copies)."""
        self._copy(index)

    def _copy(self, index: int) -> None:
        self._targets[index].copy_(self._hosts[index], non_blocking=self.pinned)

    def new_pass(self, skip=frozenset()) -> "StreamPass":
        return StreamPass(self, [i for i in self.order if i not in skip])

    # -- weights written by others ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def weights_on_host(self):
        """Inside, every streamed block's tensors view its host copy (writes land where every step copies from);
        after, they view their slots again at the same addresses. Nested uses are fine; no pass runs meanwhile."""
        with self.lock:
            if self._on_host == 0:
                self._synchronize()  # no queued upload still reads a host copy that is about to change
                for index in self.order:
                    self._layouts[index].point_at(self._hosts[index])
            self._on_host += 1
            try:
                yield
            finally:
                self._on_host -= 1
                if self._on_host == 0:
                    for index in self.order:
                        self._layouts[index].point_at(self.slots[self.slot_of(index)])

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stop(self, device=None) -> None:
        """Remove the hooks and free the slots. Every streamed block gets tensors of its own: on `device` when
        given (new device tensors), else its host copy (what an unload expects)."""
        with self.lock:  # after any pass in progress
            self._synchronize()
            for handle in self.handles:
                handle.remove()
            self.handles = []
            for index in self.order:
                self._layouts[index].point_at(self._hosts[index])
                if device is not None:
                    self.blocks[index].to(device)
            self._targets, self.slots = {}, []
            self._hosts, self._owners = {}, []


class StreamPass:
    """One run of the blocks over a streamer's slots (see the module docstring). `order`: the streamed blocks that
    run, in order."""

    def __init__(self, streamer: SlotStreamer, order: list[int]):
        self.streamer = streamer
        self.order = order
        self.cuda = streamer.copy_stream is not None
        # The block after each one that uses the same slot (copied in once the earlier one's compute is done).
        self._next: dict[int, int] = {}
        last: dict[int, int] = {}
        for index in order:
            slot = streamer.slot_of(index)
            if slot in last:
                self._next[last[slot]] = index
            last[slot] = index
        self._ready: dict[int, torch.cuda.Event] = {}
        self._compute = None
        self._held = False

    def start(self) -> "StreamPass":
        """Queue the first block of each slot. Call before any other work of the step, so the uploads overlap it;
        `finish()` or `abort()` must follow (the pass holds the streamer's lock until then)."""
        self.streamer.lock.acquire()
        self._held = True
        try:
            self._start()
        except BaseException:
            self.abort()
            raise
        return self

    def _start(self) -> None:
        if self.cuda:
            self._compute = torch.cuda.current_stream(self.streamer.device)
            self.streamer.copy_stream.wait_stream(self._compute)
        firsts = {}
        for index in self.order:
            firsts.setdefault(self.streamer.slot_of(index), index)
        for index in sorted(firsts.values()):
            self._issue(index, None)

    def _issue(self, index: int, free: torch.cuda.Event | None) -> None:
        if not self.cuda:
            self.streamer._copy(index)
            return
        copy_stream = self.streamer.copy_stream
        with torch.cuda.stream(copy_stream):
            if free is not None:
                copy_stream.wait_event(free)
            self.streamer._copy(index)
            ready = torch.cuda.Event()
            ready.record(copy_stream)
        self._ready[index] = ready

    def before(self, index: int) -> None:
        """Block `index` is about to run: its weights must have arrived."""
        ready = self._ready.pop(index, None)
        if ready is not None:
            self._compute.wait_event(ready)

    def after(self, index: int) -> None:
        """Block `index` ran: its slot goes to the next block that uses it, once this compute is done."""
        following = self._next.get(index)
        if following is None:
            return
        free = None
        if self.cuda:
            free = torch.cuda.Event()
            free.record(self._compute)
        self._issue(following, free)

    def finish(self) -> None:
        """Join the copy stream back into the compute stream (a capture must end with every forked stream joined)
        and let the next pass start."""
        try:
            if self.cuda and self._compute is not None:
                self._compute.wait_stream(self.streamer.copy_stream)
        finally:
            if self._held:
                self._held = False
                self.streamer.lock.release()

    def abort(self) -> None:
        """The pass ended early (an exception): as `finish`."""
        self.finish()

    def __enter__(self) -> "StreamPass":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


class _NoPass:
    """The pass of a model with no streamed blocks: every call is a no-op."""

    def start(self):
        return self

    def before(self, index: int) -> None:
        pass

    def after(self, index: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


NO_PASS = _NoPass()


class _ResidencyPass(_NoPass):
    """The pass of blocks streamed the eager way (`placement.StreamedBlock`): each block's weights are put on the
    device before it runs and dropped after."""

    def __init__(self, blocks):
        self._hooks = [_residency(block) for block in blocks]
        self._inside = None

    def before(self, index: int) -> None:
        hook = self._hooks[index]
        if hook is not None:
            hook.enter()
            self._inside = hook

    def after(self, index: int) -> None:
        hook, self._inside = self._inside, None
        if hook is not None:
            hook.exit()

    def abort(self) -> None:
        self.after(-1)


def _residency(block) -> BlockResidency | None:
    hooks = block._forward_pre_hooks  # noqa: SLF001
    return next((h for h in hooks.values() if isinstance(h, BlockResidency)), None) if hooks else None


def streamer_of(blocks) -> SlotStreamer | None:
    """The slot streamer of a model's diffusers blocks (found on the last block's pre-hooks: the streamed blocks are
    the trailing ones), or None."""
    if not len(blocks):
        return None
    hooks = blocks[-1]._forward_pre_hooks  # noqa: SLF001 - where torch keeps them
    if not hooks:
        return None
    hook = next((h for h in hooks.values() if isinstance(h, SlotBlock)), None)
    return hook.streamer if hook is not None else None


def stream_pass(blocks, skip=frozenset()):
    """A started `StreamPass` over the model's diffusers `blocks` (those of `skip` do not run), or a no-op pass for a
    model without streamed blocks. Call it first in a step, before img_in, and use it as a context manager around the
    rest of the step: leaving it finishes the pass (also on an exception)."""
    streamer = streamer_of(blocks)
    if streamer is not None:
        return streamer.new_pass(skip).start()
    if len(blocks) and _residency(blocks[-1]) is not None:
        return _ResidencyPass(blocks)
    return NO_PASS


def exclusive(blocks):
    """Context manager for running a captured graph of the model's diffusers `blocks`: a streamed model's slots are
    held for it (the streamer's lock); any other model's run needs nothing."""
    streamer = streamer_of(blocks)
    return contextlib.nullcontext() if streamer is None else streamer.lock


def merge_device(model: torch.nn.Module) -> torch.device | None:
    """Where a LoRA merge computes the weights of a streamed model's host copies: the streamer's CUDA device (the
    sum and any re-quantization run there, the result is copied back), or None (where the weights are)."""
    blocks = getattr(model, "transformer_blocks", None)
    streamer = streamer_of(blocks) if blocks is not None else None
    return streamer.device if streamer is not None and streamer.device.type == "cuda" else None


def weights_on_host(model: torch.nn.Module):
    """Context manager: a streamed model's blocks view their host copies inside (writes to weights persist), any
    other model is left alone."""
    blocks = getattr(model, "transformer_blocks", None)
    streamer = streamer_of(blocks) if blocks is not None else None
    return contextlib.nullcontext() if streamer is None else streamer.weights_on_host()
