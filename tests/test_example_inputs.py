"""The edit examples' reference images: shipped in example_workflows/inputs/ under the names the workflows load, and
copied into ComfyUI's input folder when the pack loads, only where a file of that name is missing."""

import importlib.util
import json
import logging
import sys
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
INPUTS = ROOT / "example_workflows" / "inputs"
MODULE = ROOT / "nodes" / "comfyui" / "example_inputs.py"


def standalone_module():
    """nodes/comfyui/example_inputs.py imported on its own, as a tool outside ComfyUI would (no pack, no fake)."""
    spec = importlib.util.spec_from_file_location("kvgraph_example_inputs_standalone", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loaded_images() -> set[str]:
    """Every file name a Load Image node of an example workflow (UI format and API format) asks for."""
    names = set()
    for path in (ROOT / "example_workflows").glob("*.json"):
        names |= {n["widgets_values"][0] for n in json.loads(path.read_text())["nodes"] if n["type"] == "LoadImage"}
    for path in (ROOT / "example_workflows" / "api").glob("*.json"):
        names |= {n["inputs"]["image"] for n in json.loads(path.read_text()).values() if n["class_type"] == "LoadImage"}
    return names


def test_the_shipped_images_are_the_ones_the_workflows_load():
    shipped = {p.name for p in INPUTS.iterdir()}
    assert loaded_images() == shipped == {f"kvgraph_edit_{i}.png" for i in range(1, 6)}
    for path in INPUTS.iterdir():
        assert path.stat().st_size < 16_000, path.name  # drawn shapes: a few KB
        with Image.open(path) as image:
            assert image.format == "PNG" and min(image.size) >= 256, path.name
    with Image.open(INPUTS / "kvgraph_edit_2.png") as image:
        assert image.mode == "RGBA"  # a cut-out object: the encoder's alpha handling is part of the example


def test_the_shipped_images_are_what_make_workflows_draws():
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    import make_workflows

    for name, drawn in make_workflows.draw_reference_images().items():
        with Image.open(INPUTS / name) as shipped:
            assert shipped.mode == drawn.mode and shipped.size == drawn.size, name
            assert shipped.tobytes() == drawn.tobytes(), f"{name}: rerun python tests/e2e/make_workflows.py"


def test_loading_the_pack_copies_them_into_the_input_folder(comfy_env):
    input_dir = comfy_env.fake.input_dir
    for path in INPUTS.iterdir():
        assert (input_dir / path.name).read_bytes() == path.read_bytes()


def test_copies_only_what_is_missing_and_never_overwrites(tmp_path):
    module = standalone_module()
    source = tmp_path / "inputs"
    source.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (source / name).write_bytes(b"shipped " + name.encode())
    (source / "folder").mkdir()  # only files are copied
    target = tmp_path / "input" / "nested"  # made when missing
    assert module.copy_missing_inputs(str(source), str(target)) == ["a.png", "b.png", "c.png"]
    assert (target / "a.png").read_bytes() == b"shipped a.png" and not (target / "folder").exists()

    (target / "a.png").write_bytes(b"the user's own a.png")
    (target / "b.png").unlink()
    (target / "c.png").unlink()
    (target / "c.png").mkdir()  # a folder of that name is not replaced either
    assert module.copy_missing_inputs(str(source), str(target)) == ["b.png"]
    assert (target / "a.png").read_bytes() == b"the user's own a.png"
    assert (target / "c.png").is_dir()
    assert module.copy_missing_inputs(str(source), str(target)) == []
    assert module.copy_missing_inputs(str(tmp_path / "no such folder"), str(target)) == []


def test_install_logs_once_what_it_copied(comfy_env, caplog):
    module = comfy_env.pack.nodes.comfyui.example_inputs
    input_dir = comfy_env.fake.input_dir
    (input_dir / "kvgraph_edit_1.png").unlink()
    (input_dir / "kvgraph_edit_2.png").write_bytes(b"a user's file under that name")
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        assert module.install_example_inputs(str(ROOT)) == ["kvgraph_edit_1.png"]
        assert module.install_example_inputs(str(ROOT)) == []
    lines = [r.getMessage() for r in caplog.records if "reference images" in r.getMessage()]
    assert lines == [f"KV-Graph: copied the edit examples' reference images into ComfyUI's input folder {input_dir}: "
                     "kvgraph_edit_1.png"]
    assert (input_dir / "kvgraph_edit_2.png").read_bytes() == b"a user's file under that name"


def test_without_comfyui_there_is_nothing_to_copy(monkeypatch):
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not Path(p, "folder_paths.py").is_file()])
    assert standalone_module().install_example_inputs(str(ROOT)) == []


def test_a_read_only_input_folder_is_logged_not_raised(comfy_env, tmp_path, monkeypatch, caplog):
    module = comfy_env.pack.nodes.comfyui.example_inputs

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(module, "copy_missing_inputs", refuse)
    with caplog.at_level(logging.WARNING, logger="kvgraph"):
        assert module.install_example_inputs(str(ROOT)) == []
    assert "could not copy the edit examples' reference images" in caplog.text and "read-only" in caplog.text

