"""A diffusers folder's scheduler/scheduler_config.json, checked when it is read.

The sampler computes every schedule from these values (diffusers' flow-match Euler scheduler and the pipeline's
dynamic shift), so a bad one is refused here, naming the file and the key, instead of failing the first prompt with a
ZeroDivisionError or a TypeError from inside diffusers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, shorten
from .sources import read_json

SCHEDULER_EXPECTED = "a diffusers FlowMatchEulerDiscreteScheduler scheduler_config.json"
_SCHEDULER_FLAGS = ("use_dynamic_shifting", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                    "invert_sigmas", "stochastic_sampling")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_scheduler_config(config: dict[str, Any], path: Path) -> None:
    """The values the sampler's schedule is computed from, checked when the folder is read, so a bad one names
    scheduler_config.json instead of failing the first prompt with a ZeroDivisionError. Values the file leaves out
    are the defaults the sampler uses."""
    from ..sampling.schedule import DEFAULT_SCHEDULER_CONFIG, build_schedule

    merged = {**DEFAULT_SCHEDULER_CONFIG, **config}

    def refuse(key: str, needed: str):
        raise CheckpointError(path, f"has {key}={shorten(repr(merged[key]))}, which must be {needed}.",
                              SCHEDULER_EXPECTED)

    if not _integer(merged["num_train_timesteps"]) or merged["num_train_timesteps"] < 1:
        refuse("num_train_timesteps", "an integer of at least 1 (the model's 1000)")
    for key in ("shift", "base_shift", "max_shift"):
        if not _number(merged[key]):
            refuse(key, "a finite number")
    if merged["shift"] <= 0:
        refuse("shift", "a number above 0")
    for key in ("base_image_seq_len", "max_image_seq_len"):
        if not _integer(merged[key]) or merged[key] < 1:
            refuse(key, "a positive integer number of image tokens")
    if merged["base_image_seq_len"] >= merged["max_image_seq_len"]:
        refuse("base_image_seq_len", f"fewer tokens than max_image_seq_len={merged['max_image_seq_len']} (the "
                                     "dynamic shift is interpolated between the two)")
    terminal = merged["shift_terminal"]
    if terminal is not None and not (_number(terminal) and 0 <= terminal < 1):
        refuse("shift_terminal", "null or a number in [0, 1)")
    if merged["time_shift_type"] not in ("exponential", "linear"):
        refuse("time_shift_type", "'exponential' or 'linear'")
    for key in _SCHEDULER_FLAGS:
        if key in merged and not isinstance(merged[key], bool):
            refuse(key, "true or false")
    spacings = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas") if merged.get(k)]
    if len(spacings) > 1:
        refuse(spacings[1], f"false while {spacings[0]} is true (the scheduler takes one sigma spacing)")
    try:  # whatever the checks above do not cover: the model's default schedule at 1024x1024 must come out finite
        build_schedule(merged, 40, 4096)
    except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
        raise CheckpointError(path, f"gives no usable sigma schedule ({type(exc).__name__}: {shorten(str(exc))}).",
                              SCHEDULER_EXPECTED) from None


def read_scheduler_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(folder) / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return None
    config = read_json(path, SCHEDULER_EXPECTED)
    check_scheduler_config(config, path)
    return config
