"""The transformer loaders' `precision` input (CPU, with the fake ComfyUI pieces of tests/comfy_fake)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

from graph_runtime.errors import InputError  # noqa: E402
from graph_runtime.fp8 import precision_of  # noqa: E402

T_FILE = "qwen_image_2.1_bf16.safetensors"


def _load(env, **inputs):
    return env.nodes["KVGraphLoadTransformer"].execute(transformer_name=T_FILE, dtype="bf16", **inputs).args[0]


def test_precision_is_optional_cached_apart_and_converts_at_load(comfy_env):  # noqa: F811
    """Without the input (a workflow saved before it existed) the load is bf16; fp8 is a model of its own in the
    cache, loaded once, with its block Linears converted; a wrong value names the input."""
    schema = comfy_env.nodes["KVGraphLoadTransformer"].define_schema()
    precision = next(i for i in schema.inputs if i.id == "precision")
    assert precision.optional and precision.default == "bf16" and "fp8" in precision.options
    plain = _load(comfy_env)
    fp8 = _load(comfy_env, precision="fp8")
    assert precision_of(plain.module) == "bf16" and precision_of(fp8.module) == "fp8"
    assert _load(comfy_env, precision="fp8") is fp8 and _load(comfy_env, precision="bf16") is plain
    node = comfy_env.nodes["KVGraphLoadTransformer"]
    assert node.fingerprint_inputs(T_FILE, "bf16") != node.fingerprint_inputs(T_FILE, "bf16", "fp8")
    # The pack's own InputError (its copy of graph_runtime, loaded as a custom node folder), named by the message.
    with pytest.raises(Exception, match="precision='int4' is invalid: expected one of bf16, fp8") as raised:
        _load(comfy_env, precision="int4")
    assert type(raised.value).__name__ == InputError.__name__
