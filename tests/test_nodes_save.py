"""KV-Graph Save Image inside the fake ComfyUI: the node asks ComfyUI for the folder and counter with core's
arguments (the prefix, the output folder, the first image's width and height), writes one file per image under
core's names (`%batch_num%` replaced, the counter counting up), the pixels as core converts them, the prompt and each
extra_pnginfo key as JSON text unless metadata is disabled, and lists every file in its UI result. Against a real
ComfyUI and core's own SaveImage: tests/e2e/test_comfyui_save_image.py.
"""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

PROMPT = {"1": {"class_type": "KVGraphSampler", "inputs": {"seed": 7}}}
EXTRA = {"workflow": {"nodes": [{"id": 1, "title": "café ✓"}]}, "note": [1, 2]}


@pytest.fixture
def save_node(comfy_env, monkeypatch):
    node = comfy_env.nodes["KVGraphSaveImage"]
    monkeypatch.setattr(node, "hidden", types.SimpleNamespace(prompt=PROMPT, extra_pnginfo=EXTRA), raising=False)
    monkeypatch.setattr(comfy_env.fake, "save_counter", 41)
    comfy_env.fake.save_path_calls.clear()
    return node


def batch(count=2, height=24, width=40, seed=0):
    # Values on and off the 1/255 grid, and outside [0, 1], to see core's clip-and-truncate conversion.
    return torch.rand(count, height, width, 3, generator=torch.Generator().manual_seed(seed)) * 1.2 - 0.1


def test_saves_each_image_under_cores_names_with_its_metadata(comfy_env, save_node):
    images = batch()
    output = save_node.execute(images=images, filename_prefix="runs/cat_%batch_num%")
    out_dir = comfy_env.fake.output_dir
    assert comfy_env.fake.save_path_calls == [("runs/cat_%batch_num%", str(out_dir), 40, 24)]
    names = ["cat_0_00041_.png", "cat_1_00042_.png"]
    assert output.ui == {"images": [{"filename": name, "subfolder": "runs", "type": "output"} for name in names]}
    assert output.args[0] is images  # passed through, as newer core SaveImage does
    for index, name in enumerate(names):
        with Image.open(out_dir / "runs" / name) as saved:
            saved.load()
            expected = np.clip(255.0 * images[index].numpy(), 0, 255).astype(np.uint8)
            assert saved.mode == "RGB" and np.array_equal(np.asarray(saved), expected)
            assert saved.text == {"prompt": json.dumps(PROMPT), "workflow": json.dumps(EXTRA["workflow"]),
                                  "note": json.dumps(EXTRA["note"])}


def test_disable_metadata_writes_no_text(comfy_env, save_node, monkeypatch):
    monkeypatch.setattr(comfy_env.fake.cli_args.args, "disable_metadata", True)
    output = save_node.execute(images=batch(1), filename_prefix="bare")
    assert output.ui["images"] == [{"filename": "bare_00041_.png", "subfolder": "", "type": "output"}]
    with Image.open(comfy_env.fake.output_dir / "bare_00041_.png") as saved:
        assert saved.text == {}


def test_no_prompt_and_no_extra_pnginfo_write_no_text(comfy_env, save_node, monkeypatch):
    """A prompt queued without the frontend (no workflow) and without a prompt: no text, as core writes none."""
    monkeypatch.setattr(save_node, "hidden", types.SimpleNamespace(prompt=None, extra_pnginfo=None))
    save_node.execute(images=batch(1), filename_prefix="plain")
    with Image.open(comfy_env.fake.output_dir / "plain_00041_.png") as saved:
        assert saved.text == {}
