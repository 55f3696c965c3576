"""What a decode call is asked (its mode) and what it answers (the prediction, the path it took and why)."""

from __future__ import annotations

from typing import NamedTuple

import torch

DECODE_MODES = ("auto", "graph", "eager")


class DecodeOutcome(NamedTuple):
    output: torch.Tensor
    path: str  # "replay", "capture" (captured then replayed) or "eager"
    reason: str | None  # why eager, else None


def check_mode(mode: str) -> str:
    if mode not in DECODE_MODES:
        raise ValueError(f"decode mode {mode!r} is invalid: expected one of {', '.join(DECODE_MODES)}")
    return mode
