"""The memory plan through the KV-Graph Sampler (CPU, the fake ComfyUI): the plan reaches the runtime through the
request (`request.memory_plan`) and the load (`LoadedTransformer.following`): a plan that streams blocks makes the
sampler's load keep only its resident blocks on the device, the latents equal a whole load's, and the next whole plan
loads the model whole again; the plan is logged once per new plan and shown on /kvgraph/status.

On the CPU the planner never streams (the device is the host), so these tests hand the sampler a streamed variant of
its own plan, as a CUDA card too small for the whole model would get. Tolerance: the same fp32 math on differently
placed copies of the same weights (tests/test_nodes_lowvram.py's ATOL, 2e-5).
"""

import dataclasses
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_core_model import pack_module  # noqa: E402
from test_nodes_execute import sampler  # noqa: E402
from test_nodes_lowvram import ATOL, setup  # noqa: E402,F401 - the loaded models, unloaded after each test


def _streaming_plans(comfy_env, monkeypatch, resident_blocks):
    """Make the sampler's memory check hand back its plan with `resident_blocks` resident; returns the requests'
    plans as the runtime received them."""
    memory = pack_module(comfy_env, "nodes.comfyui.memory")
    sampler_module = pack_module(comfy_env, "nodes.sampler")
    original, seen = memory.check_request, []

    def check_request(model, request, device):
        budget = original(model, request, device)
        budget.plan = dataclasses.replace(budget.plan, resident_blocks=resident_blocks)
        seen.append(request)
        return budget

    monkeypatch.setattr(sampler_module.memory, "check_request", check_request)
    return seen


def test_a_streamed_plan_loads_its_resident_blocks_and_samples_as_the_whole_model(comfy_env, setup, monkeypatch):
    """A plan with 1 of 2 blocks resident: the sampler's load streams the other block (ComfyUI is asked for a whole
    load, the plan bounds it), the request carries the plan, and the latents equal the whole load's; without the
    streamed plan the next prompt loads the model whole again, hooks gone."""
    transformer, _, positive, latent = setup
    whole = sampler(comfy_env, transformer, positive, latent)["samples"]
    assert transformer.patcher.stream_plan() is None

    with monkeypatch.context() as patch:
        free_memory = pack_module(comfy_env, "graph_runtime.free_memory")
        patch.setattr(free_memory, "host_available_bytes", lambda: 1 << 40)  # steady, so the figures compare
        seen = _streaming_plans(comfy_env, patch, resident_blocks=1)
        streamed = sampler(comfy_env, transformer, positive, latent)["samples"]
        before = transformer.last_budget["available_bytes"]  # checked while the model was still whole
        stream = transformer.patcher.stream_plan()
        assert stream is not None and (stream.resident_blocks, stream.blocks) == (1, 2)
        assert seen and seen[-1].memory_plan.resident_blocks == 1
        assert seen[-1].memory_plan.prefix_placement == "gpu"
        # Checked again while streamed: the model holds only its resident part on the device.
        sampler(comfy_env, transformer, positive, latent)
        assert transformer.last_budget["available_bytes"] == before - (transformer.size_bytes - stream.resident)
    assert (streamed - whole).abs().max() <= ATOL
    assert transformer.loaded.memory_plan is None  # the plan bounds only the load it was made for

    again = sampler(comfy_env, transformer, positive, latent)["samples"]
    assert transformer.patcher.stream_plan() is None and transformer.loaded.streamer is None
    assert all(not b._forward_pre_hooks for b in transformer.module.transformer_blocks)
    assert (again - whole).abs().max() <= ATOL


def test_the_plan_is_logged_once_and_on_the_status(comfy_env, setup, caplog, monkeypatch):
    """The plan's line is logged for a new plan only (the same request again logs no second line, though the free
    memory it is planned against moved), and the status route and report carry it as the last budget's `plan`."""
    transformer, _, positive, latent = setup
    budget_module = pack_module(comfy_env, "graph_runtime.memory.budget")
    free_memory = pack_module(comfy_env, "graph_runtime.free_memory")
    budget_module._LOGGED_PLANS.clear()
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        monkeypatch.setattr(free_memory, "host_available_bytes", lambda: 1 << 40)
        sampler(comfy_env, transformer, positive, latent)
        monkeypatch.setattr(free_memory, "host_available_bytes", lambda: (1 << 40) - (1 << 30))
        sampler(comfy_env, transformer, positive, latent)
    lines = [r.getMessage() for r in caplog.records if "memory plan for 1x 128x96" in r.getMessage()]
    assert len(lines) == 1 and "all 2 blocks resident" in lines[0] and "prefix K/V" in lines[0]
    status = pack_module(comfy_env, "nodes.comfyui.model_cache")
    model = next(m for m in status.status_payload()["models"] if m.get("source") == transformer.source)
    plan = model["budget"]["plan"]
    assert plan["whole"] and plan["resident_blocks"] == plan["blocks"] == 2 and plan["prefix_placement"] == "gpu"
    assert plan["gpu_bytes"] == model["budget"]["total_bytes"]
    assert plan["text"] in status.status_report()
    assert torch.isfinite(torch.tensor(plan["step_ms"]))
