"""ComfyUI mixed-precision files in comfy-kitchen's block formats (W4A16/AWQ, NVFP4, MXFP8), written by make-tiny's
writer: the transformer loads each dequantized at load to exactly comfy-kitchen's own dequantization of the file's
tensors, within the format's rounding of the original weights, says so in the log, samples, counts as a float file
for `precision`, and an incomplete or damaged layer is refused naming the file and the key."""

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
from graph_runtime.quantized import block_formats
from graph_runtime.tiny import build_tiny_components
from graph_runtime.tiny_kitchen import write_kitchen_transformer

F32 = torch.float32
BLOCKS = ("awq_w4a16", "nvfp4", "mxfp8")
E2M1_MAX, E4M3_MAX = 6.0, 448.0


@pytest.fixture(scope="module")
def original():
    return build_tiny_components(0)["transformer"]


@pytest.fixture(scope="module")
def files(original, tmp_path_factory):
    root = tmp_path_factory.mktemp("kitchen")
    return {f: write_kitchen_transformer(original.state_dict(), root / f"tiny_{f}.safetensors", f) for f in BLOCKS}


def dequantized_layers(stored, fmt) -> dict[str, torch.Tensor]:
    """comfy-kitchen's dequantization of each block-format layer of a file's tensors (fp32), in the file's names."""
    out = {}
    for key in stored:
        if key.endswith(".comfy_quant"):
            prefix = key[: -len(".comfy_quant")]
            roles = block_formats.sidecars(fmt, prefix, stored)
            group = block_formats.group_size(json.loads(bytes(stored[key].tolist())))
            out[prefix + ".weight"] = block_formats.dequantize(
                fmt, stored[prefix + ".weight"], {r: stored[k] for r, k in roles.items()}, group, F32)
    return out


def kitchen_weights(path, fmt) -> dict[str, torch.Tensor]:
    """dequantized_layers of the transformer file, in diffusers' names."""
    return transformer_from_comfy_state_dict(dequantized_layers(load_file(path), fmt))


def rounding_bound(reference: torch.Tensor, fmt: str, stored=None) -> torch.Tensor:
    """The largest error the format's rounding allows per weight, from its block's statistics (blocks of 16 / 32 /
    32 inputs along a row):
    - W4A16 (round to nearest over 16 levels from the group's min to its max): half a step, (max - min) / 30, plus
      the bf16 rounding of the stored scale and zero (2^-9 relative) that moves the grid's ends: 2^-9 (|min| + 16
      steps);
    - NVFP4 (e2m1 levels 0 .. 6, the widest gap 2 between 4 and 6): one block-scale unit, amax / 6 grown by the e4m3
      rounding of the block scale (2^-4), plus what that rounding can clip at the top (2^-4 of amax), plus e4m3's
      subnormal step of the block scale (2^-9 of the tensor scale's unit);
    - MXFP8 (e4m3 values with a power-of-two block scale): half a step of 3 mantissa bits, 2^-4 relative, plus a
      cover of e4m3's subnormal steps (2^-10 of the block's amax)."""
    rows, cols = reference.shape
    size = {"awq_w4a16": 32, "nvfp4": 16, "mxfp8": 32}[fmt]
    blocks = reference.reshape(rows, cols // size, size)
    amax = blocks.abs().amax(-1, keepdim=True)
    if fmt == "awq_w4a16":
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        step = (high - low) / 15
        bound = (step / 2 + 2.0 ** -9 * (low.abs() + 16 * step)).expand_as(blocks)
    elif fmt == "nvfp4":
        unit = reference.abs().max() / (E2M1_MAX * E4M3_MAX)
        bound = (amax / E2M1_MAX * (1 + 2.0 ** -4) + 2.0 ** -4 * amax + 2.0 ** -9 * unit).expand_as(blocks)
    else:
        bound = blocks.abs() * 2.0 ** -4 + 2.0 ** -10 * amax
    return bound.reshape(rows, cols) * 1.001


@pytest.mark.parametrize("fmt", BLOCKS)
def test_each_format_loads_comfy_kitchens_own_dequantization(files, fmt, caplog):
    """In fp32 every block weight is exactly comfy-kitchen's dequantization of the file's tensors (nothing else
    rounds; the fused gate_up is dequantized whole, then split); the log names the format and the count."""
    with caplog.at_level(logging.INFO):
        model = load_transformer(files[fmt], dtype=F32)
    expected, state = kitchen_weights(files[fmt], fmt), model.state_dict()
    assert len(expected) == 14  # two blocks of to_q/k/v, to_out, gate_layer, proj, out: the fused gate_up split
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    layers = sum(1 for k in load_file(files[fmt]) if k.endswith(".comfy_quant"))
    assert f"{layers} {block_formats.LABELS[fmt]} layers dequantized to float32 at load" in caplog.text
    assert not transformer_is_quantized(files[fmt])


@pytest.mark.parametrize("fmt", BLOCKS)
def test_each_format_is_within_its_rounding_of_the_original(original, files, fmt):
    """Every dequantized weight is within the format's rounding (rounding_bound) of the original weight, and the
    rounding is not zero (the file is really quantized)."""
    reference, loaded = original.state_dict(), kitchen_weights(files[fmt], fmt)
    for key, value in loaded.items():
        error = (value - reference[key]).abs()
        assert bool((error <= rounding_bound(reference[key], fmt)).all()), (key, float(error.max()))
    assert any(bool((value != reference[key]).any()) for key, value in loaded.items())


def test_a_block_format_file_samples_as_its_dequantized_weights_do(files):
    """Two steps sampled with the NVFP4 file's model equal, bit for bit on the CPU in fp32, those of the original
    model given comfy-kitchen's dequantized weights (and its other weights rounded to bf16, as the file stores
    them)."""
    from graph_runtime.generate import QwenImageGenerator
    from graph_runtime.loading import QwenImageModels

    parts = build_tiny_components(0)
    reference = parts["transformer"]
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in reference.state_dict().items()})
    reference.load_state_dict(kitchen_weights(files["nvfp4"], "nvfp4"), strict=False)

    def latents(transformer):
        models = QwenImageModels(transformer=transformer, vae=parts["vae"], text_encoder=parts["text_encoder"],
                                 processor=parts["processor"], scheduler_config=dict(parts["scheduler"].config))
        return QwenImageGenerator(models).generate("a red kite", width=64, height=64, steps=2, seed=3).latents

    ours = latents(load_transformer(files["nvfp4"], dtype=F32))
    assert torch.isfinite(ours).all() and torch.equal(ours, latents(reference))


def test_an_nvfp4_pre_quant_scale_is_folded_into_the_columns(files, tmp_path):
    """ComfyUI multiplies a layer's input by its `pre_quant_scale`: loaded, the weight's columns carry it instead
    (fp32: one product per weight)."""
    stored = load_file(files["nvfp4"])
    prefix = "model.diffusion_model.transformer_blocks.0.attn.to_q"
    plain = load_transformer(files["nvfp4"], dtype=F32).state_dict()["transformer_blocks.0.attn.to_q.weight"]
    pre = torch.linspace(0.5, 2.0, plain.shape[1])
    save_file({**stored, prefix + ".pre_quant_scale": pre}, tmp_path / "pre.safetensors")
    folded = load_transformer(tmp_path / "pre.safetensors", dtype=F32).state_dict()
    assert torch.equal(folded["transformer_blocks.0.attn.to_q.weight"], plain * pre)


def _without(path, tmp_path, drop=(), replace=None):
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    tensors.update(replace or {})
    out = tmp_path / "damaged.safetensors"
    save_file(tensors, out)
    return out


@pytest.mark.parametrize("fmt,suffix", [("nvfp4", ".weight_scale_2"), ("nvfp4", ".weight_scale"),
                                        ("mxfp8", ".weight_scale"), ("awq_w4a16", ".weight_zero")])
def test_a_missing_sidecar_is_named(files, tmp_path, fmt, suffix):
    """A layer without one of its format's tensors is refused before any weight is read, naming the file, the key
    and the format."""
    prefix = "model.diffusion_model.transformer_blocks.1.attn.to_v"
    path = _without(files[fmt], tmp_path, drop=[prefix + suffix])
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(path, dtype=F32)
    message = str(excinfo.value)
    assert str(path) in message and prefix + suffix in message and fmt in message and "incomplete" in message


def test_an_awq_group_that_does_not_fit_is_named(files, tmp_path):
    """An AWQ record whose group size does not divide the layer's inputs (or disagrees with its scales' shape) is
    refused naming the key."""
    prefix = "model.diffusion_model.transformer_blocks.0.attn.to_q"
    record = torch.tensor(list(json.dumps({"format": "awq_w4a16", "group_size": 64}).encode()), dtype=torch.uint8)
    path = _without(files["awq_w4a16"], tmp_path, replace={prefix + ".comfy_quant": record})
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(path, dtype=F32)
    assert str(path) in str(excinfo.value) and prefix in str(excinfo.value) and "group_size 64" in str(excinfo.value)


def test_zero_block_scales_are_refused(files, tmp_path):
    """An NVFP4 tensor scale of zero (every weight of the layer 0: a damaged file) is refused naming the key."""
    key = "model.diffusion_model.transformer_blocks.0.attn.to_k.weight_scale_2"
    path = _without(files["nvfp4"], tmp_path, replace={key: torch.zeros((), dtype=F32)})
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(path, dtype=F32)
    assert key in str(excinfo.value) and "all-zero" in str(excinfo.value)


def test_a_block_format_file_becomes_int8_with_auto_where_int8_runs(files):
    """Dequantized at load, the file is a float file to `precision`: int8 (here on the CPU, as the loaders do where
    our INT8 GEMM runs) quantizes its block Linears like a bf16 file's."""
    from graph_runtime.fp8 import apply_precision
    from graph_runtime.quantized import ConvRotInt8Linear

    model = load_transformer(files["mxfp8"], dtype=torch.bfloat16)
    apply_precision(model, "int8", device="cpu")
    assert sum(isinstance(m, ConvRotInt8Linear) for m in model.modules()) == 14


def test_make_tiny_writes_each_format_and_each_loads(tmp_path, capsys):
    """`make-tiny --comfyui-models` writes the FP8 scaled, W4A16/AWQ, NVFP4 and MXFP8 transformers into
    diffusion_models/, and each loads to the bf16 file's weights within its format's rounding (FP8: 2^-4 relative
    plus 2^-10 of the tensor's amax, as tests/test_fp8_scaled_files.py states it; the bf16 file's own rounding,
    2^-8 relative, allowed on top)."""
    from graph_runtime.cli import main
    from graph_runtime.tiny_kitchen import comfyui_kitchen_paths

    models = tmp_path / "models"
    assert main(["make-tiny", "--comfyui-models", str(models)]) == 0
    printed = capsys.readouterr().out
    bf16 = load_transformer(models / "diffusion_models" / "qwen_image_2.1_bf16.safetensors", dtype=F32).state_dict()
    for fmt, path in comfyui_kitchen_paths(models).items():
        assert f"wrote transformer ({fmt}): {path}" in printed
        for key, value in load_transformer(path, dtype=F32).state_dict().items():
            if not (key.startswith("transformer_blocks.") and key.endswith(".weight") and value.dim() == 2):
                continue
            ref = bf16[key]
            bound = (ref.abs() * 2.0 ** -4 + 2.0 ** -10 * ref.abs().max() if fmt == "float8_e4m3fn"
                     else rounding_bound(ref, fmt)) + 2.0 ** -8 * ref.abs()
            assert bool(((value - ref).abs() <= bound).all()), (fmt, key)


@pytest.mark.parametrize("fmt", ["nvfp4", "awq_w4a16"])
def test_a_text_encoder_with_block_format_language_layers_loads_dequantized(tmp_path, tiny_folder, fmt):
    """The text encoder loader reads the same records: every quantized language Linear equals comfy-kitchen's
    dequantization of its tensors (fp32, exact), and the encoder runs to finite hidden states."""
    from graph_runtime.loading import load_text_encoder, text_encoder_from_comfy_state_dict
    from graph_runtime.loading import text_encoder_to_comfy_state_dict
    from graph_runtime.tiny_fp8 import write_fp8_scaled
    from graph_runtime.tiny_kitchen import LAYERS

    encoder = build_tiny_components(0)["text_encoder"]
    path = write_fp8_scaled(text_encoder_to_comfy_state_dict(encoder.state_dict()), tmp_path / f"te_{fmt}.safetensors",
                            lambda key: key.startswith("model.language_model.layers."), layer=LAYERS[fmt])
    model, processor = load_text_encoder(path, dtype=F32, tokenizer_dir=tiny_folder)
    state = model.state_dict()
    expected = text_encoder_from_comfy_state_dict(dequantized_layers(load_file(path), fmt))
    assert expected and all(torch.equal(state[k], v) for k, v in expected.items())
    ids = processor.tokenizer("a red kite", return_tensors="pt").input_ids
    assert torch.isfinite(model.model.language_model(input_ids=ids).last_hidden_state).all()
