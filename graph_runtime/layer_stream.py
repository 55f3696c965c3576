"""Running a stack of layers (the text encoder's decoder layers) with only a layer or two of them on the device.

`LayerStream` takes a module's host copy (placement.PinnedWeights, made once) and puts everything outside the given
layers on the device for the run (embeddings, final norm, the vision tower: small next to the layers). Each layer
visits the device just before it runs, from its part of the same host copy (placement.WeightsPart: no second host
copy), and leaves right after, through its forward hooks (placement.ResidencyHooks, as streaming.py's eager blocks
do). Where the device is a CUDA device and the host copy is pinned, layer i+1's upload is queued on a copy stream
while layer i computes, and layer i+1's kernels wait for it by an event (after the last layer, the first one's upload
starts, for the next forward); the host waits for the layers that left before it queues an upload, so at most
`ahead + 1` layers are on the device at once. Otherwise (no CUDA, a pageable host copy) each layer is uploaded when it
is reached, in order on the compute stream: the same results, no overlap; the reason is logged once.

The hooks and the device copies go with `stop()`: the module is then exactly as before `start()`, every tensor
pointing at its host copy.
"""

from __future__ import annotations

import logging
import threading

import torch

from .placement import PinnedWeights, ResidencyHooks, _storage_tensors

logger = logging.getLogger("kvgraph")

_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


class _LayerHooks(ResidencyHooks):
    def __init__(self, stream: "LayerStream", index: int, layer: torch.nn.Module):
        self.stream, self.index = stream, index
        super().__init__(layer)

    def arrive(self) -> None:
        self.stream.arrive(self.index)

    def leave(self) -> None:
        self.stream.leave(self.index)


class LayerStream:
    """`layers` (submodules of `weights`' module, run in this order) streamed onto `device` from `weights`' host
    copy; everything else of the module is on `device` between `start()` and `stop()`. `ahead`: layers uploaded
    ahead of the one running (overlapped on a copy stream where possible)."""

    def __init__(self, weights: PinnedWeights, layers, device, ahead: int = 1, name: str = "the module"):
        if ahead < 0:
            raise ValueError(f"ahead {ahead!r}: expected 0 or more layers")
        self.weights, self.device, self.ahead, self.name = weights, torch.device(device), ahead, name
        self.layers = list(layers)
        layer_tensors = [_storage_tensors(layer) for layer in self.layers]
        in_layers = {id(t) for ts in layer_tensors for t in ts}
        self.parts = [weights.part(ts) for ts in layer_tensors]
        self.outside = weights.part([t for t in _storage_tensors(weights._module)  # noqa: SLF001
                                     if id(t) not in in_layers])
        self.overlap_reason = None
        if self.device.type != "cuda":
            self.overlap_reason = f"the device is {self.device.type}, not CUDA"
        elif not weights.pinned:
            self.overlap_reason = "the host copy is not page-locked" + (
                f" ({weights.pin_failure or weights.fallback_reason})"
                if (weights.pin_failure or weights.fallback_reason) else "")
        self._copy_stream = None
        self._ready: dict[int, torch.cuda.Event] = {}  # uploads queued on the copy stream, by layer
        self._done: list[torch.cuda.Event] = []  # the compute of layers that left, not yet waited for
        self._hooks: list[_LayerHooks] = []
        self._lock = threading.Lock()

    @property
    def outside_bytes(self) -> int:
        return self.outside.nbytes

    @property
    def layer_bytes(self) -> int:
        """The largest layer's bytes."""
        return max((p.nbytes for p in self.parts), default=0)

    @property
    def device_bytes(self) -> int:
        """Weights on the device at most: the outside part and the layers in flight."""
        in_flight = 1 + (self.ahead if self.overlap_reason is None else 0)
        return self.outside_bytes + min(in_flight, len(self.parts)) * self.layer_bytes

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def start(self) -> "LayerStream":
        if self._hooks:
            return self
        if self.overlap_reason is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        else:
            _log_once(f"KV-Graph: {self.name}'s layers are uploaded one at a time as they are reached, not "
                      f"overlapped with compute: {self.overlap_reason}.")
        self.outside.load(self.device)
        try:
            with self._lock:
                self._prefetch(0)  # in the copy stream's memory pool, as every later layer (no-op when synchronous)
            self._hooks = [_LayerHooks(self, i, layer) for i, layer in enumerate(self.layers)]
        except BaseException:
            self.stop()
            raise
        return self

    def arrive(self, index: int) -> None:
        with self._lock:
            part = self.parts[index]
            event = self._ready.pop(index, None)
            if event is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(event)
                part.used_on(compute)
            elif not part.loaded:
                part.load(self.device)  # queued on the compute stream, before the layer's kernels
            # The next layers; after the last, the first ones again (the next forward: the negative prompt's encode).
            for step in range(1, min(self.ahead, len(self.parts) - 1) + 1):
                self._prefetch((index + step) % len(self.parts))

    def _prefetch(self, index: int) -> None:
        part = self.parts[index]
        if self._copy_stream is None or part.loaded:
            return
        # The host runs ahead of the GPU: without this wait it would queue uploads of layers far ahead while the
        # memory of those that left is still read, and the device would hold many layers. Waiting for the layers that
        # left (all but the one now running) keeps `ahead + 1` layers there; the GPU still has the running layer's
        # compute to overlap this upload with.
        for event in self._done:
            event.synchronize()
        self._done.clear()
        with torch.cuda.stream(self._copy_stream):
            part.load(self.device)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self._ready[index] = event

    def leave(self, index: int) -> None:
        with self._lock:
            # Dropped at once: the caching allocator reuses the memory only after the compute queued on it (the copy
            # stream's buffers were marked used on the compute stream when they arrived).
            self.parts[index].offload()
            if self._copy_stream is not None:
                # Recorded after the free, so once it completes the allocator's own event for that memory has too.
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._done.append(event)

    def stop(self) -> None:
        """Remove the hooks and point every tensor back at the host copy."""
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()  # no upload still writes a buffer about to be dropped
        with self._lock:
            self._ready.clear()
            self._done.clear()
            for part in self.parts:
                part.offload()
            self.outside.offload()
        self._copy_stream = None
