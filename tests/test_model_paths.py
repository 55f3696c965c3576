"""Model-name containment (graph_runtime.loading.paths): a name given to a loader stays inside its model folder.

Plain path logic on a temporary tree: a model folder with a file, a subfolder and a symlink to a folder outside, and
an outside folder holding a file a traversal would reach.
"""

import os

import pytest

from graph_runtime.errors import InputError
from graph_runtime.loading.paths import OutsideModelFolder, find_in_folders, name_parts


@pytest.fixture
def tree(tmp_path):
    models = tmp_path / "models" / "vae"
    (models / "sub").mkdir(parents=True)
    (models / "a.safetensors").write_bytes(b"a")
    (models / "sub" / "b.safetensors").write_bytes(b"b")
    outside = tmp_path / "downloads" / "qwen"
    outside.mkdir(parents=True)
    (outside / "c.safetensors").write_bytes(b"c")
    (tmp_path / "downloads" / "secret.safetensors").write_bytes(b"s")
    (models / "linked").symlink_to(outside, target_is_directory=True)
    return models, tmp_path


def find(models, name, **kw):
    return find_in_folders([models], name, input_name="vae_name", folder="vae", **kw)


REFUSED = [
    "../downloads/secret.safetensors", "../../etc/passwd", "..", "sub/../../x", "sub/..", "a/../a.safetensors",
    "/etc/passwd", "//etc/passwd", "C:/Windows/x", "C:x", "\\\\server\\share\\x", "\\x", "sub\\..\\..\\x",
    "x\x00y", None, 3, b"a.safetensors",
]


@pytest.mark.parametrize("name", REFUSED, ids=repr)
def test_names_that_could_leave_the_folder_are_refused(tree, name):
    models, _ = tree
    assert name_parts(name) is None
    with pytest.raises(OutsideModelFolder) as info:
        find(models, name)
    assert isinstance(info.value, InputError) and info.value.name == "vae_name"


def test_the_refusal_says_the_same_whether_the_outside_path_exists(tree):
    models, root = tree
    messages = set()
    for name in ("../downloads/secret.safetensors", "../downloads/missing.safetensors", str(root / "downloads"),
                 "/nonexistent/folder", "linked/../secret.safetensors"):
        with pytest.raises(OutsideModelFolder) as info:
            find(models, name)
        messages.add(str(info.value))
    assert len(messages) == 1
    message, = messages
    assert message.startswith("vae_name:") and "models/vae" in message  # names the input and its folder
    assert "secret" not in message and "downloads" not in message and str(root) not in message
    assert "exist" not in message and "found" not in message


@pytest.mark.parametrize("name, expected", [
    ("a.safetensors", "a.safetensors"),
    ("./a.safetensors", "a.safetensors"),
    ("sub/b.safetensors", "sub/b.safetensors"),
    ("sub//b.safetensors", "sub/b.safetensors"),
    # A symlink that lives inside the model folder is followed, as ComfyUI's folder_paths does.
    ("linked/c.safetensors", "linked/c.safetensors"),
])
def test_names_inside_resolve_under_the_folder(tree, name, expected):
    models, _ = tree
    path = find(models, name)
    assert path == os.path.join(models, *expected.split("/"))
    assert os.path.isfile(path)


def test_an_inside_name_that_matches_nothing_is_none(tree):
    models, _ = tree
    assert find(models, "missing.safetensors") is None
    assert find(models, "sub") is None  # a folder is not a file
    assert find(models, "sub", directory=True) == os.path.join(models, "sub")
    assert find(models, "a.safetensors", directory=True) is None


def test_the_first_folder_holding_the_name_wins(tree, tmp_path):
    models, _ = tree
    extra = tmp_path / "extra_models"
    extra.mkdir()
    (extra / "a.safetensors").write_bytes(b"extra")
    (extra / "only_here.safetensors").write_bytes(b"x")
    roots = [models, extra]
    assert find_in_folders(roots, "a.safetensors", input_name="n", folder="vae") == os.path.join(models,
                                                                                               "a.safetensors")
    assert find_in_folders(roots, "only_here.safetensors", input_name="n", folder="vae") == os.path.join(
        extra, "only_here.safetensors")


def test_a_backslash_is_a_separator_only_on_windows():
    assert name_parts("sub/b.safetensors") == ("sub", "b.safetensors")
    expected = ("sub", "b.safetensors") if os.sep == "\\" else ("sub\\b.safetensors",)
    assert name_parts("sub\\b.safetensors") == expected
