"""The transformer loaders' `gpus` input in the pack (CPU, the ComfyUI fake): optional with default 1, carried by
the model it outputs without a second load, refused by name when the machine or model cannot take it, and the
sampler node decoding on two gloo processes to the same latents as on one.

The pack is imported under a random module name, as ComfyUI imports it, so the worker (which imports the pack's
runtime as the top-level `graph_runtime`) receives the model and requests across that renaming.
Tolerance as in test_parallel_decode.py: 1e-5 absolute on fp32 latents.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_execute import T_FILE, encode, load_all, run, sampler  # noqa: E402


@pytest.fixture(scope="module")
def loaded(comfy_env):
    transformer, text_encoder, _ = load_all(comfy_env)
    yield transformer, text_encoder
    transformer.loaded.shutdown_parallel()


def _inputs(node):
    schema = node.define_schema()
    return {i.id: i for i in schema.inputs}


@pytest.mark.parametrize("node_id", ["KVGraphLoadTransformer", "KVGraphLoadDiffusers"])
def test_gpus_is_an_optional_input_defaulting_to_one(comfy_env, node_id):
    """Saved workflows without the input still validate and load for one device; the tooltip says that CUDA needs
    one GPU per rank."""
    gpus = _inputs(comfy_env.nodes[node_id])["gpus"]
    assert gpus.optional and gpus.default == 1 and gpus.min == 1
    assert "N GPUs" in gpus.tooltip and "CPU" in gpus.tooltip


def test_gpus_rides_on_the_same_loaded_model(comfy_env, loaded):
    """gpus=2 gives a handle on the same model object (one load from disk); the loader re-runs when it changes."""
    one, _ = loaded
    two = run(comfy_env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32", gpus=2)[0]
    assert two.gpus == 2 and one.gpus == 1 and two.module is one.module
    assert comfy_env.pack.nodes.comfyui.model_cache.load_count(one.key) == 1
    node = comfy_env.nodes["KVGraphLoadTransformer"]
    assert (node.fingerprint_inputs(transformer_name=T_FILE, dtype="fp32", gpus=2)
            != node.fingerprint_inputs(transformer_name=T_FILE, dtype="fp32"))


@pytest.mark.parametrize("gpus, expected", [(0, "a whole number from 1"), (4, "divides the transformer's 2 "
                                                                             "attention heads")])
def test_counts_it_cannot_run_are_refused_by_name(comfy_env, loaded, gpus, expected):
    errors = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.errors")
    with pytest.raises(errors.InputError) as err:
        run(comfy_env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32", gpus=gpus)
    assert f"gpus={gpus}" in str(err.value) and expected in str(err.value)


def test_sampler_on_two_processes_equals_one(comfy_env, loaded):
    """The sampler node with a gpus=2 model: the worker started on the first prompt gives the one-device latents,
    with and without CFG, and stays up for the next prompt."""
    one, text_encoder = loaded
    two = run(comfy_env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32", gpus=2)[0]
    positive, negative, latent = encode(comfy_env, text_encoder)
    for extra in ({}, {"negative": negative, "cfg": 3.0}):
        expected = sampler(comfy_env, one, positive, latent, **extra)["samples"]
        got = sampler(comfy_env, two, positive, latent, **extra)["samples"]
        assert (got - expected).abs().max().item() <= 1e-5 and got.shape == expected.shape
    runtime = one.loaded.parallel_runtime(2)
    assert runtime.starts == 1 and runtime.status()["running"]
