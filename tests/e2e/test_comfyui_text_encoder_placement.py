"""The text encoder placements `auto` and `streamed by layer` inside a real ComfyUI (CPU, tiny models).

ComfyUI lists the new choices with `auto` as the default; a workflow that sets either runs and gives the image the
placement saved in the examples gives (`gpu while encoding, then offload`), pixel for pixel: on the CPU the encoder
encodes in place whatever the placement, so this checks the plumbing through ComfyUI's validation, execution and cache;
tests/gpu/test_gpu_text_encoder_stream.py checks the streaming itself on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import load_api_workflow, node_of  # noqa: E402

pytestmark = pytest.mark.comfyui

EXAMPLE = "qwen_image_2.1_text_to_image"
SAVED = "gpu while encoding, then offload"  # what the shipped examples hold


@pytest.fixture(scope="module")
def server(classic_server):
    return classic_server


def with_placement(placement: str | None, seed: int = 5) -> dict:
    prompt = load_api_workflow(EXAMPLE, seed=seed, steps=2)
    node_of(prompt, "KVGraphLoadTextEncoder")["inputs"]["text_encoder_placement"] = placement
    return prompt


def test_comfyui_lists_the_placements_with_auto_by_default(server):
    spec = server.get("/object_info/KVGraphLoadTextEncoder")["KVGraphLoadTextEncoder"]["input"]["required"]
    options, extra = spec["text_encoder_placement"][0], spec["text_encoder_placement"][1]
    if isinstance(options, str):  # ComfyUI 0.33 lists a combo as ("COMBO", {"options": [...]})
        options = extra["options"]
    assert options == ["auto", SAVED, "always gpu", "streamed by layer", "cpu"]
    assert extra["default"] == "auto" and "streamed by layer" in extra["tooltip"]


def test_every_placement_gives_the_saved_placements_image(server):
    """A workflow saved with the former default still runs; `auto` and `streamed by layer` give its image exactly."""
    saved = server.output_pixels(server.run(with_placement(SAVED)))
    for placement in ("auto", "streamed by layer"):
        assert server.output_pixels(server.run(with_placement(placement))) == saved, placement


def test_an_unknown_placement_is_refused_when_queued(server):
    response = server.queue(with_placement("streamed"))
    assert response.status_code == 400 and "text_encoder_placement" in response.text
