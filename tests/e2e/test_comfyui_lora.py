"""The LoRA example in a real ComfyUI (CPU, tiny model, the tiny LoRA `prepare_base` puts in models/loras): the LoRA
changes the image; queueing it again with another strength merges again without loading the model again; strength 0
gives the image without the LoRA bit for bit; and a fresh load merged at that strength gives the same image."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import LORA_FILE, load_api_workflow, node_of  # noqa: E402
from test_comfyui_classic import transformer_status  # noqa: E402

pytestmark = pytest.mark.comfyui

EXAMPLE = "qwen_image_2.1_lora"


@pytest.fixture(scope="module")
def server(classic_server):
    return classic_server


def lora_prompt(seed: int, strength: float | None = None, without_lora: bool = False) -> dict:
    prompt = load_api_workflow(EXAMPLE, seed=seed)
    lora_id = next(k for k, v in prompt.items() if v["class_type"] == "KVGraphLoadLoRA")
    if strength is not None:
        prompt[lora_id]["inputs"]["strength"] = strength
    if without_lora:  # the same graph with the LoRA node taken out
        node_of(prompt, "KVGraphSampler")["inputs"]["model"] = prompt.pop(lora_id)["inputs"]["model"]
    return prompt


def image(server, prompt) -> np.ndarray:
    entry = server.run(prompt)
    (path,) = server.output_images(entry)
    return np.asarray(Image.open(path))


def test_lora_changes_the_image_and_a_new_strength_merges_without_reloading(server):
    plain = image(server, lora_prompt(31, without_lora=True))
    assert transformer_status(server)["lora"]["loras"] == []
    full = image(server, lora_prompt(31))
    first = transformer_status(server)
    assert [(i["name"], i["strength"]) for i in first["lora"]["loras"]] == [(LORA_FILE, 1.0)]
    assert not np.array_equal(full, plain)

    half = image(server, lora_prompt(31, strength=0.5))
    again = transformer_status(server)
    assert again["engine_id"] == first["engine_id"] and again["loads"] == first["loads"]  # not loaded again
    assert [i["strength"] for i in again["lora"]["loras"]] == [0.5]
    assert again["lora"]["merges"] == first["lora"]["merges"] + 1
    assert not np.array_equal(half, full) and not np.array_equal(half, plain)

    assert np.array_equal(image(server, lora_prompt(31, strength=0.0)), plain)  # the originals, restored exactly
    assert transformer_status(server)["lora"]["loras"] == []

    # A fresh load (released, and another graph run so ComfyUI's classic cache drops the loader's output).
    assert server.post("/kvgraph/release", {"models": True}).ok
    server.run({"1": {"class_type": "KVGraphCacheStatus", "inputs": {}}})
    fresh = image(server, lora_prompt(31, strength=0.5))
    assert transformer_status(server)["loads"] == again["loads"] + 1
    assert np.array_equal(fresh, half)


def test_a_missing_lora_file_fails_that_prompt_with_its_name(server):
    prompt = lora_prompt(41)
    node_of(prompt, "KVGraphLoadLoRA")["inputs"]["lora_name"] = "kvgraph_missing_lora.safetensors"
    response = server.queue(prompt)
    # ComfyUI validates combo values before running: the prompt is refused, naming the input and the value.
    assert response.status_code == 400
    assert "lora_name" in response.text and "kvgraph_missing_lora.safetensors" in response.text
    image(server, lora_prompt(42))
