"""The pack in a real ComfyUI started with `--cache-lru 10 --preview-method auto`: models and their graph manager
survive across prompts under the LRU cache too, the sampler streams progress, live previews and `kvgraph.status`
websocket events carrying the prompt id and node id."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import load_api_workflow, node_of, start_server  # noqa: E402

pytestmark = pytest.mark.comfyui

T2I, EDIT = "qwen_image_2.1_text_to_image", "qwen_image_2.1_edit_one_reference"
PREVIEW_EVENTS = {1, 4}  # ComfyUI's binary events for a preview image (plain, and with metadata)


@pytest.fixture(scope="module")
def server(comfyui_install, comfy_base):
    srv = start_server(comfyui_install, comfy_base, "--cache-lru", "10", "--preview-method", "auto")
    yield srv
    srv.stop()


def transformer_models(server):
    return [m for m in server.status()["models"] if (m["source"] or "").endswith("qwen_image_2.1_int8_convrot.safetensors")]


def test_models_and_manager_survive_under_the_lru_cache(server):
    server.run(load_api_workflow(T2I, seed=1))
    first, = transformer_models(server)
    server.run(load_api_workflow(EDIT, seed=2))
    server.run(load_api_workflow(T2I, seed=3))
    again, = transformer_models(server)
    assert again["engine_id"] == first["engine_id"] and again["loads"] == 1
    assert again["captures"] == 0 and again["eager_steps"]["no CUDA"] > first["eager_steps"]["no CUDA"]


def test_progress_previews_and_kvgraph_events(server, websocket_log):
    prompt = load_api_workflow(T2I, seed=4)
    steps = node_of(prompt, "KVGraphSampler")["inputs"]["steps"]
    sampler_id = next(k for k, v in prompt.items() if v["class_type"] == "KVGraphSampler")
    prompt_id = server.queue_ok(prompt)
    entry = server.wait(prompt_id)
    assert entry["status"]["status_str"] == "success"
    deadline = time.time() + 10
    while time.time() < deadline and not any(m.get("type") == "executing" and m["data"].get("node") is None
                                             for m in websocket_log()):
        time.sleep(0.1)
    messages = websocket_log()
    events = [m["data"] for m in messages if m.get("type") == "kvgraph.status"
              and m["data"].get("prompt_id") == prompt_id]
    phases = [e["phase"] for e in events]
    assert phases[0] == "prefill" and phases[-1] == "done" and "fallback" in phases, phases
    assert all(e["node"] == sampler_id for e in events)
    assert next(e for e in events if e["phase"] == "fallback")["reason"] == "no CUDA"
    done = events[-1]
    assert done["captures"] == 0 and done["eager_steps"] == {"no CUDA": steps}
    progress = [m["data"] for m in messages if m.get("type") == "progress" and m["data"].get("node") == sampler_id
                and m["data"].get("prompt_id") == prompt_id]
    assert [p["value"] for p in progress][-1] == steps and progress[-1]["max"] == steps
    previews = [m for m in messages if m.get("type") == "binary" and m["event"] in PREVIEW_EVENTS]
    assert len(previews) >= steps - 1  # a live preview per step (ComfyUI may drop one while sending)
