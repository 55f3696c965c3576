"""The text encoder's placement for one encode where no ComfyUI manages the models (the command line): the same
placements and the same `auto` decision (memory/plan.py `text_encoder_placement`) the loader nodes run, the
streamed one through the same layer stream (streamed.py)."""

from __future__ import annotations

import contextlib
import logging

import torch

from .. import free_memory
from ..memory import bytes_on
from ..memory import plan as plans
from ..placement import PinnedWeights
from .streamed import layer_stream

logger = logging.getLogger("kvgraph")

# A shell's one-word names for the loader nodes' `text_encoder_placement` choices.
CLI_PLACEMENTS = {"auto": plans.TE_AUTO, "offload": plans.TE_OFFLOAD, "gpu": plans.TE_GPU,
                  "streamed": plans.TE_STREAMED, "cpu": plans.TE_CPU}


class PlacedTextEncoder:
    """A text encoder encoding on `device` under `placement` (one of plans.TE_PLACEMENTS or TE_AUTO). Between
    encodes its weights stay on the device for `always gpu`, else on the host."""

    def __init__(self, module: torch.nn.Module, device, placement: str = plans.TE_AUTO):
        if placement not in (plans.TE_AUTO, *plans.TE_PLACEMENTS):
            raise ValueError(f"unknown text encoder placement {placement!r}")
        self.module, self.device, self.placement = module, torch.device(device), placement
        self.last: str | None = None  # the placement the last encode ran
        self._pinned: PinnedWeights | None = None  # the host copy layers stream from (made on the first such encode)
        if self.device.type != "cpu" and placement not in (plans.TE_GPU, plans.TE_AUTO):
            self._move("cpu")  # the host holds it until an encode needs it

    def _move(self, device) -> None:
        self.module.to(device)
        self._pinned = None  # the module's tensors are new ones: a host copy made before no longer backs them

    def resolve(self, tokens: int, beside: tuple[int, int] | None = None) -> str:
        """The placement an encode of about `tokens` runs: the set one, or for `auto` the memory plan's for what the
        device has free plus what the encoder already holds there. `beside`: `(the request's sampling bytes, what of
        them its models already hold on the device)`: where the encoder fits beside the sampling it stays on the
        device between prompts (`always gpu`) instead of leaving after each encode."""
        if self.placement != plans.TE_AUTO:
            return self.placement
        free = free_memory.device_free_bytes(self.device)
        if free is None:  # the CPU: the weights are there already, nothing to place
            return plans.TE_OFFLOAD
        size = plans.TextEncoderSize.of(self.module)
        available = free + bytes_on(self.module, self.device)
        sampling = None
        if beside is not None:
            sampling, held = beside
            available += held
        planned = plans.text_encoder_placement(size, tokens, available, sampling)
        logger.info("text encoder placement auto runs '%s' (%.2f GiB of %.2f GiB on %s for %d tokens)", planned,
                    size.gpu_bytes(planned, tokens) / 2**30, available / 2**30, self.device, tokens)
        return planned

    def _stream(self):
        """The (not started) layer stream of one encode, or None (logged) where the encoder cannot stream (no host
        copy to take layers from, no decoder layers): it then loads whole, as the nodes do."""
        if self._pinned is None:  # pinned: each layer's upload overlaps the layer before (streamed.py)
            self._pinned = PinnedWeights(self.module, self.device, log=False)
        weights = self._pinned if self._pinned.fallback_reason is None else None
        try:
            return layer_stream(self.module, self.device, weights)
        except TypeError as exc:
            logger.warning("the text encoder cannot stream by layer (%s); it loads whole for this encode", exc)
            return None

    @contextlib.contextmanager
    def encoding(self, tokens: int, beside: tuple[int, int] | None = None):
        """Inside: the encoder placed for one encode of about `tokens` (`beside`: as `resolve`'s); yields the device
        the encode computes on. On the CPU every placement runs whole where the weights are, as the loader nodes do
        (nothing to stream)."""
        placement = self.last = self.resolve(tokens, beside)
        if self.device.type == "cpu":
            yield self.device
            return
        if placement == plans.TE_CPU:
            self._move("cpu")
            yield torch.device("cpu")
            return
        # An encoder already on the device (`auto` before its first offload) encodes whole there, as the nodes do.
        stream = self._stream() if placement == plans.TE_STREAMED and bytes_on(self.module, self.device) == 0 else None
        if stream is not None:
            running = stream.start()
            try:
                yield running.device
            finally:
                running.stop()  # every weight back on the host copy, no hook left
            return
        self._move(self.device)
        try:
            yield self.device
        finally:
            if placement != plans.TE_GPU:
                # The encoder leaves the device once the prompt is encoded: the transformer and its graphs get it.
                self._move("cpu")
                torch.cuda.empty_cache()
