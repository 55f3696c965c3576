"""ComfyUI's FP8 scaled single files (float8_e4m3fn weights with a `.weight_scale` and a comfy_quant record): the
transformer loads them dequantized at load (weight x scale, to the load dtype), says so in the log, and counts as a
float file for `precision`; formats it cannot read are refused naming the format."""

from __future__ import annotations

import json
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from graph_runtime.errors import CheckpointError
from graph_runtime.loading import load_transformer, transformer_from_comfy_state_dict
from graph_runtime.loading.transformer import transformer_is_quantized
from graph_runtime.tiny import build_tiny_components
from graph_runtime.tiny_fp8 import write_fp8_scaled_transformer

F32 = torch.float32


@pytest.fixture(scope="module")
def original():
    return build_tiny_components(0)["transformer"]


@pytest.fixture(scope="module")
def fp8_file(original, tmp_path_factory):
    return write_fp8_scaled_transformer(original.state_dict(), tmp_path_factory.mktemp("fp8") / "tiny_fp8.safetensors")


def test_fp8_layers_load_as_weight_times_scale(original, fp8_file, caplog):
    """Every FP8 block weight equals its e4m3 value times its scale, exactly in fp32 (one product, no other rounding);
    within e4m3's rounding of the original (2^-4 relative: half a step of its 3 mantissa bits; plus 2^-10 of the
    tensor's amax, a loose cover of e4m3's subnormal steps); the log says how many FP8 layers were dequantized; it is not an INT8 file."""
    with caplog.at_level(logging.INFO):
        model = load_transformer(fp8_file, dtype=F32)
    stored = load_file(fp8_file)
    expected = transformer_from_comfy_state_dict(
        {k: stored[k].float() * stored[k[: -len(".weight")] + ".weight_scale"] for k in stored
         if k.endswith(".weight") and stored[k].dtype == torch.float8_e4m3fn})
    state, reference = model.state_dict(), original.state_dict()
    assert expected and all(torch.equal(state[k], v) for k, v in expected.items())
    for key, value in expected.items():
        bound = reference[key].abs() * 2.0 ** -4 + 2.0 ** -10 * reference[key].abs().max()
        assert bool(((value - reference[key]).abs() <= bound * 1.001).all()), key
    layers = sum(1 for k in stored if k.endswith(".comfy_quant"))
    assert f"{layers} FP8 layers dequantized to float32 at load" in caplog.text
    assert not transformer_is_quantized(fp8_file)


def _with_record(fp8_file, tmp_path, record: dict, name: str):
    tensors = load_file(fp8_file)
    key = next(k for k in tensors if k.endswith(".comfy_quant"))
    tensors[key] = torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)
    path = tmp_path / name
    save_file(tensors, path)
    return path, key[: -len(".comfy_quant")]


@pytest.mark.parametrize("fmt", ["convrot_w4a4", "asym_w4a8_int8", "no_such_format"])
def test_formats_that_cannot_be_read_are_named(fp8_file, tmp_path, fmt):
    """A record of a format KV-Graph cannot read (comfy-kitchen's W4A4 / W4A8 ones, an unknown name) names the file,
    the layer and the format."""
    path, prefix = _with_record(fp8_file, tmp_path, {"format": fmt}, f"{fmt}.safetensors")
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(path, dtype=F32)
    message = str(excinfo.value)
    assert str(path) in message and prefix in message and repr(fmt) in message and "cannot read" in message


def test_an_older_scaled_fp8_file_is_refused_by_name(original, tmp_path):
    """The older spelling (a `scaled_fp8` marker, `.scale_weight` scales) is named as such, not as unknown tensors."""
    from graph_runtime.loading import transformer_to_comfy_state_dict

    tensors = transformer_to_comfy_state_dict({k: v.to(torch.bfloat16) for k, v in original.state_dict().items()})
    tensors["model.diffusion_model.scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    path = tmp_path / "legacy.safetensors"
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(path, dtype=F32)
    assert "older scaled-FP8 file" in str(excinfo.value) and "scaled_fp8" in str(excinfo.value)


def test_a_text_encoder_with_fp8_language_layers_loads_dequantized(tmp_path, tiny_folder):
    """The text encoder loader reads the same records: every FP8 language Linear equals its e4m3 value times its
    scale (fp32, exact), and the encoder runs to finite hidden states."""
    from graph_runtime.loading import load_text_encoder, text_encoder_to_comfy_state_dict
    from graph_runtime.tiny_fp8 import write_fp8_scaled

    encoder = build_tiny_components(0)["text_encoder"]
    path = write_fp8_scaled(text_encoder_to_comfy_state_dict(encoder.state_dict()), tmp_path / "te_fp8.safetensors",
                            lambda key: key.startswith("model.language_model.layers."))
    model, processor = load_text_encoder(path, dtype=F32, tokenizer_dir=tiny_folder)
    stored, state = load_file(path), model.state_dict()
    fp8 = [k for k in stored if stored[k].dtype == torch.float8_e4m3fn]
    assert fp8 and all(torch.equal(state[k], stored[k].float() * stored[k[: -len(".weight")] + ".weight_scale"])
                       for k in fp8)
    ids = processor.tokenizer("a red kite", return_tensors="pt").input_ids
    assert torch.isfinite(model.model.language_model(input_ids=ids).last_hidden_state).all()
