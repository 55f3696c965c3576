"""The preload (`kernels/preload.py`): one background set-up of Triton and the CUDA libraries per process, waited
for before a kernel launch and before a capture.

Invariants:
- Without CUDA nothing starts, and waiting returns at once (the CPU path never touches Triton).
- However often it is asked for, one thread runs, and a kernel launch waiting on it blocks until it is done (two
  threads must never set Triton's lazily created driver up at once).
- A set-up that fails is recorded and logged, never raised: the first launch meets the same problem itself; the
  libraries are warmed only after Triton set up, on the device of the thread that started the preload.
- Starting a capture waits for it too, so the thread never runs beside a capture.
- Both copies of the pack in one process share the one state (tests/test_registry.py).
"""

import threading

import pytest

from graph_runtime.kernels import preload


@pytest.fixture
def fresh(monkeypatch):
    """The process-wide state, new for each test (and the real state restored after it)."""
    state = preload.PreloadState()
    monkeypatch.setattr(preload, "_state", lambda: state)
    monkeypatch.setattr(preload, "_current_device", lambda: "cuda:0")
    return preload


def test_without_cuda_nothing_starts_and_waiting_returns_at_once(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "_cuda_and_triton_available", lambda: False)
    assert fresh.start_preload() is False
    assert fresh._state().thread is None
    fresh.wait_for_preload()  # returns: nothing was started
    assert fresh.preload_result() == {}


def test_one_thread_runs_however_often_it_is_started_and_a_wait_blocks_until_it_is_done(fresh, monkeypatch):
    gate, calls = threading.Event(), []

    def slow_set_up(state):
        calls.append(threading.current_thread().name)
        gate.wait(10)
        state.result.update(ok=True, seconds=0.0)

    monkeypatch.setattr(fresh, "_cuda_and_triton_available", lambda: True)
    monkeypatch.setattr(fresh, "_set_up_triton", slow_set_up)
    monkeypatch.setattr(fresh, "_warm_cuda_libraries", lambda device: calls.append(device))
    assert fresh.start_preload() is True and fresh.start_preload() is True
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (fresh.wait_for_preload(), waited.set()))
    waiter.start()
    assert not waited.wait(0.3), "wait_for_preload returned before the set-up finished"
    assert fresh.preload_result() == {}  # nothing to report while it runs
    gate.set()
    assert waited.wait(10)
    waiter.join(10)
    assert calls == ["kvgraph-preload", "cuda:0"]  # Triton, then the libraries on the caller's device
    result = fresh.preload_result()
    assert result["ok"] is True and result["libraries_seconds"] >= 0 and "libraries_error" not in result
    fresh.wait_for_preload()  # done: a flag check


def test_a_failed_set_up_is_recorded_and_logged_not_raised(fresh, monkeypatch, caplog):
    """With Triton installed but no GPU (this machine), the real set-up fails at the driver; the thread records it."""
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the set-up succeeds: tests/gpu/test_gpu_first_prompt.py checks that")
    monkeypatch.setattr(fresh, "_cuda_and_triton_available", lambda: True)
    with caplog.at_level("INFO", logger="kv_graph"):
        assert fresh.start_preload() is True
        fresh.wait_for_preload()
    result = fresh.preload_result()
    assert result["ok"] is False and "driver" in result["error"].lower() and result["seconds"] >= 0
    assert "libraries_seconds" not in result  # no GPU work after Triton failed
    assert "Triton preload failed" in caplog.text


def test_a_failed_library_warm_up_is_recorded_and_the_preload_still_finishes(fresh, monkeypatch):
    def no_gpu(device):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(fresh, "_cuda_and_triton_available", lambda: True)
    monkeypatch.setattr(fresh, "_set_up_triton", lambda state: state.result.update(ok=True, seconds=0.0))
    monkeypatch.setattr(fresh, "_warm_cuda_libraries", no_gpu)
    fresh.start_preload()
    fresh.wait_for_preload()
    assert fresh.preload_result()["libraries_error"] == "RuntimeError: no GPU here"


def test_libraries_false_sets_up_triton_alone(fresh, monkeypatch):
    warmed = []
    monkeypatch.setattr(fresh, "_cuda_and_triton_available", lambda: True)
    monkeypatch.setattr(fresh, "_set_up_triton", lambda state: state.result.update(ok=True, seconds=0.0))
    monkeypatch.setattr(fresh, "_warm_cuda_libraries", warmed.append)
    fresh.start_preload(libraries=False)
    fresh.wait_for_preload()
    assert warmed == [] and fresh.preload_result() == {"ok": True, "seconds": 0.0}


def test_a_capture_waits_for_the_preload_before_anything_else(fresh, monkeypatch):
    """`CudaGraphBackend.capture` calls `wait_for_preload` first (checked without a GPU by stopping at that call)."""
    from graph_runtime.decode import capture

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    monkeypatch.setattr(capture, "wait_for_preload", stop)
    backend = capture.CudaGraphBackend()
    backend.capture_without_blas_workspace = False
    with pytest.raises(Stop):
        backend.capture(entry=None, body=None)

