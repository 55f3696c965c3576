"""A per-step check that the latents stay finite, without a host sync per step.

NaN weights (a damaged or wrongly converted checkpoint) or an overflow turn the latents NaN at some step, and the
VAE then decodes a black image that would otherwise be reported as a success. Each step here costs one reduction on
the device. On CUDA its result is copied to pinned host memory behind an event and read one step later, when that
event has long completed, so the host never waits for the step it just queued: the device keeps a step of work
queued, as it does without the check. The check runs between decode steps, outside any captured graph.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteError

CAUSE = ("the prompt, references and input latent were checked finite, so the transformer's weights are the likely "
         "cause (a damaged or wrongly converted checkpoint), or an overflow of its dtype")


class FiniteWatch:
    def __init__(self, device: torch.device, total: int):
        self.device, self.total = device, total
        self.deferred = device.type == "cuda"
        self._pending: list[tuple[int, torch.cuda.Event]] = []
        self._flags = torch.ones(total, dtype=torch.bool, pin_memory=True) if self.deferred else None

    def after_step(self, step: int, latents: torch.Tensor) -> None:
        """Queue the check of step `step`'s latents (1-based) and act on the previous step's result."""
        finite = torch.isfinite(latents).all()
        if not self.deferred:
            if not bool(finite):
                self._fail(step)
            return
        self._flags[step - 1].copy_(finite, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((step, event))
        while len(self._pending) > 1:
            self._check(*self._pending.pop(0))

    def finish(self) -> None:
        """Act on every result still queued (the last step's); call once after the loop."""
        while self._pending:
            self._check(*self._pending.pop(0))

    def _check(self, step: int, event: torch.cuda.Event) -> None:
        event.synchronize()
        if not bool(self._flags[step - 1]):
            self._fail(step)

    def _fail(self, step: int) -> None:
        self._pending.clear()
        raise NonFiniteError(f"the latents after step {step} of {self.total}", CAUSE)
