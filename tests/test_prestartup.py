"""The pack's prestartup script (prestartup_script.py): ComfyUI runs it before importing torch, and it keeps the
process on PyTorch's native CUDA allocator unless the user asked for cudaMallocAsync. Loaded by path as ComfyUI
loads it, with fake environments (the real ComfyUI start: tests/e2e/test_comfyui_allocator.py)."""

import importlib.util
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "prestartup_script.py"


@pytest.fixture(scope="module")
def prestartup():
    # Loading runs its module-level call on this process's environment, which it leaves alone: torch is imported.
    spec = importlib.util.spec_from_file_location("kvgraph_prestartup_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("conf,expected", [
    ("backend:cudaMallocAsync", ""),
    ("expandable_segments:True,backend:cudaMallocAsync", "expandable_segments:True"),
    ("backend:cudaMallocAsync,backend:cudaMallocAsync", ""),
    ("backend: cudaMallocAsync,max_split_size_mb:512", "max_split_size_mb:512"),
    ("backend:native,expandable_segments:True", "backend:native,expandable_segments:True"),
])
def test_only_the_async_backend_entries_are_removed(prestartup, conf, expected):
    """Other allocator settings (a user's expandable_segments, a split size) are kept as they were."""
    assert prestartup.without_async_entry(conf) == expected


def _comfy_args(cuda_malloc=True):
    return types.SimpleNamespace(args=types.SimpleNamespace(cuda_malloc=cuda_malloc))


def test_comfyuis_default_is_replaced_and_its_flag_follows(prestartup):
    """What ComfyUI's cuda_malloc.py leaves before prestartup scripts run: the entry goes, an emptied variable is
    unset (an empty one is an error to some torch versions), and ComfyUI's own flag says native so its ops behave
    as with --disable-cuda-malloc. The returned line names what changed and how to keep cudaMallocAsync."""
    cli = _comfy_args()
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "PYTORCH_ALLOC_CONF": "expandable_segments:True,"
               "backend:cudaMallocAsync", "OTHER": "x"}
    message = prestartup.keep_native_allocator(environ, ["main.py"], {"comfy.cli_args": cli})
    assert environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "OTHER": "x"}
    assert cli.args.cuda_malloc is False
    assert "PYTORCH_CUDA_ALLOC_CONF" in message and "--cuda-malloc" in message and "KVGRAPH_KEEP_CUDA_MALLOC" in message


@pytest.mark.parametrize("argv,environ_extra,modules_extra", [
    (["main.py", "--cuda-malloc"], {}, {}),
    (["main.py"], {"KVGRAPH_KEEP_CUDA_MALLOC": "1"}, {}),
    (["main.py"], {}, {"torch": object()}),
], ids=["asked-on-the-command-line", "asked-in-the-environment", "torch-already-imported"])
def test_an_explicit_choice_or_a_late_call_changes_nothing(prestartup, argv, environ_extra, modules_extra):
    """`--cuda-malloc` or KVGRAPH_KEEP_CUDA_MALLOC=1 keeps cudaMallocAsync (the graphs then stay eager, for a reason
    the statistics count); once torch is imported the allocator is chosen, and editing the variable would only make
    it lie."""
    cli = _comfy_args()
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", **environ_extra}
    before = dict(environ)
    assert prestartup.keep_native_allocator(environ, argv, {"comfy.cli_args": cli, **modules_extra}) is None
    assert environ == before and cli.args.cuda_malloc is True


def test_nothing_to_do_without_the_entry(prestartup):
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert prestartup.keep_native_allocator(environ, ["main.py"], {}) is None
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
