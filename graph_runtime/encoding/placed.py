"""The text encoder's placement for one encode where no ComfyUI manages the models (the command line): the same
placements and the same `auto` decision (memory/plan.py `text_encoder_placement`) the loader nodes run, the
streamed one through the same layer stream (streamed.py)."""

from __future__ import annotations

import contextlib
import logging

import torch

from .. import free_memory
from ..memory import plan as plans
from .streamed import streamed_by_layer

logger = logging.getLogger("kvgraph")

# A shell's one-word names for the loader nodes' `text_encoder_placement` choices.
CLI_PLACEMENTS = {"auto": plans.TE_AUTO, "offload": plans.TE_OFFLOAD, "gpu": plans.TE_GPU,
                  "streamed": plans.TE_STREAMED, "cpu": plans.TE_CPU}


def _bytes_on(module: torch.nn.Module, device: torch.device) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.device == device)


class PlacedTextEncoder:
    """A text encoder encoding on `device` under `placement` (one of plans.TE_PLACEMENTS or TE_AUTO). Between
    encodes its weights stay on the device for `always gpu`, else on the host."""

    def __init__(self, module: torch.nn.Module, device, placement: str = plans.TE_AUTO):
        if placement not in (plans.TE_AUTO, *plans.TE_PLACEMENTS):
            raise ValueError(f"unknown text encoder placement {placement!r}")
        self.module, self.device, self.placement = module, torch.device(device), placement
        self.last: str | None = None  # the placement the last encode ran
        if self.device.type != "cpu" and placement not in (plans.TE_GPU, plans.TE_AUTO):
            self.module.to("cpu")  # the host holds it until an encode needs it

    def resolve(self, tokens: int) -> str:
        """The placement an encode of about `tokens` runs: the set one, or for `auto` the memory plan's for what the
        device has free plus what the encoder already holds there."""
        if self.placement != plans.TE_AUTO:
            return self.placement
        free = free_memory.device_free_bytes(self.device)
        if free is None:  # the CPU: the weights are there already, nothing to place
            return plans.TE_OFFLOAD
        size = plans.TextEncoderSize.of(self.module)
        planned = plans.text_encoder_placement(size, tokens, free + _bytes_on(self.module, self.device))
        logger.info("text encoder placement auto runs '%s' (%.2f GiB of %.2f GiB on %s for %d tokens)", planned,
                    size.gpu_bytes(planned, tokens) / 2**30, (free + _bytes_on(self.module, self.device)) / 2**30,
                    self.device, tokens)
        return planned

    @contextlib.contextmanager
    def encoding(self, tokens: int):
        """Inside: the encoder placed for one encode of about `tokens`; yields the device the encode computes on.
        On the CPU every placement runs whole where the weights are, as the loader nodes do (nothing to stream)."""
        placement = self.last = self.resolve(tokens)
        if self.device.type == "cpu":
            yield self.device
            return
        if placement == plans.TE_CPU:
            self.module.to("cpu")
            yield torch.device("cpu")
            return
        if placement == plans.TE_STREAMED and _bytes_on(self.module, self.device) == 0:
            with streamed_by_layer(self.module, self.device) as stream:
                yield stream.device
            return
        self.module.to(self.device)
        try:
            yield self.device
        finally:
            if placement != plans.TE_GPU:
                # The encoder leaves the device once the prompt is encoded: the transformer and its graphs get it.
                self.module.to("cpu")
                torch.cuda.empty_cache()
