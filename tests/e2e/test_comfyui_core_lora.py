"""The core LoRA loader example in a real ComfyUI (CPU, tiny models, the tiny LoRA `make-tiny` writes): core's own
LoraLoaderModelOnly on the KV-Graph MODEL under KSampler gives the image KV-Graph Load LoRA at the same strength gives
(one LoRA: the same deltas merged by the same code, so the same PNG bit for bit), changes the image, switches strength
without loading the model again, and without it the image is the plain model's bit for bit (weights restored)."""

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

EXAMPLE = "qwen_image_2.1_core_lora"


@pytest.fixture(scope="module")
def server(classic_server):
    return classic_server


def prompt_with(seed: int, loader: str | None = "core", strength: float = 1.0) -> dict:
    """The example; `loader` "kvgraph": KV-Graph Load LoRA in place of core's node; None: no LoRA node."""
    prompt = load_api_workflow(EXAMPLE, seed=seed)
    lora_id = next(k for k, v in prompt.items() if v["class_type"] == "LoraLoaderModelOnly")
    node = prompt[lora_id]
    if loader == "core":
        node["inputs"]["strength_model"] = strength
    elif loader == "kvgraph":
        prompt[lora_id] = {"class_type": "KVGraphLoadLoRA", "inputs": {
            "model": node["inputs"]["model"], "lora_name": node["inputs"]["lora_name"], "strength": strength}}
    else:
        node_of(prompt, "KSampler")["inputs"]["model"] = prompt.pop(lora_id)["inputs"]["model"]
    return prompt


def image(server, prompt) -> np.ndarray:
    (path,) = server.output_images(server.run(prompt))
    return np.asarray(Image.open(path))


def test_core_loader_equals_kvgraph_load_lora_and_switches_in_place(server):
    plain = image(server, prompt_with(17, loader=None))
    core = image(server, prompt_with(17))
    first = transformer_status(server)
    assert [(i["name"], i["strength"]) for i in first["lora"]["loras"]] == [("a LoRA from core's LoRA loader", 1.0)]
    assert not np.array_equal(core, plain)
    assert np.array_equal(image(server, prompt_with(17, loader="kvgraph")), core)
    assert LORA_FILE in [i["name"] for i in transformer_status(server)["lora"]["loras"]]

    half = image(server, prompt_with(17, strength=0.5))
    again = transformer_status(server)
    assert again["engine_id"] == first["engine_id"] and again["loads"] == first["loads"]  # not loaded again
    assert not np.array_equal(half, core) and not np.array_equal(half, plain)
    assert np.array_equal(image(server, prompt_with(17, loader=None)), plain)  # the originals, restored exactly
