"""The quality guard: every path's decode output against an fp32 run of the reference.

Random weights make absolute PSNR misleading (two correct bf16 implementations of one step differ by ~26.6 dB
here), so the guard is relative: a path passes when its error against fp32 stays within 10% of the diffusers bf16
path's own error against fp32. The metric is the relative L2 error ||out - ref32|| / ||ref32|| over all target
rows of every CFG branch.
"""

from __future__ import annotations

import math

import torch

GUARD_RATIO = 1.10


def relative_error(outputs: list[torch.Tensor], references: list[torch.Tensor]) -> float:
    num = sum(((o.float().cpu() - r.float()) ** 2).sum().item() for o, r in zip(outputs, references))
    den = sum((r.float() ** 2).sum().item() for r in references)
    return math.sqrt(num / max(den, 1e-30))


def psnr_db(outputs, references) -> float:
    err = relative_error(outputs, references)
    return float("inf") if err == 0 else -20 * math.log10(err)


def max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
