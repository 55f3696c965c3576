"""Exactly one engine registry (and one kernel preload) per process, whichever way the code is imported."""

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


def test_one_registry_for_two_import_paths(tiny_models):
    """The pack's relative copy and the installed top-level `graph_runtime` share one registry and one engine."""
    import graph_runtime.registry as top_level

    name, _ = _load_pack_like_comfyui()
    pack_registry = importlib.import_module(f"{name}.graph_runtime.registry")
    assert pack_registry is not top_level  # really two module copies...
    assert pack_registry.process_registry() is top_level.process_registry()  # ...one registry
    transformer = tiny_models.transformer
    assert pack_registry.engine_for(transformer) is top_level.engine_for(transformer)
    assert top_level.engine_for(transformer) in top_level.process_registry().engines()


def test_engine_lives_as_long_as_its_transformer():
    import gc

    from diffusers import QwenImage21Transformer2DModel

    from graph_runtime.registry import engine_for, process_registry
    from graph_runtime.tiny import TINY_TRANSFORMER

    import weakref

    transformer = QwenImage21Transformer2DModel(**TINY_TRANSFORMER)
    engine = engine_for(transformer)
    assert engine_for(transformer) is engine and engine in process_registry().engines()
    engine_ref = weakref.ref(engine)
    del transformer, engine
    gc.collect()
    assert engine_ref() is None  # freed with its transformer, so the registry no longer lists it


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
    assert pack_norms is not top_norms
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
    assert pack_preload is not top_level
    assert pack_preload._state() is top_level._state()
