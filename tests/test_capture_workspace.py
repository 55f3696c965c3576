"""`without_blas_workspace`: the cuBLAS / cuBLASLt workspace sizes a capture runs under, and their restoration.

The sizes are process-wide settings, so whatever happens inside the capture they must be back afterwards; the real
effect on a captured graph (no workspace memsets) is asserted on the GPU (tests/gpu/test_gpu_decode.py)."""

import types

import pytest

from graph_runtime.decode import capture


@pytest.fixture()
def fake_cuda(monkeypatch):
    sizes = {"cublas": 32 << 20, "cublaslt": 1 << 20}

    def setting(name):
        def size(value=None):
            if value is not None:
                sizes[name] = value
            return sizes[name]
        return size

    fake = types.SimpleNamespace(cublas_workspace_size=setting("cublas"), cublaslt_workspace_size=setting("cublaslt"))
    monkeypatch.setattr(capture.torch.backends, "cuda", fake)
    return sizes


def test_sizes_are_zero_inside_and_restored_after(fake_cuda):
    with capture.without_blas_workspace() as applied:
        assert applied and fake_cuda == {"cublas": 0, "cublaslt": 0}
    assert fake_cuda == {"cublas": 32 << 20, "cublaslt": 1 << 20}


def test_sizes_are_restored_when_the_capture_fails(fake_cuda):
    with pytest.raises(RuntimeError, match="capture failed"):
        with capture.without_blas_workspace():
            raise RuntimeError("capture failed")
    assert fake_cuda == {"cublas": 32 << 20, "cublaslt": 1 << 20}


def test_torch_without_the_setting_captures_unchanged(monkeypatch):
    """Older torch (before 2.13) has no runtime workspace setting: nothing is touched and the caller is told."""
    monkeypatch.setattr(capture.torch.backends, "cuda", types.SimpleNamespace())
    with capture.without_blas_workspace() as applied:
        assert applied is False


def test_backend_capture_settings_follow_its_switch(fake_cuda):
    """The settings a capture runs under are what the benchmark's replay-against-body check runs the body under."""
    backend = capture.CudaGraphBackend()
    with backend.capture_settings():
        assert fake_cuda == {"cublas": 0, "cublaslt": 0}
    backend.capture_without_blas_workspace = False
    with backend.capture_settings():
        assert fake_cuda == {"cublas": 32 << 20, "cublaslt": 1 << 20}
    assert fake_cuda == {"cublas": 32 << 20, "cublaslt": 1 << 20}
