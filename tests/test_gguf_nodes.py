"""KV-Graph Load Transformer with ComfyUI-GGUF files (CPU, the small ComfyUI fake): its dropdown lists the .gguf files
of models/diffusion_models and models/unet, which ComfyUI itself leaves out, and a listed file loads."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401


@pytest.fixture
def gguf_files(comfy_env):
    """A Q8_0 file in diffusion_models/ and one in unet/ (a subfolder), removed afterwards: the models folder is
    shared by the process's node tests."""
    from graph_runtime.tiny import build_tiny_components
    from graph_runtime.tiny_gguf import write_gguf_transformer

    state = build_tiny_components(0)["transformer"].state_dict()
    paths = [write_gguf_transformer(state, comfy_env.models / "diffusion_models" / "tiny-Q8_0.gguf", "Q8_0"),
             write_gguf_transformer(state, comfy_env.models / "unet" / "city96" / "tiny-Q4_0.gguf", "Q4_0")]
    yield paths
    for path in paths:
        path.unlink()


def test_the_loader_lists_and_loads_gguf_files(comfy_env, gguf_files):
    """Both .gguf files are offered (unet's by its path inside unet/), once each; the listed name loads as float
    weights (the file's, not zeros)."""
    node = comfy_env.nodes["KVGraphLoadTransformer"]
    options = next(i for i in node.define_schema().inputs if i.id == "transformer_name").options
    assert "tiny-Q8_0.gguf" in options and "city96/tiny-Q4_0.gguf" in options
    assert len(options) == len(set(options))
    for name in ("tiny-Q8_0.gguf", "city96/tiny-Q4_0.gguf"):
        handle = node.execute(transformer_name=name, dtype="fp32", int8_weights="int8").args[0]
        weight = handle.module.transformer_blocks[0].attn.to_q.weight
        assert weight.dtype == torch.float32 and not (weight == 0).all()
    pack = importlib.import_module(f"{comfy_env.pack.__name__}.nodes.comfyui.model_files")
    listed = pack.gguf_choices("diffusion_models")
    assert {"city96/tiny-Q4_0.gguf", "tiny-Q8_0.gguf"} <= set(listed) and listed == sorted(listed)
    assert all(name.endswith(".gguf") for name in listed)


def test_the_text_encoder_loader_pairs_a_gguf_language_tower_with_the_vision_file(comfy_env):
    """A GGUF language tower in models/clip is listed by the text encoder loader and loads with the vision tower of
    ComfyUI's Qwen3-VL file in text_encoders (the bf16 one, preferred by name over the INT8 twin): its vision
    weights are that file's, its language weights the GGUF's."""
    from safetensors.torch import load_file

    from graph_runtime.loading.gguf_files import GGUFFile
    from graph_runtime.loading.gguf_text_encoder import language_key
    from graph_runtime.tiny import build_tiny_components
    from graph_runtime.tiny_gguf import write_gguf_language_tower

    path = write_gguf_language_tower(build_tiny_components(0)["text_encoder"].state_dict(),
                                     comfy_env.models / "clip" / "qwen3vl-tiny-Q8_0.gguf", "Q8_0")
    try:
        node = comfy_env.nodes["KVGraphLoadTextEncoder"]
        options = next(i for i in node.define_schema().inputs if i.id == "text_encoder_name").options
        assert "qwen3vl-tiny-Q8_0.gguf" in options
        handle = node.execute(text_encoder_name="qwen3vl-tiny-Q8_0.gguf", dtype="fp32",
                              text_encoder_placement="cpu").args[0]
        state = handle.module.state_dict()
        stored = load_file(comfy_env.models / "text_encoders" / "qwen3vl_8b_bf16.safetensors")
        visual = [k for k in stored if k.startswith("model.visual.")]
        assert visual and all(torch.equal(state[k], stored[k].float()) for k in visual)
        file = GGUFFile(path, "")
        for name in file.tensors:
            assert torch.equal(state[language_key(name)], torch.from_numpy(file.dequantized(name).astype("float32")))
    finally:
        path.unlink()
