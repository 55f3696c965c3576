"""Prefill and decode for one loaded transformer: the decode step (eager or compiled) and its graph manager.

The engine is attached to the transformer (see `registry.engine_for`), so the compiled blocks and the captured
graphs survive from one generation to the next as long as the model stays loaded.
"""

from __future__ import annotations

import logging
import time

import torch

from .graph_manager import DecodeGraphManager, DecodeOutcome
from .layout import TokenLayout
from .prefill import PrefixCache, run_prefill
from .step import DecodeStep

logger = logging.getLogger("kvgraph")


class DecodeEngine:
    def __init__(self, transformer: torch.nn.Module, max_entries: int = 4, backend=None):
        self.manager = DecodeGraphManager(transformer, max_entries=max_entries, backend=backend)
        self.step = DecodeStep(transformer)
        self.compile_seconds = 0.0
        self.compiles = 0

    @property
    def transformer(self):
        return self.manager.transformer

    def enable_compile(self) -> bool:
        """Compile the blocks once per loaded model. Returns True when this call did the (lazy) compile setup."""
        if self.step.compiled:
            return False
        self.step.compile_blocks()
        self.compiles += 1
        return True

    def prefill(self, layout: TokenLayout, latents, encoder_hidden_states, timestep, text_mask=None,
                branch="cond") -> tuple[torch.Tensor, PrefixCache]:
        return run_prefill(self.transformer, layout, latents, encoder_hidden_states, timestep, text_mask, branch)

    def decode(self, prefix: PrefixCache, hidden: torch.Tensor, timestep: torch.Tensor, mode="auto") -> DecodeOutcome:
        return self.manager.decode(self.step, prefix, hidden, timestep, mode)

    def release(self) -> dict:
        return self.manager.release()

    def status(self) -> dict:
        status = self.manager.status()
        status.update(compiled=self.step.compiled, compiles=self.compiles)
        return status


def timed(fn, device) -> tuple[object, float]:
    """Run `fn` and return its result with its wall time in ms, synchronizing CUDA so the time is the GPU's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, (time.perf_counter() - start) * 1e3
