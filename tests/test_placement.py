"""The pinned host copy of weights that never change (graph_runtime/placement.py), on the CPU.

Without CUDA the copy cannot be page-locked, so the swap itself is checked with `pin=False` and the CPU standing in
for the device: the values stay bit-equal, a load is exactly one copy into a fresh buffer, and an offload copies
nothing (the tensors point back at the host copy's own addresses). tests/gpu/test_gpu_memory.py repeats the round
trip on a GPU with the copy pinned.
"""

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graph_runtime.memory import module_bytes
from graph_runtime.placement import ALIGNMENT, PinnedWeights

sys.path.insert(0, str(Path(__file__).parent))


class CopyCounter(TorchDispatchMode):
    """Counts the ops that copy tensor data, with the bytes they write."""

    COPIES = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::_copy_from"}

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.COPIES:
            self.copies.append((func._schema.name, args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))


def small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50), torch.nn.LayerNorm(50),
                                torch.nn.Linear(50, 50, bias=False))
    model[3].weight = model[0].weight.__class__(torch.randn(50, 50))
    model[1].weight = torch.nn.Parameter(model[0].weight.t().contiguous().t()[:50, :16].clone())
    model.register_buffer("table", torch.randn(7, 3))
    model.register_buffer("table_view", model.table[2:5])  # a second view of the same storage
    return model.eval().requires_grad_(False)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_round_trip_is_bit_equal_and_offload_copies_nothing():
    model = small_model()
    before = state(model)
    placement = PinnedWeights(model, "cpu", pin=False)
    assert placement.fallback_reason is None and not placement.loaded
    host_ptrs = [t.data_ptr() for t in model.parameters()]
    # One buffer, every parameter at an aligned offset in it (as separate allocations would be).
    assert len({t.untyped_storage().data_ptr() for t in model.parameters()}) == 1
    assert all((t.data_ptr() - t.untyped_storage().data_ptr()) % ALIGNMENT == 0 for t in model.parameters())

    with CopyCounter() as load:
        placement.load()
    # One copy of the whole host buffer into a fresh device buffer; every tensor moved to it.
    assert load.copies == [("aten::copy_", placement.host_bytes)]
    assert all(a != b for a, b in zip(host_ptrs, (t.data_ptr() for t in model.parameters())))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    with CopyCounter() as offload:
        placement.offload()
    assert offload.copies == []  # no device-to-host copy: the tensors point back at the host copy
    assert [t.data_ptr() for t in model.parameters()] == host_ptrs
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The view of `table` still shares its storage.
    assert model.table_view.untyped_storage().data_ptr() == model.table.untyped_storage().data_ptr()
    x = torch.randint(0, 50, (4,))
    assert torch.equal(model(x), copy.deepcopy(small_model())(x))


def test_tensors_keep_their_identity_and_ties():
    model = small_model()
    model[3].weight = model[0].weight  # tied, like a text encoder's head and embedding table
    params = [id(p) for p in model.parameters()]
    placement = PinnedWeights(model, "cpu", pin=False)
    placement.load()
    assert [id(p) for p in model.parameters()] == params
    assert model[3].weight is model[0].weight
    placement.offload()
    assert model[3].weight.data_ptr() == model[0].weight.data_ptr()


def test_weights_changed_while_loaded_are_kept(caplog):
    model = small_model()
    placement = PinnedWeights(model, "cpu", pin=False)
    placement.load()
    model[2].weight.data = torch.full_like(model[2].weight, 3.0)  # replaced outside the placement
    caplog.set_level(logging.WARNING, logger="kvgraph")
    placement.offload()
    assert torch.equal(model[2].weight, torch.full((50,), 3.0))
    assert any("changed on the device" in r.getMessage() for r in caplog.records)
    placement.load()
    assert torch.equal(model[2].weight, torch.full((50,), 3.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_without_cuda_it_falls_back_to_ordinary_moves_with_a_logged_reason(caplog):
    model = small_model()
    before = state(model)
    caplog.set_level(logging.INFO, logger="kvgraph")
    placement = PinnedWeights(model, "cpu")
    assert placement.fallback_reason == "CUDA is not available" and not placement.pinned
    assert any("CUDA is not available" in r.getMessage() for r in caplog.records)
    placement.load()
    placement.offload()
    assert placement.host_bytes == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tensor_subclass_weights_fall_back():
    class Tagged(torch.Tensor):
        pass

    model = torch.nn.Linear(4, 4)
    model.register_buffer("tag", torch.zeros(2).as_subclass(Tagged))
    placement = PinnedWeights(model, "cpu", pin=False)
    assert "tensor subclasses" in placement.fallback_reason


def test_text_encoder_patcher_loads_and_offloads_through_the_placement(tiny_parts):
    """The node's patcher (ComfyUI's ModelPatcher underneath, faked here) with a placement: ComfyUI's bookkeeping
    sees the right sizes while the weights swap between the host copy and the 'device' copy."""
    from comfy_fake.fixtures import close_env, make_env

    env = make_env()
    try:
        handles = sys.modules[env.pack.__name__ + ".nodes.comfyui.model_handles"]
        module = copy.deepcopy(tiny_parts["text_encoder"])
        size = module_bytes(module)
        before = state(module)
        handle = handles.TextEncoderHandle.create("text_encoder", module, "test", "fp32", "cpu", "cpu")
        assert handle.patcher.placement is None  # the CPU is both load and offload device: nothing to swap
        placement = PinnedWeights(module, "cpu", pin=False)
        handle.patcher.placement = placement
        host_ptrs = [t.data_ptr() for t in module.parameters()]
        assert handle.size_bytes == size and handle.patcher.loaded_size() == 0

        handle.ensure_loaded()
        assert placement.loaded and handle.patcher.loaded_size() == size == handle.size_bytes
        assert [t.data_ptr() for t in module.parameters()] != host_ptrs
        with CopyCounter() as offload:
            handle.patcher.detach(unpatch_all=True)  # what ComfyUI's unload and the handle's offload call
        assert offload.copies == [] and not placement.loaded
        assert [t.data_ptr() for t in module.parameters()] == host_ptrs
        assert handle.patcher.loaded_size() == 0 and handle.size_bytes == size
        assert handle.describe()["pinned_host_bytes"] == placement.host_bytes >= size
        assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    finally:
        close_env(env)


def test_the_placement_benchmark_builds_the_published_8b_text_encoder():
    """`python -m bench.placement` times a random text encoder of Qwen3-VL-8B's dimensions: built on
    the meta device here, it has the 8.15 B parameters (16.3 GB in bf16) of ComfyUI's qwen3vl_8b_bf16 file."""
    from transformers import Qwen3VLForConditionalGeneration

    from bench.placement import text_encoder_8b_config

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(text_encoder_8b_config())
    params = sum(p.numel() for p in model.parameters())
    assert 8.14e9 < params < 8.15e9 and model.lm_head.weight is model.model.language_model.embed_tokens.weight
