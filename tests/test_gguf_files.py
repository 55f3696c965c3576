"""ComfyUI-GGUF transformer files (`qwen_image21`), written by make-tiny's GGUF writer: every type gguf writes loads to
exactly the file's own dequantized weights, stays within the type's rounding of the original weights, samples, and a
damaged file fails with an error naming the file and the tensor."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import struct

import numpy as np
import pytest
import torch

from graph_runtime.errors import CheckpointError
from graph_runtime.loading import load_transformer, transformer_from_comfy_state_dict
from graph_runtime.loading.gguf_files import GGUFFile
from graph_runtime.loading.transformer import transformer_is_quantized
from graph_runtime.tiny import build_tiny_components
from graph_runtime.tiny_gguf import GGUF_TYPES, write_gguf_transformer

F32, BF16 = torch.float32, torch.bfloat16
EXPECTED = "Qwen-Image-2.1 transformer"

# The largest error each type's rounding allows, per element, from its block's statistics (32 weights along a row):
# a step d of amax/127 (Q8_0), amax/16 (Q5_0), amax/8 (Q4_0), or (max-min)/31 (Q5_1) and /15 (Q4_1). Rounding costs
# half a step, except that the _0 types' levels -2^(b-1)..2^(b-1)-1 stop one step short on the side opposite the
# block's largest value (a full step there); the fp16 scale d (and min m) add their own rounding, 2^-11 relative,
# times the largest level (and |min|). F16 / BF16 round each value (relative 2^-11 / 2^-8; below 2^-14 fp16 is
# subnormal, with a fixed half step of 2^-25).
# type: (statistic, levels, steps of rounding)
STEPS = {"Q8_0": ("amax", 127, 0.5), "Q5_0": ("amax", 16, 1.0), "Q4_0": ("amax", 8, 1.0), "Q5_1": ("range", 31, 0.5),
         "Q4_1": ("range", 15, 0.5)}
FP16 = 2.0 ** -11
RELATIVE = {"F16": 2.0 ** -11, "BF16": 2.0 ** -8}
SUBNORMAL = {"F16": 2.0 ** -25, "BF16": 0.0}


@pytest.fixture(scope="module")
def original():
    return build_tiny_components(0)["transformer"]


@pytest.fixture(scope="module")
def files(original, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {t: write_gguf_transformer(original.state_dict(), root / f"tiny-{t}.gguf", t) for t in GGUF_TYPES}


def file_weights(path) -> dict[str, torch.Tensor]:
    """The file's own dequantized weights (gguf's numpy dequantizer), in diffusers' names."""
    file = GGUFFile(path, "")
    return transformer_from_comfy_state_dict({k: torch.from_numpy(np.array(file.dequantized(k), np.float32))
                                              for k in file.tensors})


def rounding_bound(reference: torch.Tensor, qtype: str) -> torch.Tensor:
    if qtype in RELATIVE:
        return reference.abs() * RELATIVE[qtype] * 1.01 + SUBNORMAL[qtype]
    if reference.dim() != 2 or reference.shape[-1] % 32:
        return torch.zeros_like(reference)  # written F32: exact
    blocks = reference.reshape(reference.shape[0], -1, 32)
    kind, levels, rounding = STEPS[qtype]
    if kind == "amax":
        step = blocks.abs().amax(-1) / levels
        bound = step * (rounding + levels * FP16)
    else:
        low = blocks.amin(-1)
        step = (blocks.amax(-1) - low) / levels
        bound = step * (rounding + levels * FP16) + low.abs() * FP16
    return bound.unsqueeze(-1).expand_as(blocks).reshape(reference.shape)


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_each_type_loads_the_files_own_dequantized_weights(files, qtype):
    """In fp32 every weight is exactly what gguf dequantizes from the file (nothing else rounds); in bf16 it is that
    value rounded to bf16 once (torch's cast: the load adds no other rounding)."""
    expected = file_weights(files[qtype])
    model32 = load_transformer(files[qtype], dtype=F32)
    model16 = load_transformer(files[qtype], dtype=BF16)
    assert not transformer_is_quantized(files[qtype])  # a float load: `auto` quantizes it as a bf16 file's
    state32, state16 = model32.state_dict(), model16.state_dict()
    assert set(state32) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state32[key], value), key
        assert torch.equal(state16[key], value.to(BF16)), key


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_each_type_is_within_its_rounding_of_the_original(original, files, qtype):
    """Against the float weights the file was written from, each element's error is within the type's rounding
    (STEPS / RELATIVE above), and the quantized types did round (the blocks' Linears are not stored exactly)."""
    loaded = load_transformer(files[qtype], dtype=F32).state_dict()
    rounded = 0
    for key, reference in original.state_dict().items():
        error = (loaded[key] - reference).abs()
        assert bool((error <= rounding_bound(reference, qtype) + 1e-12).all()), (key, float(error.max()))
        rounded += int(bool((error > 0).any()))
    assert rounded > 0


def test_a_gguf_transformer_samples_as_its_dequantized_weights_do(original, files):
    """Two steps sampled with the Q4_0 file's model equal, bit for bit on the CPU in fp32, those of the original
    model given the file's dequantized weights: the loaded model is the file's weights, nothing more."""
    from graph_runtime.generate import QwenImageGenerator
    from graph_runtime.loading import QwenImageModels

    parts = build_tiny_components(0)
    reference = parts["transformer"]
    reference.load_state_dict(file_weights(files["Q4_0"]))

    def latents(transformer):
        models = QwenImageModels(transformer=transformer, vae=parts["vae"], text_encoder=parts["text_encoder"],
                                 processor=parts["processor"], scheduler_config=dict(parts["scheduler"].config))
        return QwenImageGenerator(models).generate("a red kite", width=64, height=64, steps=2, seed=3).latents

    ours, theirs = latents(load_transformer(files["Q4_0"], dtype=F32)), latents(reference)
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, latents(original))  # Q4_0 rounding does change the sample


# -------------------------------------------------------------------------------------------------- damaged files


def _error(path, needles):
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(path, dtype=F32)
    message = str(excinfo.value)
    assert str(path) in message and EXPECTED in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_a_truncated_file_names_the_tensor_it_cuts(files, tmp_path):
    """A file cut short fails on the first tensor whose data is missing, named, and says it is truncated."""
    data = files["Q8_0"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    last = list(GGUFFile(files["Q8_0"], "").tensors.values())[-1].name
    _error(cut, ["truncated", last])


def test_the_wrong_architecture_is_named(original, tmp_path):
    """A FLUX GGUF (general.architecture 'flux') is refused as such, before any tensor is compared."""
    path = write_gguf_transformer(original.state_dict(), tmp_path / "flux.gguf", "Q8_0", arch="flux")
    _error(path, ["'flux'", "FLUX transformer", "qwen_image21"])


def _patch_type(path, name: str, type_id: int, out) -> None:
    """Rewrite the GGML type id in tensor `name`'s info record (name, n_dims u32, dims u64 x n, type u32)."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    out.write_bytes(bytes(data))


def test_an_unknown_tensor_type_is_named(files, tmp_path):
    """A type id the gguf package does not know, and a known type it cannot dequantize (Q8_1 here: the same block
    size as Q8_0's bytes would not be), each name the tensor and the type."""
    name = "transformer_blocks.0.attn.to_q.weight"
    unknown = tmp_path / "unknown.gguf"
    _patch_type(files["Q8_0"], name, 250, unknown)
    _error(unknown, [name, "type 250"])
    undequantizable = tmp_path / "i32.gguf"
    # norms are F32 (4 bytes a value): as I32 the bytes fit, and gguf has no dequantizer for integers
    norm = "transformer_blocks.0.attn.norm_q.weight"
    _patch_type(files["Q8_0"], norm, 26, undequantizable)
    _error(undequantizable, [norm, "I32", "cannot dequantize"])


def test_a_misshaped_tensor_is_named(original, tmp_path):
    """A block weight of the wrong width fails with its file name and both shapes, before any weight is read."""
    state = dict(original.state_dict())
    key = "transformer_blocks.1.attn.to_k.weight"
    state[key] = state[key][:, :16]
    path = write_gguf_transformer(state, tmp_path / "misshaped.gguf", "Q8_0")
    _error(path, [key, "[32, 16]", "[32, 32]"])


def test_not_a_gguf_file(tmp_path):
    """Random bytes under a .gguf name, and a missing file: CheckpointErrors naming the file."""
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(os.urandom(4096))
    _error(noise, ["not a readable GGUF file"])
    _error(tmp_path / "absent.gguf", ["does not exist"])


def test_make_tiny_writes_gguf_files_the_cli_generates_from(tmp_path, tiny_folder, capsys):
    """`make-tiny --comfyui-models` writes the Q8_0 and Q4_0 transformers into diffusion_models/, with the bf16 file's
    weights within Q8_0's rounding, and `generate --transformer X.gguf` makes an image from it."""
    from PIL import Image

    from graph_runtime.cli import main

    models = tmp_path / "models"
    assert main(["make-tiny", "--comfyui-models", str(models)]) == 0
    printed = capsys.readouterr().out
    q8 = models / "diffusion_models" / "qwen_image_2.1-Q8_0.gguf"
    assert f"wrote transformer (GGUF Q8_0): {q8}" in printed and (q8.parent / "qwen_image_2.1-Q4_0.gguf").is_file()
    assert (models / "text_encoders" / "qwen3vl_8b-Q8_0.gguf").is_file()
    bf16 = load_transformer(models / "diffusion_models" / "qwen_image_2.1_bf16.safetensors", dtype=F32).state_dict()
    for key, value in load_transformer(q8, dtype=F32).state_dict().items():
        assert bool(((value - bf16[key]).abs() <= rounding_bound(bf16[key], "Q8_0") + 2.0 ** -8 * bf16[key].abs())
                    .all()), key  # Q8_0 of the fp32 weights, against their bf16 rounding: both roundings allowed
    out = tmp_path / "gguf.png"
    assert main(["generate", "--out", str(out), "--width", "64", "--height", "64", "--steps", "2",
                 "--transformer", str(q8), "--vae", str(models / "vae" / "qwen_image_2.1_vae_bf16.safetensors"),
                 "--text-encoder", str(models / "text_encoders" / "qwen3vl_8b_bf16.safetensors"),
                 "--tokenizer", str(tiny_folder)]) == 0
    assert Image.open(out).size == (64, 64)


def test_a_load_that_cannot_fit_in_host_memory_is_refused_first(files, monkeypatch):
    """With less host memory available than the dequantized weights need, the load is refused before any tensor is
    dequantized, naming the file, the need and what is available."""
    from graph_runtime.errors import KVGraphError
    from graph_runtime.loading import gguf_files, gguf_transformer

    monkeypatch.setattr(gguf_transformer, "host_available_bytes", lambda: 1000)
    read = []
    monkeypatch.setattr(gguf_files.GGUFFile, "read", lambda self, *a: read.append(a) or 1 / 0)
    with pytest.raises(KVGraphError) as excinfo:
        load_transformer(files["Q8_0"], dtype=F32)
    message = str(excinfo.value)
    assert str(files["Q8_0"]) in message and "host memory" in message and "0.00 GiB is available" in message
    assert read == []


def test_int8_while_reading_equals_int8_after_the_load(files):
    """Quantizing each block as soon as it is read gives exactly the int8 layers apply_precision makes from the whole
    float model (same quantizer, same bf16 inputs: bit-equal), and the other weights are the same."""
    from graph_runtime.fp8 import apply_precision
    from graph_runtime.quantized import ConvRotInt8Linear

    early = load_transformer(files["Q4_0"], dtype=BF16, gguf_int8_on="cpu")
    late = load_transformer(files["Q4_0"], dtype=BF16)
    apply_precision(late, "int8", device="cpu")
    ours = {n: m for n, m in early.named_modules() if isinstance(m, ConvRotInt8Linear)}
    theirs = {n: m for n, m in late.named_modules() if isinstance(m, ConvRotInt8Linear)}
    assert ours.keys() == theirs.keys() and len(ours) == 14
    for name, layer in ours.items():
        assert torch.equal(layer.weight, theirs[name].weight) and torch.equal(layer.weight_scale,
                                                                              theirs[name].weight_scale), name
    a, b = early.state_dict(), late.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_host_memory_check_prices_an_int8_load_at_the_int8_size(files):
    """Loaded int8 block by block, the weights are priced at one byte a block weight (plus the float tensors outside
    the blocks) and the extra peak grows by one block in the load dtype: less than the bf16 load's weights."""
    from graph_runtime.loading.gguf_transformer import load_bytes

    file = GGUFFile(files["Q8_0"], "")
    total = sum(int(np.prod(t.shape)) for t in file.tensors.values())
    blocks = sum(int(np.prod(t.shape)) for k, t in file.tensors.items() if k.startswith("transformer_blocks."))
    weights, peak = load_bytes(file, BF16)
    weights8, peak8 = load_bytes(file, BF16, int8=True)
    assert weights == 2 * total and weights8 == 2 * (total - blocks) + blocks and weights8 < weights
    assert peak < peak8 < peak + 2 * blocks
