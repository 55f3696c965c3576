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


@pytest.fixture
def fresh_output(comfy_env, monkeypatch, tmp_path):
    """An empty output folder for this test alone."""
    monkeypatch.setattr(comfy_env.fake, "output_dir", tmp_path)
    return tmp_path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("prefix", ["", "sub/", "runs/", "runs/cat_%batch_num%", "%batch_num%"])
def test_a_second_run_never_replaces_the_first_runs_files(comfy_env, save_node, fresh_output, prefix):
    """Core's counter misses earlier files for these prefixes (the fake's counter stays at 41, as core's does): the
    second run must still get new names, the counter going on past the first run's files, whose bytes are
    unchanged."""
    first = save_node.execute(images=batch(seed=1), filename_prefix=prefix).ui["images"]
    folder = fresh_output / first[0]["subfolder"]
    before = _files(folder)
    second = save_node.execute(images=batch(seed=2), filename_prefix=prefix).ui["images"]
    names = [item["filename"] for item in first + second]
    assert len(set(names)) == 4, names
    assert [name.rsplit("_", 2)[-2] for name in names] == ["00041", "00042", "00043", "00044"]
    after = _files(folder)
    assert {name: after[name] for name in before} == before
    assert set(after) == set(before) | {item["filename"] for item in second}


def test_a_name_taken_by_someone_else_is_skipped_not_replaced(comfy_env, save_node, fresh_output, monkeypatch):
    """A file that appears under the next name after the counter was read (another writer) keeps its bytes; the
    image takes the next free name. The same holds on a file system without hard links."""
    import itertools

    import graph_runtime.comfy_interop.saved_images as saved_images

    out = fresh_output
    real = saved_images.write_new_file

    def someone_writes_first(paths, write):
        paths = iter(paths)
        first = next(paths)
        Path(first).write_bytes(b"theirs")
        return real(itertools.chain([first], paths), write)

    monkeypatch.setattr(saved_images, "write_new_file", someone_writes_first)
    result = save_node.execute(images=batch(1), filename_prefix="race").ui["images"]
    assert (out / "race_00041_.png").read_bytes() == b"theirs"
    assert result == [{"filename": "race_00042_.png", "subfolder": "", "type": "output"}]

    import errno
    import os

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    result = save_node.execute(images=batch(1), filename_prefix="race").ui["images"]
    assert (out / "race_00043_.png").read_bytes() == b"theirs"
    assert result == [{"filename": "race_00044_.png", "subfolder": "", "type": "output"}]
    assert not [p for p in out.iterdir() if p.name.startswith(".kvgraph-")]


def test_a_linked_number_is_used_as_text_and_other_types_are_refused(comfy_env, save_node, fresh_output):
    """A linked INT (or FLOAT) prefix names the files as its digits would; a value of another type is refused with a
    message naming the input, not a TypeError from deep inside."""
    from graph_runtime.errors import InputError

    result = save_node.execute(images=batch(1), filename_prefix=7).ui["images"]
    assert result == [{"filename": "7_00041_.png", "subfolder": "", "type": "output"}]
    assert comfy_env.fake.save_path_calls[-1][0] == "7"
    with pytest.raises(InputError, match=r"filename_prefix=.* expected text"):
        save_node.execute(images=batch(1), filename_prefix={"a": 1})


def test_a_full_disk_leaves_no_png_under_the_final_name(comfy_env, save_node, fresh_output, monkeypatch):
    """A write that fails part way (a full disk) raises an error naming the file and leaves neither a truncated PNG
    under its name nor the temporary file."""
    import errno

    import graph_runtime.comfy_interop.saved_images as saved_images
    from graph_runtime.errors import OutputWriteError

    def write_then_fail(file, *args, **kwargs):
        file.write(b"\x89PNG partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saved_images, "write_png", write_then_fail)
    with pytest.raises(OutputWriteError, match=r"full_00041_\.png could not be written: the disk is full"):
        save_node.execute(images=batch(1), filename_prefix="full")
    assert list(fresh_output.iterdir()) == []
