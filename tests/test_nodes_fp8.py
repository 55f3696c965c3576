"""The transformer loaders' `precision` input (CPU, with the fake ComfyUI pieces of tests/comfy_fake)."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

from graph_runtime.errors import InputError  # noqa: E402
from graph_runtime.fp8 import precision_of  # noqa: E402

T_FILE = "qwen_image_2.1_bf16.safetensors"


def _load(env, **inputs):
    return env.nodes["KVGraphLoadTransformer"].execute(transformer_name=T_FILE, dtype="bf16", **inputs).args[0]


def test_precision_is_optional_cached_apart_and_converts_at_load(comfy_env):  # noqa: F811
    """Without the input (a workflow saved before it existed) the load is `auto`, which on the CPU converts nothing
    and shares bf16's cache entry; fp8 is a model of its own in the cache, loaded once, with its block Linears
    converted; a wrong value names the input."""
    schema = comfy_env.nodes["KVGraphLoadTransformer"].define_schema()
    precision = next(i for i in schema.inputs if i.id == "precision")
    assert precision.optional and precision.default == "auto" and {"bf16", "fp8", "fp8-attn"} <= set(precision.options)
    plain = _load(comfy_env)
    fp8 = _load(comfy_env, precision="fp8")
    assert precision_of(plain.module) == "bf16" and precision_of(fp8.module) == "fp8"
    assert _load(comfy_env, precision="fp8") is fp8 and _load(comfy_env, precision="bf16") is plain
    assert plain.info["precision"] == "bf16"
    node = comfy_env.nodes["KVGraphLoadTransformer"]
    assert node.fingerprint_inputs(T_FILE, "bf16") != node.fingerprint_inputs(T_FILE, "bf16", "fp8")
    # The pack's own InputError (its copy of graph_runtime, loaded as a custom node folder), named by the message.
    with pytest.raises(Exception, match="precision='int4' is invalid: expected one of auto, bf16, fp8") as raised:
        _load(comfy_env, precision="int4")
    assert type(raised.value).__name__ == InputError.__name__


def _fp8_capable(comfy_env, monkeypatch):
    """Make the pack's own copy of fp8/auto.py see a device with FP8 GEMMs and no INT8 path of ours (the fake ComfyUI
    computes on the CPU, where the FP8 Linears then run their dequantized fallback)."""
    auto = importlib.import_module(comfy_env.pack.__name__ + ".graph_runtime.fp8.auto")
    monkeypatch.setattr(auto, "fp8_gemm_reason", lambda device: None)
    monkeypatch.setattr(auto, "int8_tensor_core_reason", lambda device: "no int8 tensor cores")


def test_auto_on_an_fp8_device_loads_fp8_attn_for_a_bf16_file_and_keeps_an_int8_file_int8(comfy_env, monkeypatch):  # noqa: F811,E501
    """Where FP8 GEMMs run but no INT8 path of ours, `auto` on a bf16 file is the fp8-attn model (the same cache entry as picking fp8-attn);
    on an INT8 ConvRot file it keeps the file's int8 layers (no dequantize, no second rounding); fp32 weights stay
    fp32."""
    _fp8_capable(comfy_env, monkeypatch)
    auto = _load(comfy_env)
    assert precision_of(auto.module) == "fp8-attn" and auto.info["precision"] == "fp8-attn"
    assert _load(comfy_env, precision="fp8-attn") is auto
    int8 = comfy_env.nodes["KVGraphLoadTransformer"].execute(
        transformer_name="qwen_image_2.1_int8_convrot.safetensors", dtype="bf16").args[0]
    assert int8.info["weights"] == "int8" and precision_of(int8.module) == "int8" and int8.info["precision"] == "int8"
    fp32 = comfy_env.nodes["KVGraphLoadTransformer"].execute(transformer_name=T_FILE, dtype="fp32").args[0]
    assert precision_of(fp32.module) == "bf16" and next(fp32.module.parameters()).dtype == torch.float32
