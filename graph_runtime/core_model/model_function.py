"""The model function core samplers call: normalized latents and a sigma in, the flow prediction out.

Every call is one decode step of the pack's runtime: the conditioning's prefix (text and reference images) is
prefilled the first time its run meets it and kept by the run (`run.py`); every call, the first included, then
decodes the target's tokens against it, replaying the captured graph of that shape when it may (the timestep is a
graph input, so a step at any sigma from any sampler replays the same graph). The numbers are the KV-Graph Sampler's:
the same noise, sigmas and timestep rounding give the same predictions.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..decode import DecodeEngine
from ..errors import InputError
from ..sampling.sampler import pack, unpack
from ..sampling.schedule import sigma_timestep
from .patches import ARBITRARY, NONE as NO_PATCHES, CallPatches
from .prefix_source import PrefixSource
from .run import SamplingRun

logger = logging.getLogger("kvgraph")

# Python block patches run in an eager step over the blocks alone, without a ControlNet's stream beside them.
PATCHES_WITH_CONTROL = ("Python block or attention patches together with a ControlNet",
                        "one of the two on a KV-Graph MODEL")

NO_RUN = ("called outside a sampling run (no sampler set one up), so its prefix is computed for this call alone and "
          "released after it")


class ModelFunction:
    """`(x [N, C, h, w] normalized latents, sigma [N], source) -> velocity [N, C, h, w]` for `engine`'s transformer.

    `run`: the sampling run the call belongs to (its prefixes live until the run ends), which decodes on its own
    engine; without one the call makes and releases its own run on `engine`, which is correct and pays a prefill per
    call (logged once). `roles`: core's `cond_or_uncond` for the call's chunks. `engine` may be a function returning
    the engine (the MODEL's: the engine of the attention its loaded model was last asked for).
    """

    def __init__(self, engine: DecodeEngine | Callable[[], DecodeEngine]):
        self._engine = engine
        self._warned_no_run = False

    @property
    def engine(self) -> DecodeEngine:
        return self._engine() if callable(self._engine) else self._engine

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, source: PrefixSource, run: SamplingRun | None = None,
                 roles=None, patches: CallPatches = NO_PATCHES) -> torch.Tensor:
        if not isinstance(source, PrefixSource):
            raise TypeError("KV-Graph: the model was called without its conditioning's prefix (a KV-Graph model "
                            "takes conditioning through ComfyUI's samplers, which prepare it with the model)")
        if run is None:
            if not self._warned_no_run:
                self._warned_no_run = True
                logger.warning("KV-Graph: the model was %s.", NO_RUN)
            with SamplingRun(self.engine) as own_run:
                return self._predict(x, sigma, source, own_run, roles, patches)
        return self._predict(x, sigma, source, run, roles, patches)

    def _predict(self, x, sigma, source, run: SamplingRun, roles, patches: CallPatches) -> torch.Tensor:
        engine = run.engine
        transformer = engine.transformer
        param = next(transformer.parameters())
        device, dtype = param.device, param.dtype
        batch, _, height, width = x.shape
        run.start()
        # Outside inference mode: the tensors handed to the static graph buffers must be normal tensors (ComfyUI
        # samples under `torch.inference_mode()`).
        with torch.inference_mode(False), torch.no_grad():
            hidden = pack(x.to(device, dtype))
            sigma = sigma.reshape(-1).to(device)
            timestep = sigma_timestep(sigma.expand(batch) if sigma.numel() == 1 else sigma, dtype)
            controlled = run.controlled(sigma)
            if patches.eager:
                if controlled:
                    raise InputError("model", *PATCHES_WITH_CONTROL)
                output = self._patched(x, source, run, (height, width), hidden, timestep, patches)
                run.count(sigma, "eager", ARBITRARY)
            else:
                prefix = run.prefix(source, roles, (height, width), hidden, timestep, controlled, patches.skip)
                outcome = engine.decode_step(prefix, hidden, timestep, run.mode)
                run.count(sigma, outcome.path, outcome.reason)
                output = outcome.output
            # On the caller's device: where the weights are not on it (an eager step, counted), the step ran on theirs.
            return unpack(output, height, width).to(x.device)

    def _patched(self, x, source, run: SamplingRun, shape, hidden, timestep, patches: CallPatches) -> torch.Tensor:
        """An eager step with other nodes' Python patches, counted in the engine's statistics (logged once)."""
        if run.engine.graphs.count_eager(ARBITRARY):
            logger.info("KV-Graph: decoding eagerly: %s.", ARBITRARY)
        return run.patched_step(source, shape, hidden, timestep, patches, latent=x)
