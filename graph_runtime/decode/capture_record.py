"""What a capture backend reads and writes on anything it captures and replays: a decode entry or a prefix pass."""

from __future__ import annotations


class CaptureRecord:
    """The backend reads `inputs` (the static buffers the body reads, set by the subclass) and `warmups`; capture
    sets `graph`, `output` (None when the body's results are buffers it writes), the counters and timings, and the
    capturing caller (`replay.py`, `prefix_pass.py`) records the weights' fingerprint it was captured against."""

    warmups = 1  # eager runs before capture

    def __init__(self):
        self.graph = None
        self.output = None
        self.captures = 0
        self.replays = 0
        self.pool_bytes = 0
        self.warmup_seconds = 0.0
        self.capture_seconds = 0.0
        self.weights_fingerprint: tuple | None = None
