"""The Fun ControlNet examples in a real ComfyUI (CPU, tiny model, the tiny ControlNet `make-tiny` writes into
models/model_patches): each runs as shipped and the ControlNet changes the image; strength 0 gives the image without
the ControlNet bit for bit, on the KV-Graph Sampler and on KSampler; a file that is not a Fun ControlNet Union fails
its prompt with the file named, and the server runs the next prompt."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import LORA_FILE, error_message, load_api_workflow, node_of  # noqa: E402

pytestmark = pytest.mark.comfyui

CONTROL = "qwen_image_2.1_controlnet"
INPAINT = "qwen_image_2.1_controlnet_inpaint"
STEPS = 6  # the KV-Graph Sampler's (KSampler keeps the example's)


@pytest.fixture(scope="module")
def server(classic_server):
    return classic_server


def prompt(name: str, seed: int, strength: float | None = None, without: bool = False, **apply) -> dict:
    graph = load_api_workflow(name, seed=seed, steps=STEPS)
    apply_id = next(k for k, v in graph.items() if v["class_type"] == "KVGraphApplyControlNet")
    if strength is not None:
        graph[apply_id]["inputs"]["strength"] = strength
    graph[apply_id]["inputs"].update(apply)
    if without:  # the same graph with the ControlNet nodes taken out
        model = graph.pop(apply_id)["inputs"]["model"]
        graph.pop(next(k for k, v in graph.items() if v["class_type"] == "KVGraphLoadControlNet"))
        for node in graph.values():
            if node["inputs"].get("model") == [apply_id, 0]:
                node["inputs"]["model"] = model
    return graph


def image(server, graph) -> np.ndarray:
    entry = server.run(graph, timeout=300)
    (path,) = server.output_images(entry)
    return np.asarray(Image.open(path))


@pytest.mark.parametrize("name", [CONTROL, INPAINT], ids=["control-kvgraph-sampler", "inpaint-ksampler"])
def test_the_controlnet_changes_the_image_and_strength_zero_is_the_image_without_it(server, name):
    plain = image(server, prompt(name, 5, without=True))
    controlled = image(server, prompt(name, 5))
    assert not np.array_equal(controlled, plain)
    assert np.array_equal(image(server, prompt(name, 5, strength=0.0)), plain)
    # Acting on part of the schedule only: different from both.
    partial = image(server, prompt(name, 5, start_percent=0.5))
    assert not np.array_equal(partial, plain) and not np.array_equal(partial, controlled)


def test_a_file_that_is_not_a_fun_controlnet_fails_its_prompt_naming_it(server):
    patches = server.base / "models" / "model_patches"
    shutil.copy(server.base / "models" / "loras" / LORA_FILE, patches / "kvgraph_not_a_controlnet.safetensors")
    graph = prompt(CONTROL, 7)
    node_of(graph, "KVGraphLoadControlNet")["inputs"]["controlnet_name"] = "kvgraph_not_a_controlnet.safetensors"
    entry = server.wait(server.queue_ok(graph), timeout=300)
    message = error_message(entry)
    assert "kvgraph_not_a_controlnet.safetensors" in message and "Fun ControlNet Union" in message
    image(server, prompt(CONTROL, 7))  # the server and the loaded model are fine
