"""Running the transformer with only part of its weights on the GPU: what a partial (lowvram) load gets.

When the device has room for only part of the transformer, `BlockStreamer` keeps everything but the transformer
blocks (embeddings, modulation, output layers: small) and as many whole blocks as the byte budget allows on the device,
and every other block in host memory: one page-locked copy per block where pinning works (`placement.PinnedWeights`),
so its upload runs at the link's full rate. A streamed block's weights are copied to the device just before the
block runs and dropped right after (the tensors point back at the host copy; nothing is copied back, since nothing
writes weights on the device), so any budget down to none of the blocks computes the same step, one block's weights
on the device at a time beyond the resident ones.

How a block learns that it runs: standard torch forward hooks (a pre-hook loads, a post-hook that also runs on an
exception drops). Every caller of the diffusers block's own forward (diffusers' transformer forward, the joint prefill
pass) fires them with no change. The decode step and the prefix pass do not call the block: their wrappers
(decode/step.py) read its submodules and weights directly, with fused kernels, so their loops enter
`placement.block_on_device(block)` around each wrapper call, which runs the same hook pair (`StreamedBlock`, in
placement.py with the pinned copies it moves, so the decode step needs nothing else of this module). Hooks keep the
streamer's state on the streamer (the handles remove it all) rather than on the diffusers blocks, and the loops stay
outside any compiled region.

A streamed model never replays or captures a decode graph: some of its weights are off the device whenever the
engine judges it, so `decode/eligibility.py` answers WEIGHTS_OFF_GPU and every step runs eagerly, counted and logged
once. Once `stop()`, the hooks are gone and the weights are back where a whole load expects to find them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .report import gib, module_bytes
from .placement import StreamedBlock

logger = logging.getLogger("kvgraph")


@dataclass(frozen=True)
class StreamPlan:
    """Which blocks stay on the device under a byte budget: the first `resident_blocks` of `blocks`."""

    budget: int  # bytes the caller may put on the device
    total: int  # bytes of the whole transformer
    resident: int  # bytes kept on the device: everything outside the blocks, plus the resident blocks
    resident_blocks: int
    blocks: int
    largest_block: int  # bytes of the largest streamed block: the most a step adds on the device for weights

    @property
    def streamed_blocks(self) -> int:
        return self.blocks - self.resident_blocks

    def describe(self, device="the GPU") -> str:
        return (f"{gib(self.budget)} of {gib(self.total)} of the transformer on {device}: "
                f"{self.streamed_blocks} of {self.blocks} blocks stream from the host every step "
                f"({gib(self.resident)} stays on the device); steps run eagerly")


def plan_stream(transformer: torch.nn.Module, budget: float) -> StreamPlan | None:
    """The plan for putting at most `budget` bytes of `transformer` on the device, or None when the whole model fits
    (then it should simply be loaded whole). Everything outside the blocks always stays on the device, even where
    it alone exceeds the budget: the plan's `resident` says how much that is."""
    total = module_bytes(transformer)
    if budget >= total:
        return None
    sizes = [module_bytes(block) for block in transformer.transformer_blocks]
    resident = total - sum(sizes)
    count = 0
    for size in sizes:
        if resident + size > budget:
            break
        resident += size
        count += 1
    return plan_resident(transformer, count, budget)


def plan_resident(transformer: torch.nn.Module, resident_blocks: int, budget: float | None = None) -> StreamPlan | None:
    """The plan that keeps the first `resident_blocks` blocks (and everything outside the blocks) on the device, as a
    memory plan decides (memory/plan.py `MemoryPlan.resident_blocks`); None when that is every block. `budget`: the
    bytes the caller may put there, for the description (default: what the plan keeps there)."""
    sizes = [module_bytes(block) for block in transformer.transformer_blocks]
    if not 0 <= resident_blocks <= len(sizes):
        raise ValueError(f"resident_blocks: {resident_blocks}: expected 0 to {len(sizes)}")
    if resident_blocks == len(sizes):  # also the rounding between the model's size and its blocks': nothing streams
        return None
    total = module_bytes(transformer)
    resident = total - sum(sizes[resident_blocks:])
    return StreamPlan(budget=int(resident if budget is None else min(budget, total)), total=total, resident=resident,
                      resident_blocks=resident_blocks, blocks=len(sizes), largest_block=max(sizes[resident_blocks:]))


class BlockStreamer:
    """Puts `transformer` on `device` within `plan` (`plan_stream`): `start()` moves the weights and hooks the
    streamed blocks, `stop()` removes the hooks and leaves every streamed block's weights on the host (what a whole
    load or an unload expects). `pin=None`: page-lock the host copies where the device is a CUDA device."""

    def __init__(self, transformer: torch.nn.Module, device, plan: StreamPlan, pin: bool | None = None):
        self.transformer = transformer
        self.device = torch.device(device)
        self.plan = plan
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._streamed: list[StreamedBlock] = []

    @property
    def active(self) -> bool:
        return bool(self._streamed)

    @property
    def host_bytes(self) -> int:
        """Host memory the streamed blocks' copies hold."""
        return sum(s.weights.host_bytes for s in self._streamed)

    @property
    def pinned(self) -> bool:
        """Whether every streamed block's host copy is page-locked."""
        return bool(self._streamed) and all(s.weights.pinned for s in self._streamed)

    def start(self) -> "BlockStreamer":
        blocks = self.transformer.transformer_blocks
        # Streamed blocks first: if they were on the device (a whole load before), their memory is free before the
        # rest arrives.
        streamed = []
        try:
            for block in list(blocks)[self.plan.resident_blocks:]:
                streamed.append(StreamedBlock(block, self.device, self.pin))
            for block in list(blocks)[:self.plan.resident_blocks]:
                block.to(self.device)
            for child in self.transformer.children():
                if child is not blocks:
                    child.to(self.device)
            for name, tensor in (*self.transformer._parameters.items(), *self.transformer._buffers.items()):
                if tensor is not None:
                    tensor.data = tensor.data.to(self.device)
        except BaseException:
            for s in streamed:
                s.remove()
            raise
        self._streamed = streamed
        reasons = {s.pin_failure or s.weights.fallback_reason for s in streamed} - {None}
        if reasons:
            logger.info("KV-Graph: streamed blocks are uploaded from pageable host memory (no pinned copy): %s.",
                        "; ".join(sorted(reasons)))
        return self

    def stop(self) -> None:
        """Remove the hooks; the streamed blocks' weights stay on the host (their host copies become ordinary
        memory once nothing else holds them)."""
        streamed, self._streamed = self._streamed, []
        if streamed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no upload still reads a host copy that is about to be unlocked
        for s in streamed:
            s.remove()
