"""Timers: CUDA-event medians for device time, perf_counter medians for host time, per-call host timers."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _call_ms(fn, cuda: bool) -> float:
    """One call of `fn` in ms: between CUDA events on GPU, wall time on CPU (where calls are synchronous)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def device_ms(fn, device, iters: int = 10, warmup: int = 2) -> float:
    """Median device time of `fn` in ms (CUDA events on GPU; wall time with sync on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    cuda = torch.device(device).type == "cuda"
    return statistics.median(_call_ms(fn, cuda) for _ in range(iters))


def sustained_ms(fn, device, seconds: float = 3.0) -> float:
    """Median device time of `fn` called back to back for `seconds`, over the second half of the calls only.

    Back to back the card climbs to its power limit within the first second or so and the driver lowers the clock;
    the second half is the settled state (timed like `device_ms`).
    """
    cuda = torch.device(device).type == "cuda"
    _sync(device)
    times, stop = [], time.perf_counter() + seconds
    while time.perf_counter() < stop:
        times.append(_call_ms(fn, cuda))
    return statistics.median(times[len(times) // 2:])


def after_idle_ms(fn, device, pause_s: float = 3.0) -> float:
    """Device time of one call of `fn` after the card idled `pause_s` seconds, on CUDA.

    Back-to-back steps at 512x512 and up draw the card's 700 W limit, and the driver then holds the SM clock near
    1.5 GHz; after a pause one step runs at the boost clock (docs/performance.md). This is that step: the same code
    at the clock the card is rated for, next to `device_ms`'s sustained figure.
    """
    _sync(device)
    time.sleep(pause_s)
    return _call_ms(fn, cuda=True)


def host_ms(fn, device, iters: int = 10) -> float:
    """Median host time to issue `fn` (no sync inside the timed region): the CPU cost of launching a step."""
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(times)


def wall_s(fn, device) -> tuple[object, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


@contextlib.contextmanager
def timed_calls(*targets):
    """Host time of every call of each `(obj, method_name)` in `targets` while inside: yields `{name: [ms, ...]}`.

    The methods are wrapped on the instances and the wrappers removed on exit, so the class's methods show again.
    """
    times = {}
    for obj, name in targets:
        calls = times.setdefault(name, [])

        def timed(*args, _fn=getattr(obj, name), _calls=calls, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _calls.append((time.perf_counter() - start) * 1e3)

        setattr(obj, name, timed)
    try:
        yield times
    finally:
        for obj, name in targets:
            delattr(obj, name)
