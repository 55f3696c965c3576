"""Which steps of a core sampler's run made no transformer call: the steps a step cache answered (core's `EasyCache`
answers inside the model call, `LazyCache` before it; either way the sampler still reports the step).

The sampler reports each finished step through its callback; a step during which the run's count of model calls did
not move had none. Those steps are counted in the engine's statistics (`skipped_steps`, shown in the pack's status and
panel) and in the run's log line.
"""

from __future__ import annotations

from ..decode.stats import DecodeStats
from .run import SamplingRun


class StepsWithoutCalls:
    """Counts the steps of `run` that made no model call, into `stats.skipped_steps` as they finish."""

    def __init__(self, run: SamplingRun, stats: DecodeStats):
        self.run = run
        self.stats = stats
        self.skipped = 0
        self._calls_seen = 0

    def step_done(self) -> None:
        """Called once per finished sampler step (the sampler's callback)."""
        calls = self.run.counts.calls
        if calls == self._calls_seen:
            self.skipped += 1
            self.stats.skipped_steps += 1
        self._calls_seen = calls
