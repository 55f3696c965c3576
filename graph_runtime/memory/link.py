"""The host-to-device rate a plan's step estimate assumes for streamed blocks and a host prefix: measured once per
CUDA device and process (a 64 MiB page-locked copy, a few milliseconds the first time a request is planned there),
since the link is what a streamed step waits on and cards sit on links from PCIe 3.0 x8 to PCIe 5.0 x16."""

from __future__ import annotations

import logging
import threading

import torch

from ..decode.prefix_store import release_host_cache

logger = logging.getLogger("kvgraph")

PROBE_BYTES = 64 << 20
PROBE_COPIES = 5  # the median of these; the first copy of a process also pays for mapping the buffer

_measured: dict[str, float | None] = {}
_lock = threading.Lock()


def measured_h2d_bytes_per_s(device) -> float | None:
    """Pinned host-to-device bytes per second on `device`, or None where it cannot be measured now (not CUDA, a
    capture in progress, pinning refused)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        key = str(device)
        if key not in _measured:
            if torch.cuda.is_current_stream_capturing():
                return None  # never sync inside a capture; measured at the next plan
            _measured[key] = _probe(device)
        return _measured[key]


def copy_rate(device, nbytes: int, copies: int) -> float:
    """Pinned host-to-device bytes per second on `device`: the median of `copies` timed copies of `nbytes` (also
    what the benchmarks report as the link's rate)."""
    device = torch.device(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    times = []
    with torch.cuda.stream(stream):
        for _ in range(copies):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            target.copy_(host, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    del host, target
    release_host_cache()  # the measurement's pinned buffer is not kept locked
    return nbytes / (sorted(times)[len(times) // 2] / 1e3)


def _probe(device: torch.device) -> float | None:
    try:
        rate = copy_rate(device, PROBE_BYTES, PROBE_COPIES)
    except RuntimeError as exc:  # pinned memory refused, the device out of memory: plans keep the default rate
        logger.info("KV-Graph: the host-to-device rate could not be measured on %s (%s); plans assume the default.",
                    device, f"{type(exc).__name__}: {exc}"[:200])
        return None
    logger.info("KV-Graph: host-to-device rate on %s: %.1f GB/s (pinned), what plans assume for streamed bytes.",
                device, rate / 1e9)
    return rate
