"""Issue 43's load checks on a real GPU (run on the H200: `pytest -m gpu tests/gpu/test_gpu_load_checks.py`).

A checkpoint loaded straight onto a CUDA device is checked against that device's whole memory before any weight is
read: a GPU reported as smaller than the weights refuses the load naming the file, the device and both sizes, and no
device memory is allocated by the refusal; the same file on the real GPU loads.
"""

import types

import pytest
import torch

from graph_runtime.errors import CheckpointError
from graph_runtime.loading.transformer import load_transformer

pytestmark = pytest.mark.gpu


def test_weights_larger_than_the_gpu_are_refused_before_any_is_read(tiny_folder, monkeypatch):
    real = torch.cuda.get_device_properties

    def small(device):
        props = real(device)
        return types.SimpleNamespace(total_memory=2**16, name=props.name)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    monkeypatch.setattr(torch.cuda, "get_device_properties", small)
    with pytest.raises(CheckpointError, match=r"holds .* of weights in float32, more than all of cuda:0's memory"):
        load_transformer(tiny_folder, dtype=torch.float32, device="cuda:0")
    assert torch.cuda.memory_allocated() == before
    monkeypatch.setattr(torch.cuda, "get_device_properties", real)
    model = load_transformer(tiny_folder, dtype=torch.float32, device="cuda:0")
    assert next(model.parameters()).device.type == "cuda"
