"""SM clock and board power while a path's steps are being timed, read from `nvidia-smi` (None without it).

A decode step at 1024x1024 is long enough for the card to reach its power cap, and then its clock, not our code,
sets the step time; recording both next to each timing shows which regime a number was measured in.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess

import torch


class ClockSampler:
    def __init__(self, device, period_ms: int = 100):
        self.enabled = torch.device(device).type == "cuda"
        self.index = torch.device(device).index or 0
        self.period_ms = period_ms
        self.samples: list[tuple[float, float]] = []
        self._proc = None

    def __enter__(self):
        if self.enabled and shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "-i", str(self.index), "--query-gpu=clocks.sm,power.draw",
                     "--format=csv,noheader,nounits", "-lms", str(self.period_ms)]
            self._proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        for line in out.splitlines():
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((clock, power))
        return False

    def summary(self) -> dict:
        if not self.samples:
            return {}
        return {"sm_clock_mhz": statistics.median(c for c, _ in self.samples),
                "power_w": statistics.median(p for _, p in self.samples)}
