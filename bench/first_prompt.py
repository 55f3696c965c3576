"""Where a fresh process's first prompt spends what later prompts do not: a profile by phase and by cause.

A first prompt pays for set-up that later prompts find done: our Triton kernels compiled (or loaded from Triton's
on-disk cache), cuBLAS kernels loaded and cuDNN plans built per new shape, graphs warmed up and captured, memory
obtained from the driver. `FirstPromptProfile` measures that while one prompt runs:

- **First use of an op** (our Triton kernels, GEMMs, attention, convolutions): the first call with a given
  signature (tensor shapes and dtypes, scalar arguments) is synchronized, timed, and at once run a second time; the
  difference is that call's set-up cost. Later calls of the signature run untouched. Every profiled op is pure or
  idempotent (the q/k/RoPE kernel writes the same cache rows again), so the doubled call changes no result. Calls
  during a graph capture are never touched.
- **Graph captures**: each capture call's warm-up and capture times (decode steps and prefix passes).
- **Phases**: the wall time of each phase (the caller names the functions that make them), with the set-up costs
  found inside it.
- **Host profile**: cProfile of the whole prompt, the functions with the most own time.

The profile adds syncs and doubled calls, so its run is not a timing: the benchmark reports it next to unprofiled
first prompts.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

from graph_runtime.decode import CudaGraphBackend
from graph_runtime.kernels import norm_modulate, qk_norm_rope, silu_mul

TOP_ITEMS = 25


def _op_targets():
    """(owner, attribute, category) of every op whose first use is measured."""
    targets = [(F, "linear", "GEMM"), (F, "scaled_dot_product_attention", "attention"), (F, "conv2d", "conv"),
               (F, "conv3d", "conv"), (norm_modulate, "_triton_norm_modulate", "Triton (ours)"),
               (qk_norm_rope, "_triton_qk_norm_rope_write", "Triton (ours)"),
               (silu_mul, "_triton_silu_mul", "Triton (ours)")]
    try:
        from graph_runtime.kernels import fp8_quant
    except ImportError:  # the FP8 kernels are optional
        return targets
    return targets + [(fp8_quant, name, "Triton (ours)") for name in fp8_quant.TRITON_LAUNCHERS]


def signature(args, kwargs) -> tuple:
    def one(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), str(value.dtype).removeprefix("torch."))
        if isinstance(value, (int, float, bool, str)) or value is None:
            return value
        if isinstance(value, (list, tuple)):
            return tuple(one(v) for v in value)
        return type(value).__name__

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FirstPromptProfile:
    def __init__(self, device, phase_targets=(), host_profile: bool = True):
        """`phase_targets`: `(owner, attribute, phase name)`; calls of them set the current phase (the first call of
        a decode step's target may be named apart from the rest, see `FirstCall`)."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.phase_targets = list(phase_targets)
        self.host_profile = host_profile
        self.phase_stack = ["outside phases"]
        self.phase_ms: dict[str, float] = {}
        self.items: list[dict] = []  # one per first use of a signature
        self.captures: list[dict] = []
        self._seen: set = set()
        self._patches: list = []
        self._profiler = cProfile.Profile() if host_profile else None

    # -- patching ------------------------------------------------------------------------------------------------

    def _patch(self, owner, attr, replacement):
        self._patches.append((owner, attr, owner.__dict__.get(attr, _ABSENT)))
        setattr(owner, attr, replacement)

    def __enter__(self):
        for owner, attr, category in _op_targets():
            self._patch(owner, attr, self._op_wrapper(getattr(owner, attr), f"{getattr(owner, '__name__', owner)}."
                                                      f"{attr}", category))
        for owner, attr, name in self.phase_targets:
            self._patch(owner, attr, self._phase_wrapper(getattr(owner, attr), name))
        backend = CudaGraphBackend
        self._patch(backend, "_capture", self._capture_wrapper(backend._capture))
        if self._profiler is not None:
            self._profiler.enable()
        return self

    def __exit__(self, *exc):
        if self._profiler is not None:
            self._profiler.disable()
        for owner, attr, before in reversed(self._patches):
            if before is _ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, before)
        self._patches.clear()
        return False

    # -- wrappers ------------------------------------------------------------------------------------------------

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _op_wrapper(self, fn, name, category):
        def profiled(*args, **kwargs):
            if _capturing():
                return fn(*args, **kwargs)
            key = (name, signature(args, kwargs))
            if key in self._seen:
                return fn(*args, **kwargs)
            self._seen.add(key)
            self._sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            first = time.perf_counter()
            fn(*args, **kwargs)
            self._sync()
            again = time.perf_counter()
            self.items.append({"phase": self.phase_stack[-1], "category": category, "op": name,
                               "signature": repr(key[1])[:160], "first_ms": (first - start) * 1e3,
                               "again_ms": (again - first) * 1e3,
                               "setup_ms": max(0.0, (first - start) - (again - first)) * 1e3})
            return out

        return profiled

    def _phase_wrapper(self, fn, name):
        def in_phase(*args, **kwargs):
            phase = name(self) if callable(name) else name
            self.phase_stack.append(phase)
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.phase_ms[phase] = self.phase_ms.get(phase, 0.0) + (time.perf_counter() - start) * 1e3
                self.phase_stack.pop()

        return in_phase

    def _capture_wrapper(self, fn):
        def timed_capture(backend, entry, body):
            start = time.perf_counter()
            try:
                return fn(backend, entry, body)
            finally:
                self.captures.append({"phase": self.phase_stack[-1], "what": type(entry).__name__,
                                      "warmups": entry.warmups, "warmup_s": entry.warmup_seconds,
                                      "capture_s": entry.capture_seconds,
                                      "call_s": time.perf_counter() - start})

        return timed_capture

    # -- the result ----------------------------------------------------------------------------------------------

    def report(self) -> dict:
        by_phase: dict = {}
        for item in self.items:
            cats = by_phase.setdefault(item["phase"], {})
            cats[item["category"]] = cats.get(item["category"], 0.0) + item["setup_ms"]
        for capture in self.captures:
            cats = by_phase.setdefault(capture["phase"], {})
            cats["graph warm-up"] = cats.get("graph warm-up", 0.0) + capture["warmup_s"] * 1e3
            cats["graph capture"] = cats.get("graph capture", 0.0) + capture["capture_s"] * 1e3
        report = {
            "phase_ms": self.phase_ms,
            "setup_ms_by_phase": by_phase,
            "first_uses": len(self.items),
            "top_first_uses": sorted(self.items, key=lambda i: -i["setup_ms"])[:TOP_ITEMS],
            "setup_ms_by_category": _sum_by(self.items, "category"),
            "captures": self.captures,
        }
        if self._profiler is not None:
            report["host_top"] = host_top(self._profiler)
        return report


_ABSENT = object()


def _sum_by(items, key) -> dict:
    out: dict = {}
    for item in items:
        out[item[key]] = out.get(item[key], 0.0) + item["setup_ms"]
    return out


def host_top(profiler: cProfile.Profile, rows: int = 20) -> list[str]:
    """The functions with the most own time (and their cumulative time), one line each."""
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(rows)
    lines = [line.rstrip() for line in stream.getvalue().splitlines()]
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return [line for line in lines[start:] if line.strip()]


class FirstCall:
    """A phase name for a method whose first call is its own phase: `FirstCall("first step", "steps")`."""

    def __init__(self, first: str, rest: str):
        self.first, self.rest, self.called = first, rest, False

    def __call__(self, profile: FirstPromptProfile) -> str:
        name = self.rest if self.called else self.first
        self.called = True
        return name


@contextlib.contextmanager
def profiled_ours(generator, device):
    """A `FirstPromptProfile` with our generation's phases: encode, reference VAE encode, prefill, the first decode
    step (which captures), the other steps, VAE decode and conversion to PIL."""
    import sys

    module = sys.modules[type(generator).__module__]
    engine = generator.engine
    targets = [(generator.encoder, "encode", "encode"), (module, "encode_pixels", "ref VAE encode"),
               (engine, "prefill", "prefill"), (engine, "decode_step", FirstCall("first step", "steps")),
               (module, "decode_latents", "VAE decode"), (module, "to_pil", "to PIL")]
    with FirstPromptProfile(device, targets) as profile:
        yield profile
