"""The sampler node on a CUDA GPU (run on the H200: `pytest -m gpu tests/test_nodes_gpu.py`).

Acceptance: executing the sampler node twice captures the decode graph on the first call and only replays on the
second. Also: graph output matches eager decoding, and when ComfyUI moves the weights off the GPU the graphs go with
them and are captured afresh on the next run. The tiny model runs in fp32 so tolerances are about graph mechanics
(eager concatenates the prefix instead of reading the static buffer: fp32 round-off, 1e-5), not bf16 rounding.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import close_env, make_env  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = 6
# A ComfyUI checkout: use ComfyUI's real model management and ModelPatcher instead of the fake ones.
REAL_COMFY = os.environ.get("KVGRAPH_COMFYUI_DIR")
GRAPH_ATOL = 1e-5


@pytest.fixture(scope="module")
def gpu_env():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = make_env(device="cuda", real_comfy=REAL_COMFY)
    yield env
    close_env(env)


def run(env, node_id, **inputs):
    return env.nodes[node_id].execute(**inputs).args


@pytest.fixture(scope="module")
def prepared(gpu_env):
    transformer, _ = run(gpu_env, "KVGraphLoadTransformer", transformer_name="qwen_image_2.1_bf16.safetensors",
                       dtype="fp32")
    text_encoder, = run(gpu_env, "KVGraphLoadTextEncoder", text_encoder_name="qwen3vl_8b_bf16.safetensors",
                        dtype="fp32", text_encoder_placement="gpu while encoding, then offload")
    positive, _, latent = run(gpu_env, "KVGraphTextEncode", text_encoder=text_encoder, prompt="a red cube",
                              negative_prompt="", width=256, height=192, size_from_reference=True,
                              reference_resolution=256)
    return transformer, text_encoder, positive, latent


def sample(env, transformer, positive, latent, seed, decode_mode="auto"):
    env.fake.sent.clear()
    out, = run(env, "KVGraphSampler", model=transformer, positive=positive, latent=latent, seed=seed, steps=STEPS,
               cfg=1.0, sigma_preset="dynamic", denoise=1.0, decode_mode=decode_mode, compile="off")
    done = env.fake.events("done")[-1]
    return out["samples"], done


def test_second_execute_only_replays(gpu_env, prepared):
    transformer, text_encoder, positive, latent = prepared
    _, first = sample(gpu_env, transformer, positive, latent, seed=1)
    assert next(transformer.module.parameters()).is_cuda
    assert first["captures"] == 1 and first["replays"] == STEPS and first["eager_steps"] == {}
    _, second = sample(gpu_env, transformer, positive, latent, seed=2)
    assert second["captures"] == 0 and second["replays"] == STEPS and second["eager_steps"] == {}
    status = transformer.engine.status()
    assert len(status["entries"]) == 1 and status["entries"][0]["replays"] >= 2 * STEPS
    # The default placement sends the text encoder back to the CPU once the prompt is encoded.
    assert not next(text_encoder.module.parameters()).is_cuda


def test_graph_replay_matches_eager_decode(gpu_env, prepared):
    transformer, _, positive, latent = prepared
    graph, _ = sample(gpu_env, transformer, positive, latent, seed=5)
    eager, done = sample(gpu_env, transformer, positive, latent, seed=5, decode_mode="eager")
    assert done["eager_steps"] == {"decode mode is eager": STEPS}
    assert torch.allclose(graph, eager, atol=GRAPH_ATOL, rtol=0)


def test_comfyui_unloading_the_model_releases_its_graphs(gpu_env, prepared):
    transformer, _, positive, latent = prepared
    sample(gpu_env, transformer, positive, latent, seed=3)
    assert transformer.engine.status()["entries"]
    # What ComfyUI's free_memory does to make room for another model: unload ours (all of it).
    transformer.patcher.partially_unload(transformer.patcher.offload_device, memory_to_free=1)
    assert not next(transformer.module.parameters()).is_cuda
    assert transformer.engine.status()["entries"] == []
    _, done = sample(gpu_env, transformer, positive, latent, seed=4)  # loads back whole, captures afresh
    assert next(transformer.module.parameters()).is_cuda
    assert done["captures"] == 1 and done["replays"] == STEPS and done["eager_steps"] == {}


def test_comfyui_model_management_tracks_and_unloads_the_model(gpu_env, prepared):
    if not REAL_COMFY:
        pytest.skip("set KVGRAPH_COMFYUI_DIR to a ComfyUI checkout to run against its real model management")
    import comfy.model_management as mm

    transformer, _, positive, latent = prepared
    sample(gpu_env, transformer, positive, latent, seed=6)
    entries = [m for m in mm.current_loaded_models if m.model is transformer.patcher]
    assert len(entries) == 1 and transformer.patcher.loaded_size() == transformer.patcher.model_size() > 0
    assert not transformer.patcher.model.model_lowvram and transformer.engine.status()["entries"]
    # ComfyUI making room for another model (its "unload models" button and free_memory do this).
    mm.unload_all_models()
    assert not next(transformer.module.parameters()).is_cuda and transformer.engine.status()["entries"] == []
    _, done = sample(gpu_env, transformer, positive, latent, seed=7)
    assert next(transformer.module.parameters()).is_cuda
    assert done["captures"] == 1 and done["replays"] == STEPS and done["eager_steps"] == {}
    _, done = sample(gpu_env, transformer, positive, latent, seed=8)  # stays loaded between prompts: replays only
    assert done["captures"] == 0 and done["replays"] == STEPS


def test_status_route_reports_two_queued_prompts_replaying(gpu_env, prepared):
    """What `GET /kvgraph/status` answers after two prompts with the same shapes: the transformer's one graph entry,
    captured once, replayed every step, nothing eager. With KVGRAPH_STATUS_DUMP=FILE the payload is also written to
    FILE, with the second prompt's websocket events as `last_run`: the README's screenshot (tests/browser,
    KVGRAPH_DOCS_STATUS) shows this real GPU status and run in the web panel."""
    import json

    transformer, _, positive, latent = prepared
    transformer.engine.release()
    before = transformer.engine.status()
    sample(gpu_env, transformer, positive, latent, seed=11)
    sample(gpu_env, transformer, positive, latent, seed=12)
    payload = gpu_env.pack.nodes.comfyui.model_cache.status_payload()
    model = next(m for m in payload["models"] if m.get("source") == transformer.source)
    assert len(model["entries"]) == 1 and model["entries"][0]["captures"] == 1
    assert model["captures"] - before["captures"] == 1
    assert model["replays"] - before["replays"] == 2 * STEPS
    assert model["eager_total"] == before["eager_total"]
    dump = os.environ.get("KVGRAPH_STATUS_DUMP")
    if dump:  # with the second prompt's kvgraph.status events, for the panel's "last run"
        Path(dump).write_text(json.dumps({**payload, "last_run": gpu_env.fake.events()}, indent=1, default=str))
