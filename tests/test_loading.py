"""The model-loading layer: every supported layout of the tiny model loads to the same weights and outputs as the
original modules, the full-size configs are recovered from shapes alone, and every bad input fails with a
CheckpointError that names the file and what was expected."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any Hugging Face import: never call a hub

import json
import pickle
import random
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from graph_runtime.errors import CheckpointError
from graph_runtime.loading import (
    QwenImageModels,
    default_scheduler_config,
    detect_checkpoint,
    inspect_checkpoint,
    load_pipeline_folder,
    load_processor,
    load_text_encoder,
    load_transformer,
    load_vae,
    text_encoder_from_comfy_state_dict,
    text_encoder_to_comfy_state_dict,
    transformer_from_comfy_state_dict,
    transformer_to_comfy_state_dict,
    vae_from_comfy_state_dict,
    vae_to_comfy_state_dict,
)
from graph_runtime.loading import config_infer
from graph_runtime.loading.assemble import assign_weights, build_empty
from graph_runtime.tiny import (
    FIRST_SPECIAL_ID, QWEN_SPECIAL_TOKENS, build_tiny_components, build_tokenizer, write_comfyui_files,
    write_diffusers_folder,
)

F32 = torch.float32
BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def parts():
    """The in-memory originals every file below was written from (same seed)."""
    return build_tiny_components(0)


@pytest.fixture(scope="session")
def pipe_dir(tmp_path_factory):
    return write_diffusers_folder(tmp_path_factory.mktemp("pipe") / "tiny-qwen-image-2.1")


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    return write_comfyui_files(tmp_path_factory.mktemp("comfy") / "models")


@pytest.fixture(scope="session")
def bad_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


def _bf16_rounded(module):
    """A copy of `module` whose weights went through bf16 and back: what a bf16 file of it holds."""
    import copy

    clone = copy.deepcopy(module)
    with torch.no_grad():
        for p in clone.parameters():
            p.copy_(p.to(BF16).to(p.dtype))
    return clone


def _assert_same_weights(loaded, reference):
    got, want = loaded.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key].to(want[key].dtype), want[key]), key


def _transformer_out(model):
    g = torch.Generator().manual_seed(1)
    text, h, w = 5, 4, 4
    x = torch.randn(1, h * w, 64, generator=g)
    ctx = torch.randn(1, text, 64, generator=g)
    img_mask = torch.cat([torch.zeros(1, text, dtype=torch.bool), torch.ones(1, h * w // 4, dtype=torch.bool)], 1)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        return model(hidden_states=x.to(dtype), encoder_hidden_states=ctx.to(dtype), timestep=torch.tensor([0.5]),
                     img_shapes=[[(1, h, w)]], img_mask=img_mask).sample


def _vae_out(model):
    g = torch.Generator().manual_seed(2)
    image = torch.rand(1, 4, 1, 32, 32, generator=g) * 2 - 1
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        latent = model.encode(image.to(dtype)).latent_dist.mode()
        return latent, model.decode(latent).sample


def _text_out(model, processor):
    """Hidden states of a prompt with an image in it, so the vision tower and DeepStack mergers run too."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(3).rand(64, 64, 3) * 255).astype("uint8")
    inputs = processor(text=["<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>a red cube<|im_end|>\n"],
                       images=[Image.fromarray(pixels)], return_tensors="pt")
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True).hidden_states[-1]


def _assert_error(excinfo, path, *needles):
    message = str(excinfo.value)
    assert message.startswith(str(path)), message
    assert "Expected" in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"


# ------------------------------------------------------------------------------------------------- layout maps


def test_transformer_comfy_map_round_trips(parts):
    """transformer_from_comfy(transformer_to_comfy(sd)) == sd exactly; the ComfyUI side carries the
    `model.diffusion_model.` prefix and `img_mlp.gate_up` = [gate_layer; proj] (gate rows first)."""
    sd = parts["transformer"].state_dict()
    comfy = transformer_to_comfy_state_dict(sd)
    assert all(k.startswith("model.diffusion_model.") for k in comfy)
    fused = comfy["model.diffusion_model.transformer_blocks.0.img_mlp.gate_up.weight"]
    gate = sd["transformer_blocks.0.img_mlp.gate_layer.weight"]
    assert torch.equal(fused[: gate.shape[0]], gate)
    assert torch.equal(fused[gate.shape[0]:], sd["transformer_blocks.0.img_mlp.proj.weight"])
    assert not any("gate_layer" in k or "img_mlp.proj" in k for k in comfy)
    back = transformer_from_comfy_state_dict(comfy)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_vae_comfy_map_round_trips(parts):
    """vae_from_comfy(vae_to_comfy(sd)) == sd exactly; the ComfyUI side is the Wan-2.2 Sequential layout that
    ComfyUI's sd.py recognises as the Qwen-Image-2.1 VAE (decoder.head.2.weight 5-D with temporal kernel 1)."""
    sd = parts["vae"].state_dict()
    comfy = vae_to_comfy_state_dict(sd)
    assert "decoder.middle.0.residual.0.gamma" in comfy
    assert "decoder.upsamples.0.upsamples.0.residual.2.weight" in comfy
    head = comfy["decoder.head.2.weight"]
    assert head.dim() == 5 and head.shape[2] == 1
    # the 2-D resample convolutions and the attention 1x1s stay 4-D in ComfyUI too
    assert comfy["encoder.downsamples.0.downsamples.1.resample.1.weight"].dim() == 4
    assert comfy["decoder.middle.1.to_qkv.weight"].dim() == 4
    assert comfy["encoder.downsamples.1.downsamples.1.time_conv.weight"].shape[2:] == (1, 1, 1)
    back = vae_from_comfy_state_dict(comfy)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_text_encoder_comfy_map_round_trips(parts):
    """The ComfyUI text-encoder file uses transformers' Qwen3-VL names: the reverse map only drops a tied lm_head
    (stored once, as the embedding) and the forward map restores every other key unchanged. An untied lm_head is
    kept. ComfyUI's internal names (model.layers.*, visual.*) map onto the same keys."""
    sd = parts["text_encoder"].state_dict()
    comfy = text_encoder_to_comfy_state_dict(sd)
    assert "lm_head.weight" not in comfy
    back = text_encoder_from_comfy_state_dict(comfy)
    assert back.keys() == set(sd) - {"lm_head.weight"}
    assert all(torch.equal(back[k], sd[k]) for k in back)

    untied = dict(sd, **{"lm_head.weight": sd["lm_head.weight"].clone() + 1})
    assert "lm_head.weight" in text_encoder_to_comfy_state_dict(untied)

    internal = {}
    for k, v in comfy.items():
        k = k.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        internal[k] = v
    assert text_encoder_from_comfy_state_dict(internal).keys() == back.keys()


# ----------------------------------------------------------------------------------------------------- detection


def test_detect_checkpoint_names_each_file(pipe_dir, comfy):
    """detect_checkpoint tells the three ComfyUI files and the three diffusers weight files apart from their
    headers alone."""
    assert detect_checkpoint(comfy["transformer"]) == "qwen-image-2.1-transformer"
    assert detect_checkpoint(comfy["vae"]) == "qwen-image-2.1-vae"
    assert detect_checkpoint(comfy["text_encoder"]) == "qwen3vl-text-encoder"
    assert inspect_checkpoint(comfy["transformer"]).layout == "comfyui"
    assert detect_checkpoint(pipe_dir / "transformer" / "diffusion_pytorch_model.safetensors") == \
        "qwen-image-2.1-transformer"
    assert detect_checkpoint(pipe_dir / "vae" / "diffusion_pytorch_model.safetensors") == "qwen-image-2.1-vae"
    assert detect_checkpoint(pipe_dir / "text_encoder" / "model.safetensors") == "qwen3vl-text-encoder"


# ---------------------------------------------------------------------------------------------- transformer


@pytest.mark.parametrize("where", ["pipeline", "subfolder", "diffusers_file"])
def test_transformer_loads_exactly_from_diffusers_layouts(where, parts, pipe_dir):
    """From the pipeline folder, its transformer/ folder, or the bare diffusers weight file, the loaded fp32
    transformer has the original tensors and gives the original's output bit for bit."""
    path = {"pipeline": pipe_dir, "subfolder": pipe_dir / "transformer",
            "diffusers_file": pipe_dir / "transformer" / "diffusion_pytorch_model.safetensors"}[where]
    model = load_transformer(path, dtype=F32)
    _assert_same_weights(model, parts["transformer"])
    assert torch.equal(_transformer_out(model), _transformer_out(parts["transformer"].eval()))
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_transformer_comfy_file_infers_config_and_matches_bf16_original(parts, comfy):
    """The ComfyUI bf16 file carries no config: every config value is recovered from shapes (RoPE axes by the
    head-dim rule), and in fp32 the model equals the original rounded to bf16 (the file's precision), outputs
    included."""
    model = load_transformer(comfy["transformer"], dtype=F32)
    for key, value in parts["transformer"].config.items():
        if not key.startswith("_"):
            assert tuple(model.config[key]) == tuple(value) if isinstance(value, (list, tuple)) \
                else model.config[key] == value, key
    reference = _bf16_rounded(parts["transformer"]).eval()
    _assert_same_weights(model, reference)
    assert torch.equal(_transformer_out(model), _transformer_out(reference))


def test_transformer_matches_diffusers_from_pretrained_in_bf16(pipe_dir):
    """Loaded in bf16 our transformer equals diffusers' own from_pretrained(torch_dtype=bf16): weights, buffers
    and output."""
    from diffusers import QwenImage21Transformer2DModel

    ours = load_transformer(pipe_dir, dtype=BF16)
    theirs = QwenImage21Transformer2DModel.from_pretrained(pipe_dir, subfolder="transformer", torch_dtype=BF16)
    _assert_same_weights(ours, theirs)
    assert torch.equal(_transformer_out(ours), _transformer_out(theirs.eval()))


# ------------------------------------------------------------------------------------------------------------ VAE


@pytest.mark.parametrize("where", ["pipeline", "subfolder"])
def test_vae_loads_exactly_from_diffusers_layouts(where, parts, pipe_dir):
    """From the pipeline folder or its vae/ folder the fp32 VAE has the original tensors, encodes and decodes
    bit for bit like the original."""
    model = load_vae(pipe_dir if where == "pipeline" else pipe_dir / "vae", dtype=F32)
    _assert_same_weights(model, parts["vae"])
    for got, want in zip(_vae_out(model), _vae_out(parts["vae"].eval())):
        assert torch.equal(got, want)


def test_vae_comfy_file_infers_config_and_matches_bf16_original(parts, comfy):
    """ComfyUI's VAE file: config (base/decoder dims, z_dim, dim_mult, res blocks, temporal downsampling, RGBA
    channels) inferred from shapes equals the original's; weights and outputs equal the bf16-rounded original."""
    model = load_vae(comfy["vae"], dtype=F32)
    for key, value in parts["vae"].config.items():
        if not key.startswith("_"):
            assert model.config[key] == value, key
    reference = _bf16_rounded(parts["vae"]).eval()
    _assert_same_weights(model, reference)
    for got, want in zip(_vae_out(model), _vae_out(reference)):
        assert torch.equal(got, want)


def test_vae_matches_diffusers_from_pretrained_in_bf16(pipe_dir):
    """Loaded in bf16 our VAE equals diffusers' own from_pretrained(torch_dtype=bf16), outputs included."""
    from diffusers import AutoencoderKLQwenImage21

    ours = load_vae(pipe_dir, dtype=BF16)
    theirs = AutoencoderKLQwenImage21.from_pretrained(pipe_dir, subfolder="vae", torch_dtype=BF16).eval()
    _assert_same_weights(ours, theirs)
    for got, want in zip(_vae_out(ours), _vae_out(theirs)):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------------- text encoder


@pytest.mark.parametrize("where", ["pipeline", "subfolder"])
def test_text_encoder_loads_exactly_from_diffusers_layouts(where, parts, pipe_dir):
    """From the pipeline folder or its text_encoder/ folder: original tensors, lm_head tied to the embeddings as in
    the original, a processor found in the pipeline, and hidden states (text + image) equal bit for bit."""
    model, processor = load_text_encoder(pipe_dir if where == "pipeline" else pipe_dir / "text_encoder", dtype=F32)
    _assert_same_weights(model, parts["text_encoder"])
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    assert torch.equal(_text_out(model, processor), _text_out(parts["text_encoder"].eval(), parts["processor"]))


def test_text_encoder_comfy_file_infers_config_and_matches_bf16_original(parts, comfy, pipe_dir):
    """ComfyUI's text-encoder file (no lm_head: tied) with the pipeline's tokenizer: the inferred Qwen3-VL config
    matches the tiny config on every value the model uses (mrope_section [2, 3, 3] from head_dim 16, vision heads,
    DeepStack taps), and outputs equal the bf16-rounded original's."""
    model, processor = load_text_encoder(comfy["text_encoder"], dtype=F32, tokenizer_dir=pipe_dir)
    want, got = parts["text_encoder"].config, model.config
    for sub in ("text_config", "vision_config"):
        a, b = getattr(got, sub).to_dict(), getattr(want, sub).to_dict()
        differing = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
        # RoPE is computed on the fly, so the position limit does not change any output
        assert differing <= {"max_position_embeddings"}, (sub, differing)
    assert got.tie_word_embeddings
    reference = _bf16_rounded(parts["text_encoder"]).eval()
    _assert_same_weights(model, reference)
    assert torch.equal(_text_out(model, processor), _text_out(reference, parts["processor"]))


def test_text_encoder_matches_transformers_from_pretrained_in_bf16(pipe_dir):
    """Loaded in bf16 our text encoder equals transformers' own from_pretrained(dtype=bf16), outputs included."""
    from transformers import Qwen3VLForConditionalGeneration

    ours, processor = load_text_encoder(pipe_dir, dtype=BF16)
    theirs = Qwen3VLForConditionalGeneration.from_pretrained(pipe_dir / "text_encoder", dtype=BF16).eval()
    _assert_same_weights(ours, theirs)
    assert torch.equal(_text_out(ours, processor), _text_out(theirs, processor))


# ---------------------------------------------------------------------------------------- comfy files vs folder


def test_comfy_files_equal_diffusers_folder(pipe_dir, comfy):
    """The ComfyUI files and the diffusers folder hold the same model. In bf16 the loaded weights are identical:
    rounding the folder's fp32 weights to bf16 is exactly what wrote the bf16 files. In fp32 they differ by that
    rounding only: at most 2^-8 relative (bf16 keeps 8 significant bits)."""
    pairs = [
        (load_transformer(comfy["transformer"], dtype=BF16), load_transformer(pipe_dir, dtype=BF16)),
        (load_vae(comfy["vae"], dtype=BF16), load_vae(pipe_dir, dtype=BF16)),
        (load_text_encoder(comfy["text_encoder"], dtype=BF16, tokenizer_dir=pipe_dir)[0],
         load_text_encoder(pipe_dir, dtype=BF16)[0]),
    ]
    for from_comfy, from_folder in pairs:
        _assert_same_weights(from_comfy, from_folder)
    single, folder = load_transformer(comfy["transformer"], dtype=F32), load_transformer(pipe_dir, dtype=F32)
    for key, value in folder.state_dict().items():
        torch.testing.assert_close(single.state_dict()[key], value, rtol=2 ** -8, atol=0)


# -------------------------------------------------------------------------------------------- config inference


def test_shape_rules_reproduce_released_and_tiny_values():
    """The rules for values no tensor determines give the released models' values and the tiny model's."""
    assert config_infer.rope_axes_for_head_dim(128) == (16, 56, 56)
    assert config_infer.rope_axes_for_head_dim(16) == (4, 6, 6)
    assert config_infer.mrope_section_for_head_dim(128) == [24, 20, 20]
    assert config_infer.mrope_section_for_head_dim(16) == [2, 3, 3]
    assert config_infer.vision_heads_for_hidden(1152) == 16 and config_infer.vision_heads_for_hidden(32) == 2
    assert config_infer.deepstack_indexes(27, 3) == [8, 16, 24] and config_infer.deepstack_indexes(1, 1) == [0]


def test_full_size_configs_are_recovered_from_shapes():
    """Built on the meta device (no memory), the full 7B transformer, the released VAE and Qwen3-VL-8B, written in
    ComfyUI's layout, infer back to their exact configs: the same code path loads the tiny and the full models."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    dit = build_empty(lambda: QwenImage21Transformer2DModel())
    assert all(p.device.type == "meta" for p in dit.parameters())
    shapes = {k: tuple(v.shape) for k, v in
              transformer_from_comfy_state_dict(transformer_to_comfy_state_dict(dit.state_dict())).items()}
    inferred = config_infer.infer_transformer_config(shapes, "x", "y")
    assert {k: (tuple(v) if isinstance(v, tuple) else v) for k, v in inferred.items()} == \
        {k: (tuple(dit.config[k]) if isinstance(dit.config[k], (list, tuple)) else dit.config[k]) for k in inferred}

    vae = build_empty(lambda: AutoencoderKLQwenImage21())
    shapes = {k: tuple(v.shape) for k, v in vae_from_comfy_state_dict(vae_to_comfy_state_dict(vae.state_dict())).items()}
    inferred = config_infer.infer_vae_config(shapes, "x", "y")
    assert inferred == {k: vae.config[k] for k in inferred}

    real = Qwen3VLConfig(
        text_config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2),
        tie_word_embeddings=False)
    encoder = build_empty(lambda: Qwen3VLForConditionalGeneration(real))
    shapes = {k: tuple(v.shape) for k, v in text_encoder_from_comfy_state_dict(
        text_encoder_to_comfy_state_dict(encoder.state_dict())).items()}
    inferred = config_infer.infer_text_encoder_config(shapes, "x", "y")
    assert inferred.text_config.to_dict() == real.text_config.to_dict()
    assert inferred.vision_config.to_dict() == real.vision_config.to_dict()
    assert inferred.tie_word_embeddings is False


def test_empty_construction_is_confined_to_its_thread():
    """While one thread builds a model on `meta`, a module built on another thread gets real parameters."""
    import threading

    from graph_runtime.loading.assemble import empty_parameters

    built = {}
    with empty_parameters():
        inside = torch.nn.Linear(2, 2)
        worker = threading.Thread(target=lambda: built.setdefault("other", torch.nn.Linear(2, 2)))
        worker.start()
        worker.join()
    assert inside.weight.device.type == "meta"
    assert built["other"].weight.device.type == "cpu"
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_weights_are_assigned_not_copied():
    """Loading assigns the read tensors as the parameters (no second copy of the model in memory)."""
    layer = build_empty(lambda: torch.nn.Linear(4, 3))
    weight, bias = torch.randn(3, 4), torch.randn(3)
    assign_weights(layer, {"weight": weight, "bias": bias})
    assert layer.weight.data_ptr() == weight.data_ptr() and layer.bias.data_ptr() == bias.data_ptr()


# ------------------------------------------------------------------------------------------------ folders, processor


def test_load_pipeline_folder_loads_components_and_scheduler(parts, pipe_dir, tmp_path):
    """load_pipeline_folder returns every component with its absolute source and the folder's scheduler config;
    a subset leaves the rest None; a folder without scheduler/ gets default_scheduler_config(), which is the
    tiny scheduler's configuration."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    models = load_pipeline_folder(pipe_dir, dtype=F32)
    assert isinstance(models, QwenImageModels)
    _assert_same_weights(models.transformer, parts["transformer"])
    _assert_same_weights(models.vae, parts["vae"])
    _assert_same_weights(models.text_encoder, parts["text_encoder"])
    assert models.processor is not None
    saved = json.loads((pipe_dir / "scheduler" / "scheduler_config.json").read_text())
    assert models.scheduler_config == saved
    for name in ("transformer", "vae", "text_encoder", "processor"):
        assert models.sources[name] == str((pipe_dir / name).resolve())

    only_vae = load_pipeline_folder(pipe_dir, dtype=F32, components=("vae",))
    assert only_vae.vae is not None and only_vae.transformer is None and only_vae.text_encoder is None
    assert set(only_vae.sources) == {"vae", "scheduler"}

    no_scheduler = tmp_path / "no-scheduler"
    shutil.copytree(pipe_dir, no_scheduler, ignore=shutil.ignore_patterns("scheduler", "text_encoder"))
    assert load_pipeline_folder(no_scheduler, components=("vae",)).scheduler_config == default_scheduler_config()
    rebuilt = FlowMatchEulerDiscreteScheduler.from_config(default_scheduler_config()).config
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    assert public(rebuilt) == public(parts["scheduler"].config)


def _comfyui_style_tokenizer(folder):
    """vocab.json + merges.txt + tokenizer_config.json with the special tokens, as ComfyUI's qwen25_tokenizer."""
    tokenizer = build_tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.model.save(str(folder))
    added = {str(FIRST_SPECIAL_ID + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                         "normalized": False, "single_word": False}
             for i, t in enumerate(QWEN_SPECIAL_TOKENS)}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None, "model_max_length": 131072,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))
    return tokenizer


def test_processor_from_comfyui_style_tokenizer_folder(parts, tmp_path):
    """A bare vocab.json/merges.txt tokenizer folder becomes a Qwen3VLProcessor that tokenizes like the tiny
    processor and renders the system turn as the Qwen-Image pipeline expects (its own text-only template is
    replaced)."""
    folder = tmp_path / "qwen25_tokenizer"
    _comfyui_style_tokenizer(folder)
    processor = load_processor(folder)
    text = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n<|im_start|>user\nA cat"
    assert processor.tokenizer(text).input_ids == parts["processor"].tokenizer(text).input_ids
    system = [{"role": "system", "content": [{"type": "text", "text": "hi"}]}]
    assert processor.apply_chat_template(system, tokenize=False) == "<|im_start|>system\nhi<|im_end|>\n"


def test_comfyui_bundled_tokenizer_when_available():
    """With COMFYUI_DIR set, ComfyUI's own qwen25_tokenizer folder loads as a Qwen3-VL processor."""
    root = os.environ.get("COMFYUI_DIR")
    if not root:
        pytest.skip("COMFYUI_DIR is not set: ComfyUI's bundled tokenizer is not available")
    processor = load_processor(os.path.join(root, "comfy", "text_encoders", "qwen25_tokenizer"))
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655


def test_text_encoder_single_file_finds_tokenizer_next_to_it(comfy, tmp_path):
    """Without tokenizer_dir, a tokenizer folder beside the file is used."""
    folder = tmp_path / "te"
    shutil.copytree(comfy["text_encoder"].parent, folder)
    _comfyui_style_tokenizer(folder / "tokenizer")
    _, processor = load_text_encoder(folder / comfy["text_encoder"].name, dtype=F32)
    assert processor.tokenizer.convert_tokens_to_ids("<|im_start|>") == 151644


# ---------------------------------------------------------------------------------------------------- bad inputs


def _write(path, tensors, metadata=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.zeros(s) for k, s in tensors.items()} if isinstance(next(iter(tensors.values())), tuple)
              else tensors, str(path), metadata=metadata)
    return path


QWEN_IMAGE_1X = {
    "model.diffusion_model.img_in.weight": (8, 64), "model.diffusion_model.txt_in.weight": (8, 16),
    "model.diffusion_model.txt_norm.weight": (16,), "model.diffusion_model.proj_out.weight": (64, 8),
    "model.diffusion_model.transformer_blocks.0.img_mod.1.weight": (48, 8),
    "model.diffusion_model.transformer_blocks.0.txt_mod.1.weight": (48, 8),
    "model.diffusion_model.transformer_blocks.0.attn.norm_added_q.weight": (4,),
    "model.diffusion_model.transformer_blocks.0.attn.add_q_proj.weight": (8, 8),
}
SDXL_UNET = {
    "model.diffusion_model.input_blocks.0.0.weight": (8, 4, 3, 3), "model.diffusion_model.label_emb.0.0.weight": (8, 16),
    "model.diffusion_model.out.2.weight": (4, 8, 3, 3),
}
WAN21_VAE = {  # Qwen-Image 1.x / Wan 2.1 VAE in ComfyUI's layout: z_dim 16, 3-frame causal convs
    "encoder.conv1.weight": (8, 3, 3, 3, 3), "decoder.conv1.weight": (8, 16, 3, 3, 3),
    "decoder.middle.0.residual.0.gamma": (8, 1, 1, 1), "decoder.head.2.weight": (3, 8, 3, 3, 3),
    "conv2.weight": (16, 16, 1, 1, 1),
}
SD_VAE = {"decoder.conv_in.weight": (8, 4, 3, 3), "decoder.up.0.block.0.conv1.weight": (8, 8, 3, 3),
          "encoder.down.0.block.0.conv1.weight": (8, 8, 3, 3)}
QWEN25_VL = {"model.layers.0.self_attn.k_proj.bias": (4,), "model.layers.0.self_attn.q_proj.weight": (8, 8),
             "visual.blocks.0.attn.qkv.weight": (24, 8)}


@pytest.mark.parametrize("case, loader, needles", [
    ("qwen_image_1x", load_transformer, ["Qwen-Image 1.x transformer", "Qwen-Image-2.1 transformer"]),
    ("sdxl_unet", load_transformer, ["SDXL UNet", "qwen_image_2.1_bf16.safetensors"]),
    ("wan21_vae", load_vae, ["Wan 2.1 / Qwen-Image 1.x VAE", "Qwen-Image-2.1 VAE"]),
    ("sd_vae", load_vae, ["Stable Diffusion", "qwen_image_2.1_vae_bf16.safetensors"]),
    ("qwen25_vl", load_text_encoder, ["Qwen2.5-VL", "qwen3vl_8b_bf16.safetensors"]),
])
def test_other_models_are_refused_by_name(case, loader, needles, bad_dir):
    """A checkpoint of another model is named as such, with what the loader expected."""
    tensors = {"qwen_image_1x": QWEN_IMAGE_1X, "sdxl_unet": SDXL_UNET, "wan21_vae": WAN21_VAE, "sd_vae": SD_VAE,
               "qwen25_vl": QWEN25_VL}[case]
    path = _write(bad_dir / f"{case}.safetensors", tensors)
    assert detect_checkpoint(path) == {"qwen_image_1x": "qwen-image-1.x-transformer", "sdxl_unet": "sdxl-unet",
                                       "wan21_vae": "wan-vae", "sd_vae": "sd-vae",
                                       "qwen25_vl": "qwen2.5vl-text-encoder"}[case]
    with pytest.raises(CheckpointError) as excinfo:
        loader(path)
    _assert_error(excinfo, path, *needles)


@pytest.mark.parametrize("component, loader, needles", [
    ("vae", load_transformer, ["the Qwen-Image-2.1 VAE, not a Qwen-Image-2.1 transformer"]),
    ("transformer", load_vae, ["Qwen-Image-2.1 transformer", "not the Qwen-Image-2.1 VAE"]),
    ("transformer", load_text_encoder, ["not a Qwen3-VL text encoder"]),
    ("text_encoder", load_transformer, ["a Qwen3-VL text encoder, not a Qwen-Image-2.1 transformer"]),
])
def test_qwen_image_21_file_given_to_the_wrong_loader(component, loader, needles, comfy):
    """A Qwen-Image-2.1 file of another component is refused naming what it is and what was expected."""
    with pytest.raises(CheckpointError) as excinfo:
        loader(comfy[component])
    _assert_error(excinfo, comfy[component], *needles)


def test_non_safetensors_files_are_refused(bad_dir):
    """A torch.save zip (.ckpt/.pt), a raw pickle, random bytes, an empty file: each a CheckpointError saying it
    is not a safetensors file."""
    zipped = bad_dir / "model.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, zipped)
    pickled = bad_dir / "legacy.safetensors"
    pickled.write_bytes(pickle.dumps({"w": [0.0, 1.0]}, protocol=2))
    noise = bad_dir / "noise.safetensors"
    noise.write_bytes(random.Random(0).randbytes(4096))
    empty = bad_dir / "empty.safetensors"
    empty.write_bytes(b"")
    for path, needle in [(zipped, "zip archive"), (pickled, "pickle"), (noise, "not a safetensors file"),
                         (empty, "not a safetensors file")]:
        with pytest.raises(CheckpointError) as excinfo:
            load_transformer(path)
        _assert_error(excinfo, path, needle, "Qwen-Image-2.1 transformer")


def test_truncated_files_are_refused(comfy, bad_dir):
    """A file cut inside its header, or whose tensor data is shorter than the header says, is reported as
    truncated (for every loader, and by detect_checkpoint)."""
    for component, loader in [("transformer", load_transformer), ("vae", load_vae)]:
        data_cut = bad_dir / f"data_cut_{component}.safetensors"
        shutil.copy(comfy[component], data_cut)
        with open(data_cut, "r+b") as f:
            f.truncate(data_cut.stat().st_size - 100)
        with pytest.raises(CheckpointError) as excinfo:
            loader(data_cut)
        _assert_error(excinfo, data_cut, "is truncated", "tensor data")

    header_cut = bad_dir / "header_cut.safetensors"
    shutil.copy(comfy["transformer"], header_cut)
    (header_len,) = struct.unpack("<Q", header_cut.read_bytes()[:8])
    with open(header_cut, "r+b") as f:
        f.truncate(8 + header_len // 2)
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(header_cut)
    _assert_error(excinfo, header_cut, "is truncated", "header")
    with pytest.raises(CheckpointError):
        detect_checkpoint(header_cut)


def test_missing_files_and_folders_are_refused(pipe_dir, bad_dir):
    """A path that does not exist, a folder that is no model folder, a pipeline folder lacking the component,
    and a text encoder without any tokenizer each raise CheckpointError naming the path."""
    missing = bad_dir / "nowhere" / "qwen_image_2.1_bf16.safetensors"
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(missing)
    _assert_error(excinfo, missing, "does not exist")

    empty_dir = bad_dir / "empty_folder"
    empty_dir.mkdir()
    with pytest.raises(CheckpointError) as excinfo:
        load_vae(empty_dir)
    _assert_error(excinfo, empty_dir, "without config.json or model_index.json")

    partial = bad_dir / "partial_pipeline"
    partial.mkdir()
    shutil.copy(pipe_dir / "model_index.json", partial / "model_index.json")
    with pytest.raises(CheckpointError) as excinfo:
        load_vae(partial)
    _assert_error(excinfo, partial, "without a vae/ subfolder")
    with pytest.raises(CheckpointError) as excinfo:
        load_pipeline_folder(bad_dir / "no_pipeline")
    _assert_error(excinfo, bad_dir / "no_pipeline", "does not exist")


def test_text_encoder_without_tokenizer_lists_accepted_folders(comfy, bad_dir):
    """A single-file text encoder with no tokenizer given or beside it, or a tokenizer without Qwen's special
    tokens, fails saying which tokenizer folders are accepted."""
    with pytest.raises(CheckpointError) as excinfo:
        load_text_encoder(comfy["text_encoder"])
    _assert_error(excinfo, comfy["text_encoder"], "without a tokenizer", "qwen25_tokenizer")

    from tokenizers import Tokenizer, models, pre_tokenizers

    other = bad_dir / "gpt_tokenizer"
    other.mkdir()
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.save(str(other / "tokenizer.json"))
    with pytest.raises(CheckpointError) as excinfo:
        load_text_encoder(comfy["text_encoder"], tokenizer_dir=other)
    _assert_error(excinfo, other, "special tokens", "qwen25_tokenizer")


def test_previous_generation_folders_are_refused(pipe_dir, bad_dir):
    """A Qwen-Image 1.x pipeline folder, and a transformer/ folder whose config names the 1.x class, are refused by
    name before any weight is read."""
    old = bad_dir / "qwen_image_1x_pipeline"
    shutil.copytree(pipe_dir, old, ignore=shutil.ignore_patterns("text_encoder", "vae", "processor"))
    index = json.loads((old / "model_index.json").read_text())
    (old / "model_index.json").write_text(json.dumps(dict(index, _class_name="QwenImagePipeline")))
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(old)
    _assert_error(excinfo, old, "Qwen-Image 1.x pipeline folder")

    config = json.loads((old / "transformer" / "config.json").read_text())
    (old / "transformer" / "config.json").write_text(json.dumps(dict(config,
                                                                     _class_name="QwenImageTransformer2DModel")))
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(old / "transformer")
    _assert_error(excinfo, old / "transformer", "Qwen-Image 1.x transformer")


@pytest.mark.parametrize("component, loader, drop, misshape", [
    ("transformer", load_transformer, "model.diffusion_model.transformer_blocks.1.attn.to_k.weight",
     "model.diffusion_model.transformer_blocks.1.img_mlp.gate_up.weight"),
    ("vae", load_vae, "decoder.upsamples.2.upsamples.1.residual.6.bias", "decoder.middle.1.proj.weight"),
    ("text_encoder", load_text_encoder, "model.language_model.layers.1.self_attn.k_proj.weight",
     "model.visual.merger.linear_fc1.bias"),
])
def test_missing_and_misshaped_tensors_are_named(component, loader, drop, misshape, comfy, pipe_dir, bad_dir):
    """A file missing a tensor, or holding one of the wrong shape, fails naming that tensor in the file's own
    (ComfyUI) key names, with both shapes for a mis-shaped one."""
    tensors = load_file(str(comfy[component]))
    kwargs = {"tokenizer_dir": pipe_dir} if component == "text_encoder" else {}

    without = dict(tensors)
    del without[drop]
    missing_path = _write(bad_dir / f"missing_{component}.safetensors", without)
    with pytest.raises(CheckpointError) as excinfo:
        loader(missing_path, **kwargs)
    _assert_error(excinfo, missing_path, "missing 1 tensor", drop)

    wrong = dict(tensors)
    shape = list(wrong[misshape].shape)
    shape[0] += 2
    wrong[misshape] = torch.zeros(shape, dtype=wrong[misshape].dtype)
    misshaped_path = _write(bad_dir / f"misshaped_{component}.safetensors", wrong)
    with pytest.raises(CheckpointError) as excinfo:
        loader(misshaped_path, **kwargs)
    _assert_error(excinfo, misshaped_path, "wrong shape", misshape)


def test_int8_convrot_layer_is_recognised_and_loaded(comfy, bad_dir):
    """A file with one ComfyUI int8_convrot layer (int8 weight + .weight_scale + .comfy_quant) is recognised as the
    right model, its format is reported, and it loads with that layer int8 (tests/test_int8_convrot.py covers the
    format in full)."""
    from graph_runtime.quantized import ConvRotInt8Linear

    tensors = load_file(str(comfy["transformer"]))
    key = "model.diffusion_model.transformer_blocks.0.attn.to_q.weight"
    tensors[key] = torch.zeros_like(tensors[key], dtype=torch.int8)
    tensors[key.replace(".weight", ".weight_scale")] = torch.ones(tensors[key].shape[0], 1)
    quant = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16}).encode()
    tensors[key.replace(".weight", ".comfy_quant")] = torch.tensor(list(quant), dtype=torch.uint8)
    path = _write(bad_dir / "qwen_image_2.1_int8_convrot.safetensors", tensors)
    info = inspect_checkpoint(path)
    assert info.kind == "qwen-image-2.1-transformer" and info.quantized == "int8 ConvRot (group 16)"
    model = load_transformer(path)
    assert isinstance(model.transformer_blocks[0].attn.to_q, ConvRotInt8Linear)
    assert not bool(model.transformer_blocks[0].attn.to_q.weight.any())


@pytest.mark.parametrize("component, loader, drop", [
    ("transformer", load_transformer, "model.diffusion_model.transformer_blocks.0.attn.norm_q.weight"),
    ("vae", load_vae, "decoder.head.2.weight"),
])
def test_damaged_file_missing_a_signature_tensor_is_still_named_as_damaged(component, loader, drop, comfy, bad_dir):
    """Losing one of the tensors detection keys on does not turn a damaged Qwen-Image-2.1 file into an "unknown
    model" (or a Wan 2.2 VAE): it is still recognised, and the error names the missing tensor."""
    tensors = load_file(str(comfy[component]))
    del tensors[drop]
    path = _write(bad_dir / f"damaged_{component}.safetensors", tensors)
    assert detect_checkpoint(path) == inspect_checkpoint(comfy[component]).kind
    with pytest.raises(CheckpointError) as excinfo:
        loader(path)
    _assert_error(excinfo, path, drop)


def test_unrecognised_file_lists_its_first_tensor_names(bad_dir):
    """A safetensors file of no known model says so and shows its first tensor names."""
    path = _write(bad_dir / "mystery.safetensors", {"alpha.weight": (2, 2), "beta.bias": (2,)})
    assert detect_checkpoint(path) == "unknown"
    with pytest.raises(CheckpointError) as excinfo:
        load_vae(path)
    _assert_error(excinfo, path, "does not look like the Qwen-Image-2.1 VAE", "alpha.weight")


# ------------------------------------------------------------------------------ damaged headers, dtypes and configs


def _header_and_data(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _rewrite(path, header, data):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


def _damaged_headers(header):
    """(case, header) pairs, each a copy of a valid VAE header with one thing broken."""
    names = sorted(k for k in header if k != "__metadata__")
    first, second = header[names[0]], header[names[1]]
    overlap = json.loads(json.dumps(header))
    length = second["data_offsets"][1] - second["data_offsets"][0]
    overlap[names[1]]["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + length]
    unknown = json.loads(json.dumps(header))
    unknown[names[0]]["dtype"] = "X9"
    listed = dict(header, __metadata__=["format", "pt"])
    numbers = dict(header, __metadata__={"format": 1})
    return [("overlap", overlap), ("unknown dtype", unknown), ("metadata list", listed), ("metadata number", numbers)]


@pytest.mark.parametrize("case, needle", [
    ("overlap", "data_offsets for tensor"), ("unknown dtype", "as 'X9', a dtype KV-Graph does not read"),
    ("metadata list", "__metadata__ entry that is not a JSON object of strings"),
    ("metadata number", "__metadata__ entry that is not a JSON object of strings"),
])
def test_damaged_headers_are_checkpoint_errors_naming_the_file(comfy, bad_dir, case, needle):
    """Before: safetensors' own "invalid offset"/"unknown variant" errors, or a ValueError from dict() for a list
    __metadata__, none naming the file. Each is now a CheckpointError that does."""
    header, data = _header_and_data(comfy["vae"])
    path = _rewrite(bad_dir / f"damaged-{case.replace(' ', '-')}.safetensors", dict(_damaged_headers(header))[case],
                    data)
    with pytest.raises(CheckpointError) as excinfo:
        load_vae(path)
    _assert_error(excinfo, path, needle)


def test_bytes_after_the_tensor_data_are_a_damaged_file(comfy, bad_dir):
    """safetensors refuses a file its header does not cover to the end ("incomplete metadata"); so does the
    header check, by name."""
    path = bad_dir / "trailing.safetensors"
    path.write_bytes(comfy["vae"].read_bytes() + b"\0" * 16)
    with pytest.raises(CheckpointError) as excinfo:
        load_vae(path)
    _assert_error(excinfo, path, "has 16 bytes after the")


@pytest.mark.parametrize("dtype, name", [(torch.int64, "I64"), (torch.bool, "BOOL")])
@pytest.mark.parametrize("component, loader", [("vae", load_vae), ("transformer", load_transformer)])
def test_integer_or_bool_weights_are_refused_by_name(comfy, bad_dir, dtype, name, component, loader):
    """Before: a 27-line `load_state_dict` RuntimeError. Now one line naming the file, the tensor and its dtype."""
    tensors = load_file(comfy[component])
    key = sorted(k for k, v in tensors.items() if v.dim() >= 2)[0]
    tensors[key] = tensors[key].to(dtype)
    path = _write(bad_dir / f"{component}-{name}.safetensors", tensors)
    with pytest.raises(CheckpointError) as excinfo:
        loader(path)
    _assert_error(excinfo, path, f"{key} ({name})", "floating-point weights")
    assert "\n" not in str(excinfo.value)


@pytest.fixture(scope="module")
def int8_file(tmp_path_factory):
    from graph_runtime.tiny import write_comfyui_int8_files

    return write_comfyui_int8_files(tmp_path_factory.mktemp("int8") / "models")["transformer"]


def test_a_deeply_nested_quantization_record_is_a_checkpoint_error(int8_file, bad_dir):
    """Before: RecursionError from Python's JSON parser."""
    tensors = load_file(int8_file)
    key = sorted(k for k in tensors if k.endswith(".comfy_quant"))[0]
    tensors[key] = torch.tensor(list(b"[" * 100_000 + b"]" * 100_000), dtype=torch.uint8)
    path = _write(bad_dir / "nested-record.safetensors", tensors)
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(path)
    _assert_error(excinfo, path, f"{key} that is not a JSON quantization record")


@pytest.mark.parametrize("fill, needle", [(0.0, "all-zero scales in"), (float("nan"), "NaN or infinite values in")])
def test_int8_scales_that_zero_or_poison_a_layer_are_refused(int8_file, bad_dir, fill, needle):
    """Before: all-zero scales loaded (every weight of the layer 0) and NaN scales loaded (NaN output). Both are
    refused naming the file and the scale's key, in either int8 mode."""
    tensors = load_file(int8_file)
    key = sorted(k for k in tensors if k.endswith(".weight_scale"))[-1]
    tensors[key] = torch.full_like(tensors[key], fill)
    path = _write(bad_dir / f"scales-{fill}.safetensors", tensors)
    for mode in ("int8", "dequantize"):
        with pytest.raises(CheckpointError) as excinfo:
            load_transformer(path, dtype=F32, quantized=mode)
        _assert_error(excinfo, path, needle, key)
    assert load_transformer(int8_file, dtype=F32) is not None  # the intact file still loads


def _folder_with(pipe_dir, dest, component, file, **changes):
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(pipe_dir, dest)
    config_path = dest / component / file
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
    return dest, config_path


@pytest.mark.parametrize("changes, needle", [
    ({"base_image_seq_len": 8192}, "base_image_seq_len=8192, which must be fewer tokens than max_image_seq_len"),
    ({"num_train_timesteps": 0}, "num_train_timesteps=0, which must be an integer of at least 1"),
    ({"max_shift": "abc"}, "max_shift='abc', which must be a finite number"),
    ({"time_shift_type": "cubic"}, "time_shift_type='cubic', which must be 'exponential' or 'linear'"),
    ({"shift_terminal": 1.0}, "shift_terminal=1.0, which must be null or a number in [0, 1)"),
    ({"use_karras_sigmas": True, "use_beta_sigmas": True}, "use_beta_sigmas=True, which must be false while"),
])
def test_bad_scheduler_configs_are_refused_when_the_folder_is_read(pipe_dir, bad_dir, changes, needle):
    """Before: ZeroDivisionError, IndexError, TypeError or diffusers' ValueError at the first prompt (or a silent
    NaN). Now the folder's load names scheduler_config.json and the key."""
    folder, config_path = _folder_with(pipe_dir, bad_dir / "scheduler-config", "scheduler", "scheduler_config.json",
                                       **changes)
    with pytest.raises(CheckpointError) as excinfo:
        load_pipeline_folder(folder, components=())
    _assert_error(excinfo, config_path, needle)


@pytest.mark.parametrize("changes, needle", [
    ({"attention_head_dim": -16}, "attention_head_dim=-16, but the weights beside it are of a model with "
                                  "attention_head_dim=16"),
    ({"num_attention_heads": 2_000_000}, "num_attention_heads=2000000, but"),  # would allocate 32 GB per Linear
    ({"num_layers": 100_000}, "num_layers=100000, but"),
    ({"axes_dims_rope": [4, 6]}, "axes_dims_rope=[4, 6]: expected three positive even numbers adding up to"),
    ({"axes_dims_rope": [4, 6, 8]}, "axes_dims_rope=[4, 6, 8]"),
    ({"axes_dims_rope": "abc"}, "axes_dims_rope='abc'"),
])
def test_transformer_config_json_must_describe_its_weights(pipe_dir, bad_dir, changes, needle):
    """Before: a negative-dimension RuntimeError, a 32 GB allocation failure, or (axes) a load that succeeded and
    failed at the first step. The config is now compared with the weights' shapes before anything is built."""
    folder, config_path = _folder_with(pipe_dir, bad_dir / "transformer-config", "transformer", "config.json",
                                       **changes)
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(folder, dtype=F32)
    _assert_error(excinfo, config_path, needle)
    assert load_transformer(pipe_dir, dtype=F32) is not None  # the intact folder still loads
