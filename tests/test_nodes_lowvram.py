"""ComfyUI's partial loads of the transformer (nodes/comfyui/patcher.py), with the fake ComfyUI on CPU: the patcher reads
`partially_load(device, extra_memory)` the way ComfyUI 0.8.0 and 0.33.0 call it, streams the blocks that do not fit,
tells ComfyUI what is really loaded, says so once, and undoes it on unload and on a later whole load; core's Euler
over the MODEL gives the same latents under a partial load.

The fake's `weight_budget` is the figure ComfyUI's `load_models_gpu` computes when it does not force a whole load
(what the model may hold on its device). On CPU the "device" is the CPU too, so what is checked here is the
translation and the bookkeeping; tests/gpu/test_gpu_lowvram.py checks the GPU memory and the replayed steps.
Tolerance: the same fp32 math as the whole model's on differently placed copies of the same weights (the block
streamer's CPU tests): 1e-6 on raw latents of magnitude ~5 would already be generous; 2e-5 as the other core-path
tests use, far below what a block with wrong weights changes.
"""

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_core_model import core_sample, pack_module, sigmas_node  # noqa: E402
from test_nodes_execute import encode, load_all  # noqa: E402

ATOL = 2e-5


@pytest.fixture
def setup(comfy_env):
    transformer, text_encoder, _ = load_all(comfy_env)
    positive, _, latent = encode(comfy_env, text_encoder)
    yield transformer, text_encoder, positive, latent
    comfy_env.fake.weight_budget = None
    transformer.patcher.detach(unpatch_all=True)


def _one_block_budget(handle):
    """Everything outside the blocks plus one block: less than the whole tiny model, so its blocks stream."""
    from graph_runtime.memory import module_bytes

    blocks = [module_bytes(b) for b in handle.module.transformer_blocks]
    return module_bytes(handle.module) - sum(blocks) + blocks[0]


def _load(env, patcher, force_full_load=False):
    import comfy.model_management as mm

    mm.load_models_gpu([patcher], force_full_load=force_full_load)


def test_a_smaller_figure_streams_and_comfyui_is_told_the_truth(comfy_env, setup, caplog):
    """A figure below the whole transformer: everything outside the blocks is loaded and, since one resident block
    plus a slot for the other would be the whole model, both blocks stream through two device slots (their hooks
    set, their weights views of the slots); `loaded_size()` is what is resident (within the figure), `model_lowvram`
    is set and the streaming buffer is the slots. The plan is logged once: the same figure again moves and logs
    nothing."""
    handle, *_ = setup
    patcher = handle.patcher
    budget = _one_block_budget(handle)
    comfy_env.fake.weight_budget = budget
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        _load(comfy_env, patcher)
        plan = patcher.stream_plan()
        assert plan is not None and (plan.resident_blocks, plan.blocks, plan.slots) == (0, 2, 2)
        assert patcher.loaded_size() == plan.resident <= budget < patcher.model_size()
        model = patcher.model
        streamer = handle.loaded.streamer
        assert model.model_lowvram is True and model.model_offload_buffer_memory == streamer.buffer_bytes
        assert streamer.active and streamer.buffer_bytes >= 2 * plan.largest_block
        assert all(b._forward_pre_hooks for b in handle.module.transformer_blocks)
        _load(comfy_env, patcher)  # the next prompt: the same figure
        assert handle.loaded.streamer is streamer and patcher.loaded_size() == plan.resident
    said = [r.getMessage() for r in caplog.records if "blocks stream from the host every step" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("KV-Graph: ComfyUI can put") and "2 of 2 blocks" in said[0]
    assert "through 2 device slots" in said[0]


def test_a_whole_load_and_an_unload_end_the_streaming(comfy_env, setup):
    """After a partial load, a forced whole load (the KV-Graph Sampler's) puts every block on the device with no
    hooks left and `model_lowvram` cleared; an unload (detach) after another partial load leaves no hooks and nothing
    loaded."""
    handle, *_ = setup
    patcher = handle.patcher
    comfy_env.fake.weight_budget = _one_block_budget(handle)
    _load(comfy_env, patcher)
    assert patcher.stream_plan() is not None
    _load(comfy_env, patcher, force_full_load=True)
    assert patcher.stream_plan() is None and handle.loaded.streamer is None
    assert patcher.loaded_size() == patcher.model_size() and patcher.model.model_lowvram is False
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in handle.module.transformer_blocks)
    patcher.detach(unpatch_all=True)
    _load(comfy_env, patcher)
    assert patcher.stream_plan() is not None
    patcher.detach(unpatch_all=True)
    assert patcher.stream_plan() is None and patcher.loaded_size() == 0
    assert all(not b._forward_pre_hooks for b in handle.module.transformer_blocks)


def test_the_text_encoder_still_loads_whole(comfy_env, setup):
    """The text encoder (and the VAE) cannot stream: a small figure still loads it whole."""
    _, text_encoder, *_ = setup
    comfy_env.fake.weight_budget = 1
    _load(comfy_env, text_encoder.patcher)
    assert text_encoder.patcher.stream_plan() is None
    assert text_encoder.patcher.loaded_size() == text_encoder.patcher.model_size()
    text_encoder.patcher.detach(unpatch_all=True)


def test_core_euler_under_a_partial_load_equals_the_whole_load(comfy_env, setup):
    """Core's Euler over the MODEL after ComfyUI loaded it partly (as core's `prepare_sampling` asks) gives the
    latents of the same run on the whole model; the KV-Graph Sampler node, which asks for a whole load, runs after
    it as usual."""
    handle, _, positive, latent = setup
    model = handle.model
    sigmas = sigmas_node(comfy_env, model, latent)
    _load(comfy_env, model)
    whole = core_sample(comfy_env, model, positive, latent, sigmas, seed=5)
    model.detach(unpatch_all=True)
    comfy_env.fake.weight_budget = _one_block_budget(handle)
    _load(comfy_env, model)
    assert model.stream_plan() is not None
    partial = core_sample(comfy_env, model, positive, latent, sigmas, seed=5)
    assert (partial - whole).abs().max() <= ATOL
    assert model.stream_plan() is not None  # still streamed: nothing reloaded it during the run
    in_flight = pack_module(comfy_env, "graph_runtime.in_flight")
    assert in_flight.runs() == [] and not handle.loaded.busy
