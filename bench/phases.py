"""Wall time and peak memory of the phases of one prompt, timed by wrapping the functions a phase runs.

Each phase is synchronized at both ends (on CUDA), so its time is the device work it queued, not only the host's.
Wrappers are attributes set on a module, an object or an instance and put back on exit, so the product code runs
unmodified outside the benchmark.
"""

from __future__ import annotations

import contextlib
import time

import torch

_ABSENT = object()


class Phases:
    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.ms: dict[str, float] = {}
        self.peak_gb: dict[str, float] = {}
        self.marks: dict[str, float] = {}  # name -> perf_counter seconds at a synced point
        self._max_seen = 0
        self.last_end: float | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _max_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def _reset_peak(self) -> None:
        if self.cuda:
            self._max_seen = max(self._max_seen, self._max_allocated())
            torch.cuda.reset_peak_memory_stats(self.device)

    def start(self) -> float:
        """The prompt starts: peak counters from here."""
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._max_seen = 0
        self.last_end = time.perf_counter()
        return self.last_end

    def mark(self, name: str) -> float:
        """A synced timestamp (e.g. the end of each sampling step of a pipeline that runs its own loop)."""
        self.sync()
        self.marks[name] = now = time.perf_counter()
        return now

    def peak_since_last_phase(self) -> float | None:
        """Peak allocated memory since the last phase ended (what ran between wrapped phases)."""
        return self._max_allocated() / 2**30 if self.cuda else None

    @property
    def overall_peak_gb(self) -> float | None:
        return max(self._max_seen, self._max_allocated()) / 2**30 if self.cuda else None

    @contextlib.contextmanager
    def phase(self, name: str):
        self.sync()
        gap_peak = self.peak_since_last_phase()
        if gap_peak is not None:
            self.peak_gb["between phases"] = max(self.peak_gb.get("between phases", 0.0), gap_peak)
        self._reset_peak()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.last_end = self.marks[f"end {name}"] = time.perf_counter()
            self.ms[name] = self.ms.get(name, 0.0) + (self.last_end - start) * 1e3
            if self.cuda:
                self.peak_gb[name] = max(self.peak_gb.get(name, 0.0), self._max_allocated() / 2**30)
                self._reset_peak()

    @contextlib.contextmanager
    def wrap(self, *targets):
        """`targets`: `(owner, attribute, phase name)`; each call of `owner.attribute` inside runs as that phase."""
        saved = []
        for owner, attr, name in targets:
            original = getattr(owner, attr)
            saved.append((owner, attr, vars(owner).get(attr, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT))

            def timed(*args, _fn=original, _name=name, **kwargs):
                with self.phase(_name):
                    return _fn(*args, **kwargs)

            setattr(owner, attr, timed)
        try:
            yield self
        finally:
            for owner, attr, before in reversed(saved):
                if before is _ABSENT:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, before)
