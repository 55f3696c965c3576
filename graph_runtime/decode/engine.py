"""Prefill and decode for one loaded transformer: the decode step (eager or compiled) and its graph manager.

The engine is attached to the transformer (see `registry.engine_for`), so the compiled blocks and the captured
graphs survive from one generation to the next as long as the model stays loaded.
"""

from __future__ import annotations

import logging

import torch

from .graph_manager import DecodeGraphManager, DecodeOutcome
from .layout import TokenLayout
from .prefill import OwnerToken, PrefixCache, run_prefill
from .step import DecodeStep

logger = logging.getLogger("kvgraph")


class DecodeEngine:
    def __init__(self, transformer: torch.nn.Module, max_entries: int = 4, backend=None):
        self.manager = DecodeGraphManager(transformer, max_entries=max_entries, backend=backend)
        self.step = DecodeStep(transformer)
        self.compiles = 0

    @property
    def transformer(self):
        return self.manager.transformer

    def __reduce__(self):
        # A deep copy or pickle of the transformer must not share (or try to serialize) this engine's graphs and
        # lock: the copy gets no engine and creates its own on first use.
        return (_no_engine, ())

    def enable_compile(self) -> bool:
        """Compile the blocks once per loaded model (lazily: the first decode of each shape compiles).

        Only on CUDA: on CPU the compile costs more than it saves and needs a C++ toolchain. Returns True when
        this call set the compile up.
        """
        if self.step.compiled:
            return False
        device = next(self.transformer.parameters()).device
        if device.type != "cuda":
            logger.info("KV-Graph: block compile skipped: the model is on %s, not CUDA.", device)
            return False
        self.step.compile_blocks()
        self.compiles += 1
        return True

    def prefill(self, layout: TokenLayout, latents, encoder_hidden_states, timestep, text_mask=None,
                branch="cond", mode="auto", with_target=True) -> tuple[torch.Tensor | None, PrefixCache]:
        """Step 1. When this request can own a graph entry, the prefix goes straight into its static buffers.

        `with_target=False` (what the sampler does) runs only the prefix rows and returns no prediction; the caller
        then predicts step 1 with `decode`, like every later step, so step 1 replays the graph too: at 1024x1024
        that is a 128-token forward plus one graph step instead of a 4224-token eager forward, for the same math.
        """
        token = OwnerToken()
        entry = self.manager.claim(self.step, token, branch, layout, latents.shape[0],
                                   layout.joint_key_valid(text_mask), mode)
        static_kv = None if entry is None else (entry.inputs.k, entry.inputs.v)
        # The prefix pass of a claimed entry is captured once and replayed by later prompts with this key.
        runner = None if entry is None else (lambda inputs: self.manager.run_prefix(entry, inputs))
        out, prefix = run_prefill(self.transformer, layout, latents, encoder_hidden_states, timestep, text_mask,
                                  branch, static_kv=static_kv, with_target=with_target, prefix_runner=runner)
        prefix.owner = token
        if entry is not None:
            self.manager.bind(entry, prefix)
        return out, prefix

    def decode(self, prefix: PrefixCache, hidden: torch.Tensor, timestep: torch.Tensor, mode="auto") -> DecodeOutcome:
        return self.manager.decode(self.step, prefix, hidden, timestep, mode)

    def warm_up(self, sizes, prompt_tokens: int = 128, capture: bool = False) -> dict:
        """Set up, before a first prompt, what decoding these latent sizes `[(height, width), ...]` runs (kernels,
        cuBLAS/cuDNN plans, buffer memory); `capture=True` also keeps the graphs of a `prompt_tokens`-token text
        prompt. See `warm_up.py`."""
        from .warm_up import warm_up

        return warm_up(self, sizes, prompt_tokens=prompt_tokens, capture=capture)

    def release(self) -> dict:
        return self.manager.release()

    def status(self) -> dict:
        status = self.manager.status()
        status.update(compiled=bool(self.step.compiled), compiles=self.compiles)
        return status


def _no_engine():
    return None
