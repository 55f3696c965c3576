"""KV-Graph Save Image next to core's SaveImage in a real ComfyUI: one prompt feeds the same decoded batch to both.

Invariants: each writes one file per image named by ComfyUI's counter (`<prefix>_<counter:05>_.png`, `%batch_num%`
replaced by the image's index), the counter going on from the files already there in the next prompt, our names
those of core's; a file of
ours has exactly the pixels of core's file for the same image and the same text ("prompt", and "workflow" from the
extra_pnginfo the frontend sends), with equal values; the prompt's history lists our files as UI images of type
"output", so the frontend shows them.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import load_api_workflow, node_of  # noqa: E402

pytestmark = pytest.mark.comfyui

T2I = "qwen_image_2.1_text_to_image"
WORKFLOW = {"nodes": [{"id": 7, "type": "SaveImage", "title": "Save image ✓"}], "links": [], "version": 0.4}


@pytest.fixture(scope="module")
def server(classic_server):
    return classic_server


def both_saves(seed: int, folder: str, name: str) -> dict:
    """The text-to-image example at CPU size, its decoded image repeated into a batch of two, saved by core's
    SaveImage (node 7) under `<folder>/core<name>` and by ours (node 9) under `<folder>/ours<name>`."""
    prompt = load_api_workflow(T2I, seed=seed, steps=2)
    prompt["8"] = {"class_type": "RepeatImageBatch", "inputs": {"image": ["6", 0], "amount": 2}}
    node_of(prompt, "SaveImage")["inputs"].update(images=["8", 0], filename_prefix=f"{folder}/core{name}")
    prompt["9"] = {"class_type": "KVGraphSaveImage",
                   "inputs": {"images": ["8", 0], "filename_prefix": f"{folder}/ours{name}"}}
    return prompt


def run_with_workflow(server, prompt: dict) -> dict:
    """Queued as the frontend queues it: the workflow in extra_pnginfo."""
    response = server.post("/prompt", {"prompt": prompt, "client_id": server.client_id,
                                       "extra_data": {"extra_pnginfo": {"workflow": WORKFLOW}}})
    assert response.status_code == 200, f"prompt rejected: {response.text}\n{server.log_tail()}"
    entry = server.wait(response.json()["prompt_id"])
    assert entry["status"]["status_str"] == "success", server.log_tail()
    return entry


# (prefix after "core"/"ours", the names each prompt writes, after "core"/"ours"). The counter goes on from the files
# there; with %batch_num% in the prefix ComfyUI's counter finds no earlier file of that prefix and starts at 1 again.
RUNS = [("", ["_00001_.png", "_00002_.png"]), ("", ["_00003_.png", "_00004_.png"]),
        ("_%batch_num%", ["_0_00001_.png", "_1_00002_.png"])]


def test_files_pixels_metadata_and_ui_match_core_save_image(server):
    folder = f"kvgraph_save_{uuid.uuid4().hex[:8]}"
    output = server.base / "output" / folder
    for seed, (prefix, suffixes) in enumerate(RUNS, start=11):
        entry = run_with_workflow(server, both_saves(seed, folder, prefix))
        assert [item["filename"] for item in entry["outputs"]["7"]["images"]] == [f"core{s}" for s in suffixes]
        assert entry["outputs"]["9"]["images"] == [{"filename": f"ours{s}", "subfolder": folder, "type": "output"}
                                                   for s in suffixes]
        for suffix in suffixes:
            with Image.open(output / f"core{suffix}") as core, Image.open(output / f"ours{suffix}") as ours:
                core.load()
                ours.load()
                assert (ours.mode, ours.size) == (core.mode, core.size)
                assert np.array_equal(np.asarray(ours), np.asarray(core))
                assert set(ours.text) == set(core.text) == {"prompt", "workflow"}
                assert ours.text == core.text
    assert sorted(p.name for p in output.iterdir()) == sorted(
        f"{kind}{suffix}" for kind in ("core", "ours") for _, suffixes in RUNS for suffix in suffixes)


def test_the_server_lists_the_node_with_cores_inputs(server):
    """The node's inputs as ComfyUI reports them: core SaveImage's two, with the same default prefix, and the hidden
    prompt and extra_pnginfo; an output node."""
    info = server.get("/object_info")
    ours, core = info["KVGraphSaveImage"], info["SaveImage"]
    assert ours["output_node"] and list(ours["input"]["required"]) == list(core["input"]["required"])
    assert ours["input"]["required"]["filename_prefix"][1]["default"] == "ComfyUI"
    assert set(ours["input"]["hidden"]) == {"prompt", "extra_pnginfo"}


def only_ours(seed: int, prefix) -> dict:
    """The text-to-image example at CPU size, its image repeated into a batch of two and saved by our node alone
    under `prefix` (a value, or a link)."""
    prompt = load_api_workflow(T2I, seed=seed, steps=2)
    prompt["8"] = {"class_type": "RepeatImageBatch", "inputs": {"image": ["6", 0], "amount": 2}}
    del prompt[next(k for k, v in prompt.items() if v["class_type"] == "SaveImage")]
    prompt["9"] = {"class_type": "KVGraphSaveImage", "inputs": {"images": ["8", 0], "filename_prefix": prefix}}
    return prompt


def test_a_second_run_never_replaces_files_where_cores_counter_starts_again(server):
    """An empty prefix, a prefix ending in "/", one naming only a subfolder and one holding %batch_num%: core's
    counter finds no earlier file of these names and starts at 1 again (core's SaveImage replaces its own files
    here); ours goes on past them, so the second run gets new names and every file of the first run keeps its
    bytes."""
    output = server.base / "output"
    folder = f"kvgraph_again_{uuid.uuid4().hex[:8]}"
    for seed, prefix in enumerate(["", f"{folder}/", f"{folder}_only/", f"{folder}/x_%batch_num%"], start=21):
        seen, kept = [], {}
        for run in range(2):
            entry = run_with_workflow(server, only_ours(seed + run, prefix))
            images = entry["outputs"]["9"]["images"]
            assert len(images) == 2
            for item in images:
                path = output / item["subfolder"] / item["filename"]
                assert item["filename"] not in seen, (prefix, item, seen)
                seen.append(item["filename"])
                kept[path] = path.read_bytes()
        assert all(path.read_bytes() == data for path, data in kept.items()), prefix
    assert not list(output.rglob(".kvgraph-*"))


def test_a_linked_int_prefix_names_the_files_by_its_digits(server):
    """An INT reaching the prefix through core's Switch node (which passes any type) is used as text, as a typed
    prefix of those digits would be, instead of failing with `TypeError: argument of type 'int' is not iterable`."""
    number = int(uuid.uuid4().int % 10**9) + 10**9
    prompt = only_ours(31, ["10", 0])
    prompt["10"] = {"class_type": "ComfySwitchNode", "inputs": {"switch": True, "on_true": number,
                                                               "on_false": number}}
    entry = run_with_workflow(server, prompt)
    assert [item["filename"] for item in entry["outputs"]["9"]["images"]] == [f"{number}_00001_.png",
                                                                             f"{number}_00002_.png"]
