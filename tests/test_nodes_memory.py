"""The memory budget through the nodes (CPU, the fake ComfyUI): the sampler refuses a request that cannot fit before
loading or allocating anything, names the settings to change, and the next request that fits runs; the budget is
logged and reported on /kvgraph/status; the VAE decode tiles when only that fits; the placement tooltip says what
each placement costs.

The fake's `get_free_memory` reports `fake.free_memory` when a test sets it (ComfyUI's own reports what the device
has free); on the CPU the runtime's own free-memory figure is unknown, so ComfyUI's is the one used.
"""

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

from graph_runtime import memory  # noqa: E402

FILES = ("qwen_image_2.1_bf16.safetensors", "qwen3vl_8b_bf16.safetensors", "qwen_image_2.1_vae_bf16.safetensors")
DEFAULT_FREE = 1 << 40  # what the fake reports on the CPU when no test sets it


def run(env, node_id, **inputs):
    return env.nodes[node_id].execute(**inputs).args


@pytest.fixture(scope="module")
def loaded(comfy_env):
    transformer, _ = run(comfy_env, "KVGraphLoadTransformer", transformer_name=FILES[0], dtype="fp32")
    text_encoder, = run(comfy_env, "KVGraphLoadTextEncoder", text_encoder_name=FILES[1], dtype="fp32",
                        text_encoder_placement="gpu while encoding, then offload")
    vae, = run(comfy_env, "KVGraphLoadVAE", vae_name=FILES[2], dtype="fp32")
    positive, _, latent = run(comfy_env, "KVGraphTextEncode", text_encoder=text_encoder, prompt="a red cube",
                              negative_prompt="", width=128, height=96, size_from_reference=True,
                              reference_resolution=128)
    return transformer, vae, positive, latent


def sample(env, transformer, positive, latent, **overrides):
    inputs = dict(model=transformer, positive=positive, latent=latent, seed=3, steps=2, cfg=1.0,
                  sigma_preset="dynamic", denoise=1.0, decode_mode="auto", compile="off")
    inputs.update(overrides)
    return run(env, "KVGraphSampler", **inputs)[0]


@pytest.fixture
def free_memory(comfy_env):
    def set_free(value):
        comfy_env.fake.free_memory = value

    yield set_free
    comfy_env.fake.free_memory = None


def test_refusal_names_the_setting_and_the_next_fitting_request_runs(comfy_env, loaded, free_memory, caplog):
    transformer, _, positive, latent = loaded
    caplog.set_level(logging.INFO, logger="kvgraph")
    sample(comfy_env, transformer, positive, latent)
    small = transformer.last_budget
    assert any("memory budget for 1x 128x96" in r.getMessage() for r in caplog.records)
    # The device may hold the request's models, plus what ComfyUI could unload: all but the free memory itself.
    beyond_free = small["available_bytes"] - DEFAULT_FREE
    free_memory(small["total_bytes"] - beyond_free + (1 << 20))  # room for this request and 1 MiB more

    loads, entries = len(comfy_env.fake.load_calls), dict(transformer.engine.manager.entries)
    big = {"samples": torch.zeros(1, 64, 64, 64)}  # 1024x1024
    from_pack = sys.modules[f"{comfy_env.pack.__name__}.graph_runtime.budget"]
    with pytest.raises(from_pack.MemoryBudgetError) as info:
        sample(comfy_env, transformer, positive, big)
    message = str(info.value)
    assert "width x height at most" in message and "(fits)" in message and "Nothing was allocated" in message
    assert "of models ComfyUI can unload" in message
    # Refused before anything was loaded or allocated.
    assert len(comfy_env.fake.load_calls) == loads and dict(transformer.engine.manager.entries) == entries

    out = sample(comfy_env, transformer, positive, latent)  # the fitting request, with the same free memory
    assert out["samples"].shape == (1, 64, 6, 8) and torch.isfinite(out["samples"]).all()
    assert transformer.last_budget["total_bytes"] == small["total_bytes"]


def test_budget_is_on_the_status_route_and_report(comfy_env, loaded):
    transformer, _, positive, latent = loaded
    transformer.last_budget = None
    # Through a handle chained on the loader's (as KV-Graph Load LoRA makes one): the loader's handle reports it.
    sample(comfy_env, dataclasses.replace(transformer, base=transformer), positive, latent)
    assert transformer.last_budget is not None
    status = sys.modules[comfy_env.pack.__name__ + ".nodes.status"]
    model = next(m for m in status.status_payload()["models"] if m.get("source") == transformer.source)
    budget = model["budget"]
    assert budget["total_bytes"] == transformer.last_budget["total_bytes"] > budget["margin_bytes"] > 0
    assert budget["parts"]["transformer weights"] == transformer.size_bytes
    assert "last request's memory budget" in status.status_report()
    loaded_items = {item["kind"]: item for item in status.status_payload()["loaded"]}
    assert loaded_items["transformer"]["bytes"] == transformer.size_bytes  # the loaders' weight sizes


def test_vae_decode_tiles_when_only_a_tiled_decode_fits(comfy_env, loaded, free_memory, caplog):
    _, vae, _, _ = loaded
    dims = memory.VaeDims.of(vae.module)
    whole = memory.vae_decode_bytes(dims, 512, 512) + memory.MARGIN_BYTES
    tiled = memory.vae_decode_bytes(dims, 512, 512, tiled=True) + memory.MARGIN_BYTES
    assert tiled < whole
    caplog.set_level(logging.INFO, logger="kvgraph")
    free_memory((whole + tiled) // 2)
    image, = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": torch.randn(1, 64, 32, 32)})
    assert image.shape == (1, 512, 512, 3) and torch.isfinite(image).all()
    assert any("VAE decode at 512x512 is tiled" in r.getMessage() for r in caplog.records)
    free_memory(None)
    whole_image, = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": torch.randn(1, 64, 8, 8)})
    assert whole_image.shape == (1, 128, 128, 3)


def test_placement_tooltip_states_the_costs(comfy_env):
    schema = comfy_env.nodes["KVGraphLoadTextEncoder"].define_schema()
    placement = next(i for i in schema.inputs if i.id == "text_encoder_placement")
    for cost in ("host RAM", "VRAM", "0.4 s", "pinned", "13-18 s"):
        assert cost in placement.tooltip
