"""A step cache for the sampling loop: steps whose model output can be predicted from the last computed step are
answered without running the transformer.

The rule is EasyCache's, as ComfyUI's `EasyCache` node applies it (its settings mean the same here):

- The model's input and output are compared on a subsampled grid (every 8th latent row and column) as mean absolute
  values. After two computed steps the cache knows the ratio k = (change of the output) / (change of the input).
- Within the active sigma range, each new step adds k * (change of the input since the last computed step) /
  (mean |last output|) to an accumulated estimate of how far the output moved. While that stays below
  `reuse_threshold` the step is skipped: each branch's output is the input plus that branch's last computed
  (output - input). A step that is computed resets the estimate.
- The range starts at `start_percent` and ends at `end_percent` of the model's sigma range, mapped to sigmas with the
  model's time shift (`flow_percent_to_sigma`); outside it every step is computed and nothing is remembered, so the
  first two steps of the range are always computed (they give the first ratio k).

`StepCache` is one run's state: the sampler makes one per run, asks `skip` before each step, hands `computed` the
outputs of the steps it ran, and drops it when the run ends (`summary` is its log line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError
from .schedule import flow_percent_to_sigma

SUBSAMPLE = 8  # every 8th latent row and column is compared (core's EasyCache node uses 8)
MAX_THRESHOLD = 3.0  # the widget range of core's EasyCache node


@dataclass(frozen=True)
class StepCacheSettings:
    """What the user set (the KV-Graph Step Cache node's inputs); checked where it is made."""

    reuse_threshold: float = 0.2
    start_percent: float = 0.15
    end_percent: float = 0.95

    def __post_init__(self):
        for name, low, high in (("reuse_threshold", 0.0, MAX_THRESHOLD), ("start_percent", 0.0, 1.0),
                                ("end_percent", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not low <= value <= high:
                raise InputError(name, value, f"a number in [{low:g}, {high:g}]")
        if self.end_percent <= self.start_percent:
            raise InputError("end_percent", self.end_percent,
                             f"more than start_percent ({self.start_percent:g}): with no range between them the "
                             "cache could never skip a step")

    def describe(self) -> str:
        return (f"threshold {self.reuse_threshold:g}, from {self.start_percent:g} to {self.end_percent:g} of the "
                "schedule")



def _grid(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed latents `[B, h * w, C]` on the subsampled grid (a view: nothing is copied)."""
    return tokens.view(tokens.shape[0], height, width, tokens.shape[2])[:, ::SUBSAMPLE, ::SUBSAMPLE]


def _mean_abs_change(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).flatten().abs().mean()


class StepCache:
    """One sampling run's step cache over packed latents `[B, height * width, C]`. `start_sigma` / `end_sigma`: the
    active range (sigma <= start_sigma and sigma > end_sigma). Values stay on the device; `skip` reads one number
    back (the decision)."""

    def __init__(self, settings: StepCacheSettings, start_sigma: float, end_sigma: float, height: int, width: int):
        self.settings = settings
        self.start_sigma, self.end_sigma = float(start_sigma), float(end_sigma)
        self.height, self.width = height, width
        self.steps = 0
        self.skipped = 0
        self._rate: torch.Tensor | None = None  # output change / input change between the last two computed steps
        self._accumulated = 0.0
        self._input_change: torch.Tensor | None = None  # of the step being decided, vs the last computed input
        self._last_input: torch.Tensor | None = None  # subsampled copies of the last computed step
        self._last_output: torch.Tensor | None = None
        self._last_norm: torch.Tensor | None = None
        self._diffs: dict[str, torch.Tensor] = {}  # branch -> (output - input) of the last computed step

    @classmethod
    def for_run(cls, settings: StepCacheSettings, mu: float, height: int, width: int) -> "StepCache":
        return cls(settings, flow_percent_to_sigma(settings.start_percent, mu),
                   flow_percent_to_sigma(settings.end_percent, mu), height, width)

    def _active(self, sigma: float) -> bool:
        return self.end_sigma < sigma <= self.start_sigma

    def skip(self, x: torch.Tensor, sigma: float, branches) -> bool:
        """Before the step at `sigma` with model input `x`: True when every branch of `branches` can be answered from
        the cache (`cached`), else False (the caller runs the model and calls `computed`)."""
        self.steps += 1
        self._input_change = None
        if not self._active(sigma):
            return False
        if self._last_input is not None:
            self._input_change = _mean_abs_change(_grid(x, self.height, self.width), self._last_input)
        if self._rate is None or self._last_norm is None or self._input_change is None:
            return False
        self._accumulated += float(self._rate * self._input_change / self._last_norm)
        if self._accumulated < self.settings.reuse_threshold and all(b in self._diffs for b in branches):
            self.skipped += 1
            return True
        self._accumulated = 0.0
        return False

    def cached(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        """A skipped step's output for `branch`: the input plus the branch's last computed (output - input)."""
        return x + self._diffs[branch]

    def computed(self, x: torch.Tensor, outputs: dict[str, torch.Tensor], sigma: float) -> None:
        """After a computed step: remember it (the first branch of `outputs` is the one the decisions read). Only steps
        in the active range are remembered, so the first skip can come at the third step of the range."""
        if not self._active(sigma):
            return
        first = _grid(next(iter(outputs.values())), self.height, self.width)
        if self._last_output is not None and self._input_change is not None:
            self._rate = _mean_abs_change(first, self._last_output) / self._input_change
        self._diffs = {name: out - x for name, out in outputs.items()}
        self._last_input = _grid(x, self.height, self.width).clone()
        self._last_output = first.clone()
        self._last_norm = next(iter(outputs.values())).flatten().abs().mean()

    def summary(self) -> str:
        speedup = self.steps / max(1, self.steps - self.skipped)
        return (f"KV-Graph Step Cache: skipped {self.skipped}/{self.steps} steps ({speedup:.2f}x fewer transformer "
                f"steps; {self.settings.describe()})")
