"""SM clock, board power and what limits the clock while a path's steps are being timed, read from `nvidia-smi`
(nothing without it).

A decode step at 1024x1024 is long enough for the card to reach its power cap, and then its clock, not our code,
sets the step time; recording the clock, the power and the driver's reasons for holding the clock down next to each
timing shows which regime a number was measured in.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import subprocess

import torch

# The driver's clock event reasons that hold the SM clock down (NVML's nvmlClocksEventReason* bits); sync boost and
# display clocks never apply to a compute card.
LIMIT_REASONS = {
    0x2: "application clocks",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
# The query field was renamed from "throttle" to "event" reasons; older drivers know only the first name.
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


@functools.cache
def _reason_field(index: int) -> str | None:
    """The name this driver knows the active clock reasons by (asked once per process and card)."""
    for field in _REASON_FIELDS:
        probe = subprocess.run(["nvidia-smi", "-i", str(index), f"--query-gpu={field}", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        if probe.returncode == 0 and probe.stdout.strip().startswith("0x"):
            return field
    return None


def limit_reasons(mask: int) -> list[str]:
    """The clock limits set in an active-reasons bit mask, in bit order (idle and unknown bits are left out)."""
    return [name for bit, name in LIMIT_REASONS.items() if mask & bit]


def clock_limit(masks: list[int]) -> str | None:
    """The limits active in at least half of the samples, joined by "+", "none" when no limit was, None without
    samples."""
    if not masks:
        return None
    counts: dict[str, int] = {}
    for mask in masks:
        for name in limit_reasons(mask):
            counts[name] = counts.get(name, 0) + 1
    held = [name for name in LIMIT_REASONS.values() if 2 * counts.get(name, 0) >= len(masks)]
    return "+".join(held) or "none"


class ClockSampler:
    def __init__(self, device, period_ms: int = 100):
        self.enabled = torch.device(device).type == "cuda"
        self.index = torch.device(device).index or 0
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, int | None]] = []
        self._proc = None

    def __enter__(self):
        if self.enabled and shutil.which("nvidia-smi"):
            fields = ["clocks.sm", "power.draw"] + [f for f in [_reason_field(self.index)] if f]
            query = ["nvidia-smi", "-i", str(self.index), "--query-gpu=" + ",".join(fields),
                     "--format=csv,noheader,nounits", "-lms", str(self.period_ms)]
            self._proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        self.samples.extend(filter(None, map(parse_sample, out.splitlines())))
        return False

    def summary(self) -> dict:
        if not self.samples:
            return {}
        masks = [m for _, _, m in self.samples if m is not None]
        summary = {"sm_clock_mhz": statistics.median(c for c, _, _ in self.samples),
                   "power_w": statistics.median(p for _, p, _ in self.samples)}
        if masks:
            summary["clock_limit"] = clock_limit(masks)
        return summary


def parse_sample(line: str) -> tuple[float, float, int | None] | None:
    """One `clock, power[, reasons]` line of the query; None for a line that is not one (a header, an error)."""
    parts = [p.strip() for p in line.split(",")]
    try:
        clock, power = float(parts[0]), float(parts[1])
        mask = int(parts[2], 16) if len(parts) > 2 else None
    except (ValueError, IndexError):
        return None
    return clock, power, mask
