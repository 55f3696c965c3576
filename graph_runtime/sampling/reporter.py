"""What the sampling loop tells its caller while it runs: the prefill, captures, step 1's fallbacks, the first
replay, per-step progress and the final statistics.

The events (`on_event(name, data)`) feed the websocket messages and logs of the nodes and the CLI; progress
(`on_step(step, total, latents)`) feeds progress bars and previews.
"""

from __future__ import annotations

from typing import Callable

import torch


class SampleReporter:
    """One sampling run's reporter. `replay` is sent once per run, at the first step any branch replays a graph;
    `fallback` only for step 1's outcomes, which say why the whole run decodes eagerly (a later fallback, e.g.
    weights moved mid-run, shows in the final statistics instead)."""

    def __init__(self, on_event: Callable[[str, dict], None] | None = None,
                 on_step: Callable[[int, int, torch.Tensor], None] | None = None):
        self._emit = on_event or (lambda name, data: None)
        self._on_step = on_step
        self._replayed = False

    def prefill(self, ms: float, prefix_tokens: int, target_tokens: int) -> None:
        self._emit("prefill", {"ms": round(ms, 2), "prefix_tokens": prefix_tokens, "target_tokens": target_tokens})

    def decoded(self, step: int, branch: str, outcome) -> None:
        """One branch's decode outcome at `step` (1-based)."""
        if outcome.path == "capture":
            self._emit("capture", {"branch": branch, "step": step})
        elif outcome.reason is not None and step == 1:
            self._emit("fallback", {"branch": branch, "reason": outcome.reason})

    def step_done(self, step: int, paths: list[str]) -> None:
        """Every branch of `step` decoded, along `paths`."""
        if not self._replayed and "replay" in paths:
            self._replayed = True
            self._emit("replay", {"step": step})

    def progress(self, step: int, total: int, latents: Callable[[], torch.Tensor]) -> None:
        """`latents()` gives the step's latents unpacked; only called when someone listens."""
        if self._on_step is not None:
            self._on_step(step, total, latents())

    def done(self, stats: dict, timings: dict) -> None:
        self._emit("done", {**stats, **{k: round(v, 2) for k, v in timings.items() if isinstance(v, float)}})
