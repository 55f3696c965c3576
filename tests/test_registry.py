"""One `graph_runtime` per process, whichever way the code is imported: the pack loaded by folder name as ComfyUI
loads it and the top-level `graph_runtime` (CLI, tests, benchmarks) are the same module objects, so every piece of
module-level state (custom ops, the kernel preload) exists once; engines belong to the loaded model that owns them."""

import importlib.util
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load_pack_like_comfyui():
    """Load the repo as ComfyUI loads a custom node folder: by file location, under an arbitrary module name."""
    name = f"kv-graph-{uuid.uuid4().hex[:6]}"
    spec = importlib.util.spec_from_file_location(name, REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return name, module


def test_pack_imports_outside_comfyui():
    """Outside ComfyUI the pack imports cleanly and only exposes WEB_DIRECTORY."""
    _, pack = _load_pack_like_comfyui()
    assert pack.WEB_DIRECTORY == "./web"


def test_one_graph_runtime_for_two_import_paths():
    """The pack loaded by folder name resolves `<folder>.graph_runtime[.x]` (what the nodes import relatively) to
    the top-level modules themselves, not to second copies."""
    import graph_runtime
    import graph_runtime.decode.engine as top_engine
    import graph_runtime.generate as top_generate

    name, _ = _load_pack_like_comfyui()
    assert importlib.import_module(f"{name}.graph_runtime") is graph_runtime
    assert importlib.import_module(f"{name}.graph_runtime.decode.engine") is top_engine
    assert importlib.import_module(f"{name}.graph_runtime.generate") is top_generate
    from_pack = importlib.import_module(f"{name}.graph_runtime.errors")
    assert from_pack is sys.modules["graph_runtime.errors"] is sys.modules[f"{name}.graph_runtime.errors"]


def test_a_different_copy_of_graph_runtime_is_refused_with_a_clear_error(tmp_path, monkeypatch):
    """A top-level `graph_runtime` imported from another place than the pack's folder is an install mistake: the
    pack's import names both places instead of running on two copies."""
    import types

    other = tmp_path / "graph_runtime" / "__init__.py"
    other.parent.mkdir()
    other.write_text("")
    monkeypatch.setitem(sys.modules, "graph_runtime", types.ModuleType("graph_runtime"))
    sys.modules["graph_runtime"].__file__ = str(other)
    try:
        _load_pack_like_comfyui()
    except ImportError as error:
        assert str(other) in str(error) and str(REPO) in str(error)
    else:
        raise AssertionError("a second copy of graph_runtime was accepted")


def test_the_engine_belongs_to_the_loaded_model_and_lives_as_long_as_it():
    """The transformer's owner makes its engine once and keeps it; nothing is attached to the transformer (a third
    party's module), so the engine, its graphs and its LoRA state go with the owner."""
    import gc
    import weakref

    from diffusers import QwenImage21Transformer2DModel

    from graph_runtime.loaded import LoadedTransformer
    from graph_runtime.tiny import TINY_TRANSFORMER

    transformer = QwenImage21Transformer2DModel(**TINY_TRANSFORMER)
    before = set(vars(transformer))
    loaded = LoadedTransformer(transformer)
    engine = loaded.engine
    assert loaded.engine is engine and loaded.engines() == [engine] and loaded.lora_state() is loaded.lora_state()
    assert set(vars(transformer)) == before  # nothing stuck onto the transformer
    engine_ref = weakref.ref(engine)
    del loaded, engine
    gc.collect()
    assert engine_ref() is None  # freed with its owner


def test_a_release_asked_for_during_a_run_waits_for_its_end(tiny_models):
    """The owner counts its runs: a release of its graphs while one runs is deferred, then done when the last run
    ends (a prompt in flight keeps the entries it replays)."""
    from graph_runtime.loaded import LoadedTransformer

    loaded = LoadedTransformer(tiny_models.transformer)
    released = []
    loaded.engine.release = lambda: released.append(1) or {"entries": 0}
    with loaded.running():
        with loaded.running():
            assert loaded.busy and loaded.release_graphs("test") == "deferred" and released == []
        assert released == []  # one run still holds the graphs
    assert released == [1] and not loaded.busy
    assert loaded.release_graphs("test") == "released" and released == [1, 1]


def test_installed_distribution_exposes_no_top_level_nodes():
    """`nodes` would shadow ComfyUI's own module: the package config installs only graph_runtime."""
    import tomllib

    from setuptools import find_packages

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    found = find_packages(where=str(REPO), **config["tool"]["setuptools"]["packages"]["find"])
    assert "graph_runtime" in found and "graph_runtime.decode" in found
    assert not any(p == "nodes" or p.startswith("nodes.") or p.startswith("tests") for p in found)


def test_one_definition_of_each_kernel_op_for_two_import_paths():
    """Both module copies use the same `torch.library` op objects: a second definition under the same name would
    destroy the first's library and leave calls through the first copy on a deregistered kernel."""
    import torch

    import graph_runtime.kernels.norm_modulate as top_norms
    import graph_runtime.kernels.qk_norm_rope as top_qk

    name, _ = _load_pack_like_comfyui()
    pack_norms = importlib.import_module(f"{name}.graph_runtime.kernels.norm_modulate")
    pack_qk = importlib.import_module(f"{name}.graph_runtime.kernels.qk_norm_rope")
    assert pack_norms is top_norms
    assert pack_norms.norm_modulate is top_norms.norm_modulate
    assert pack_norms.residual_norm_modulate is top_norms.residual_norm_modulate
    assert pack_qk.qk_norm_rope_write is top_qk.qk_norm_rope_write
    x, scale = torch.randn(1, 3, 8), torch.randn(1, 8)
    torch.testing.assert_close(top_norms.norm_modulate(x, scale, 1e-6),
                               top_norms.reference_norm_modulate(x, None, None, scale, 1e-6)[1])


def test_one_kernel_preload_for_two_import_paths():
    """Both copies start, wait for and report the same preload (kernels/preload.py), so neither sets Triton up
    while the other's thread does."""
    import graph_runtime.kernels.preload as top_level

    name, _ = _load_pack_like_comfyui()
    pack_preload = importlib.import_module(f"{name}.graph_runtime.kernels.preload")
    assert pack_preload is top_level
    assert pack_preload._state() is top_level._state()
