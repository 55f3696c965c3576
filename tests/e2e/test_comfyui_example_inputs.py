"""A fresh install runs the edit examples: ComfyUI's input folder starts empty, the pack copies the reference images
the examples load into it at start-up, and both edit workflows run (no "Invalid image file"). A file the user has
under one of those names is never replaced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import REFERENCE_IMAGES, REPO, load_api_workflow, prepare_base, start_server  # noqa: E402

pytestmark = pytest.mark.comfyui

SHIPPED = REPO / "example_workflows" / "inputs"
COPIED_LINE = "copied the edit examples' reference images into ComfyUI's input folder"


@pytest.fixture(scope="module")
def fresh_base(comfyui_install, tmp_path_factory):
    base = prepare_base(tmp_path_factory.mktemp("comfyui-fresh-input"), reference_images=False)
    assert list((base / "input").iterdir()) == []
    return base


def test_the_edit_examples_run_on_a_fresh_input_folder(comfyui_install, fresh_base):
    server = start_server(comfyui_install, fresh_base)
    try:
        log = server.log_path.read_text()
        assert COPIED_LINE in log and all(name in log for name in REFERENCE_IMAGES)
        for name in REFERENCE_IMAGES:
            assert (fresh_base / "input" / name).read_bytes() == (SHIPPED / name).read_bytes()
        for example in ("qwen_image_2.1_edit_one_reference", "qwen_image_2.1_edit_two_references"):
            response = server.queue(load_api_workflow(example, seed=3))
            assert response.status_code == 200, response.text  # "Invalid image file" would be a 400 here
            entry = server.wait(response.json()["prompt_id"])
            assert entry["status"]["status_str"] == "success", server.log_tail()
            assert [p.is_file() for p in server.output_images(entry)] == [True]
        assert "Invalid image file" not in server.log_path.read_text()
    finally:
        server.stop()


def test_a_file_of_the_users_is_never_replaced(comfyui_install, fresh_base):
    own = fresh_base / "input" / REFERENCE_IMAGES[0]
    own.write_bytes((SHIPPED / REFERENCE_IMAGES[1]).read_bytes())  # the user's own picture under that name
    (fresh_base / "input" / REFERENCE_IMAGES[1]).unlink()
    server = start_server(comfyui_install, fresh_base)
    try:
        log = server.log_path.read_text()
        assert f"{COPIED_LINE} {fresh_base / 'input'}: {REFERENCE_IMAGES[1]}\n" in log.replace("\r", "")
        assert own.read_bytes() == (SHIPPED / REFERENCE_IMAGES[1]).read_bytes()
    finally:
        server.stop()
