"""Triton's and the CUDA libraries' one-time process set-up, done in a background thread while the models load.

The first launch of any Triton kernel in a fresh process costs most of a second even when the on-disk kernel cache
holds the kernel: Triton keys its cache by a hash of its own large shared library (`triton_key`), imports its
gluon front end and sets up its CUDA driver utilities. Every one of those is the same for every kernel and needs
nothing from the prompt, so `start_preload` runs them in a daemon thread at ComfyUI's start-up (and when the
command line or a loader node starts loading models for a CUDA device); the checkpoint read and the text encoding
hide it. hashlib releases the GIL while hashing, so the main thread loses nothing meanwhile.

The libraries behind the first GEMM, attention and convolution pay a one-time set-up the same way (cuBLAS and
cuDNN handles, their libraries' kernels loaded; what it costs a first prompt: docs/first-prompt.md); with `libraries` the thread then runs
one tiny matmul, attention and convolution on a stream of its own. The handles it creates go back to PyTorch's
per-device pools when the thread ends, where the main thread picks them up. That is GPU work off the main thread,
which a CUDA graph capture in progress would not tolerate, so a capture waits for the preload to finish
(`CudaGraphBackend.capture`); the thread finishes long before a checkpoint has loaded.

Our kernel wrappers call `wait_for_preload()` before their first launch, so the two threads never set up Triton at
once (its driver object is created lazily and not under a lock); after the first call that is a flag check. The
preload is process-wide by nature (Triton and the CUDA libraries are set up once per process), so its state is
this module's `_STATE`.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kv_graph")


class PreloadState:
    """The process's one preload: its thread (None until started), a done flag and what it found."""

    def __init__(self):
        self.lock = threading.Lock()  # guards starting the thread: one start per process
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.result: dict = {}


_STATE = PreloadState()


def _state() -> PreloadState:
    return _STATE


def _triton_key():
    """Triton's cache key function: `triton.runtime.cache` in 3.6 and later, `triton.compiler.compiler` before."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key
    return triton_key


def _warm_cuda_libraries(device) -> None:
    """One small GEMM (with and without bias), attention and convolution in bf16 on a private stream."""
    import torch
    import torch.nn.functional as F

    stream = torch.cuda.Stream(device)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
        a, w = torch.ones(64, 128, **bf16), torch.ones(32, 128, **bf16)
        F.linear(a, w)
        F.linear(a, w, w[:, 0])
        q = torch.ones(1, 8, 64, 128, **bf16)
        F.scaled_dot_product_attention(q, q, q)
        F.conv2d(torch.ones(1, 16, 16, 16, **bf16), torch.ones(16, 16, 3, 3, **bf16), padding=1)
    stream.synchronize()


def _set_up(state: PreloadState, device, libraries: bool) -> None:
    try:
        _set_up_triton(state)
        if libraries and state.result.get("ok"):
            start = time.perf_counter()
            try:
                _warm_cuda_libraries(device)
            except Exception as exc:  # the first prompt sets the libraries up itself, as without the preload
                state.result.update(libraries_error=f"{type(exc).__name__}: {exc}")
                log.info("KV-Graph: CUDA library preload failed (%s)", state.result["libraries_error"])
            state.result["libraries_seconds"] = time.perf_counter() - start
    finally:
        state.done.set()


def _set_up_triton(state: PreloadState) -> None:
    start = time.perf_counter()
    try:
        import triton  # noqa: F401
        from triton.runtime import driver

        _triton_key()()
        active = driver.active
        active.utils  # noqa: B018  (builds or loads the driver's small C helper module)
        active.get_current_device()
        try:
            # Imported by the first kernel specialization in Triton 3.5 and later; absent in older releases.
            import triton.experimental.gluon  # noqa: F401
        except ImportError:
            pass
    except Exception as exc:  # the first kernel launch will meet (and report) the same problem itself
        state.result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        log.info("KV-Graph: Triton preload failed (%s); kernels set Triton up on first use instead",
                 state.result["error"])
    else:
        state.result.update(ok=True)
    finally:
        state.result["seconds"] = time.perf_counter() - start


def _cuda_and_triton_available() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _current_device():
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def start_preload(device=None, libraries: bool = True) -> bool:
    """Starts the set-up thread once per process, for CUDA `device` (default: the calling thread's current one);
    True when it runs (or ran), False without CUDA or Triton. `libraries=False` sets up Triton alone. Callers pass
    the device the models will compute on, and call it only when that is a CUDA device."""
    state = _state()
    with state.lock:
        if state.thread is not None:
            return True
        if not _cuda_and_triton_available():
            return False
        device = _current_device() if device is None else device
        state.thread = threading.Thread(target=_set_up, args=(state, device, libraries),
                                        name="kvgraph-preload", daemon=True)
        state.thread.start()
        return True


def wait_for_preload() -> None:
    """Blocks until a started preload is done; returns at once when none was started or it finished."""
    state = _state()
    if state.done.is_set():
        return
    with state.lock:
        started = state.thread is not None
    if started:
        state.done.wait()


def preload_result() -> dict:
    """`{}` before a preload finished, else `{"ok": bool, "seconds": float}` for Triton (and `"error"` when not
    ok), with `"libraries_seconds"` (and `"libraries_error"`) when the libraries were warmed too."""
    state = _state()
    return dict(state.result) if state.done.is_set() else {}
