"""A GGUF Qwen3-VL language tower (llama.cpp's names) with the vision tower from ComfyUI's safetensors file: the
language weights are the GGUF's own dequantized values, the vision weights the file's, and the encoder runs; a wrong
architecture, a foreign tensor or a missing vision file are named."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from graph_runtime.errors import CheckpointError
from graph_runtime.loading import load_text_encoder
from graph_runtime.loading.gguf_files import GGUFFile
from graph_runtime.loading.gguf_text_encoder import language_key
from graph_runtime.tiny import build_tiny_components, write_comfyui_files
from graph_runtime.tiny_gguf import write_gguf_language_tower

F32 = torch.float32


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-te")
    comfy = write_comfyui_files(root / "models")
    encoder = build_tiny_components(0)["text_encoder"]
    gguf = write_gguf_language_tower(encoder.state_dict(), root / "qwen3vl-tiny-Q8_0.gguf", "Q8_0")
    return gguf, comfy["text_encoder"], root


def test_language_from_gguf_vision_from_safetensors(files, tiny_folder):
    """Every language weight equals the GGUF's dequantized tensor (fp32: exact), every vision weight the
    safetensors file's (its bf16 values, exact in fp32), and a prompt encodes to finite hidden states close to the
    bf16 file's encoder within 5% relative (Q8_0 rounding moves it by about a percent: docs/quantized.md)."""
    gguf, vision, _ = files
    model, processor = load_text_encoder(gguf, dtype=F32, vision=vision, tokenizer_dir=tiny_folder)
    reference, _ = load_text_encoder(vision, dtype=F32, tokenizer_dir=tiny_folder)
    file = GGUFFile(gguf, "")
    state, ref_state = model.state_dict(), reference.state_dict()
    for name in file.tensors:
        assert torch.equal(state[language_key(name)], torch.from_numpy(file.dequantized(name).astype("float32")))
    vision_keys = [k for k in ref_state if k.startswith("model.visual.")]
    assert vision_keys and all(torch.equal(state[k], ref_state[k]) for k in vision_keys)
    ids = processor.tokenizer("a red kite over the sea", return_tensors="pt").input_ids
    ours = model.model.language_model(input_ids=ids).last_hidden_state
    theirs = reference.model.language_model(input_ids=ids).last_hidden_state
    assert torch.isfinite(ours).all()
    assert float((ours - theirs).norm() / theirs.norm()) < 0.05


def test_bad_pairs_are_named(files):
    """A GGUF of another architecture, a tensor Qwen3-VL does not have, and a GGUF without a vision file: each a
    CheckpointError naming the file and what is wrong."""
    gguf, vision, root = files
    from graph_runtime.tiny_gguf import write_gguf_language_tower as write

    encoder = build_tiny_components(0)["text_encoder"]
    llama = write(encoder.state_dict(), root / "llama.gguf", "Q8_0", arch="llama")
    with pytest.raises(CheckpointError, match="architecture 'llama'"):
        load_text_encoder(llama, vision=vision)
    with pytest.raises(CheckpointError, match="without its vision tower"):
        load_text_encoder(gguf)
    import gguf as gguf_package

    odd = root / "odd.gguf"
    writer = gguf_package.GGUFWriter(path=None, arch="qwen3vl")
    writer.add_tensor("blk.0.attn_qkv.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file(path=odd)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="blk.0.attn_qkv.weight"):
        load_text_encoder(odd, vision=vision)
