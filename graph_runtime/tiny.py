"""Tiny random Qwen-Image-2.1 models, built offline in seconds.

They drive the CPU tests, the CLI's built-in default and the end-to-end tests against a real ComfyUI. The
architecture is the real one (single-stream DiT, Qwen3-VL text encoder, 16x VAE) at toy widths, written in the real
on-disk layouts so every loader path is exercised exactly as it is with the full 30 GB of weights.

The tokenizer keeps the real Qwen token ids of the special tokens (`<|im_start|>` = 151644, `<|image_pad|>` =
151655, ...) and the text encoder keeps the real vocabulary size, so one tiny text encoder works with this
tokenizer and with the real Qwen tokenizer that ComfyUI bundles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .errors import InputError

# The real Qwen2/Qwen3 special tokens, in id order from 151643.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
FIRST_SPECIAL_ID = 151643
QWEN_VOCAB_SIZE = 151936

TINY_TRANSFORMER = dict(
    patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    context_in_dim=64, mlp_ratio=3, axes_dims_rope=(4, 6, 6), eps=1e-6, causal_condition=True,
)
TINY_VAE = dict(base_dim=8, decoder_base_dim=8, z_dim=64, num_res_blocks=1)
# The tiny INT8 ConvRot files rotate in groups of 16: the smallest power of 4 (comfy-kitchen's Hadamard sizes) that
# divides every quantized layer's input width (DiT 32 / 96, text model 64 / 128, vision 32 / 64 / 128). The released
# files use larger groups (ComfyUI's default is 256) on 4096+ wide layers.
TINY_CONVROT_GROUP = 16
# The Turbo checkpoint is a separately distilled model of the same architecture: its tiny stand-in has other weights.
TINY_TURBO_SEED = 1

# Qwen2's pre-tokenizer split pattern (contractions, letters, single digits, punctuation runs, whitespace).
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = [
    "A capybara wearing a wizard hat, reading a book by candlelight, oil painting.",
    "Comprehend and analyze the provided prompt. A photo of a red cube on a blue sphere at sunset.",
    "Make the sky purple and add a small boat. Replace the background with a snowy mountain.",
    "portrait, studio lighting, 35mm film, highly detailed, sharp focus, bokeh, golden hour",
    "user assistant system image picture the a an of in on with and",
]


def build_tokenizer():
    """A byte-level BPE tokenizer with Qwen's pre-tokenizer and special tokens at their real ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    from .loading.processor import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    state = json.loads(tok.to_str())
    vocab = dict(state["model"]["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    # Unused filler entries push the special tokens to Qwen's ids; BPE never produces them.
    for i in range(len(vocab), FIRST_SPECIAL_ID):
        vocab[f"<|unused_{i}|>"] = i
    fast = Qwen2TokenizerFast(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=None,
                              pad_token=None)
    # Added in id order, in one call, so each lands on its real Qwen id.
    fast.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS], special_tokens=True)
    fast.eos_token, fast.pad_token = "<|im_end|>", "<|endoftext|>"
    for offset, name in enumerate(QWEN_SPECIAL_TOKENS):
        got = fast.convert_tokens_to_ids(name)
        if got != FIRST_SPECIAL_ID + offset:
            raise RuntimeError(f"tiny tokenizer put {name} at id {got}, expected {FIRST_SPECIAL_ID + offset}")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_processor(tokenizer=None):
    """The production processor (loading/processor.py) around `tokenizer`, by default the tiny one."""
    from .loading import processor  # the toy models build on the real loaders, never the reverse

    return processor.build_processor(tokenizer or build_tokenizer())


def tiny_text_encoder_config():
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=QWEN_VOCAB_SIZE, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], num_position_embeddings=256, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=True,
    )


def random_tiny_transformer(config: dict | None = None):
    """The tiny transformer (or one of another `config`) with random weights drawn from torch's global generator
    (seed it first)."""
    from diffusers import QwenImage21Transformer2DModel

    transformer = QwenImage21Transformer2DModel(**(config or TINY_TRANSFORMER)).eval()
    # Zero-init weights would make the model trivially constant; give every weight real variation.
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.5 / max(1, p.shape[-1]) ** 0.5)
    return transformer


def build_tiny_components(seed: int = 0):
    """Random tiny transformer, VAE, text encoder, processor and scheduler (fp32, CPU)."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    transformer = random_tiny_transformer()
    vae = AutoencoderKLQwenImage21(**TINY_VAE).eval()
    text_encoder = Qwen3VLForConditionalGeneration(tiny_text_encoder_config()).eval()
    processor = build_processor()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, processor=processor,
                scheduler=scheduler)


def check_writable(paths, force: bool = False, folder: bool = False) -> None:
    """Refuse a place that cannot be written (a file where a folder goes or the reverse, a folder that is not
    writable, a name too long), and anything that exists (a file, or a folder that is not empty) unless `force`.

    The tiny files take the real checkpoints' names, so writing them into a real ComfyUI models/ folder would
    silently replace 30 GB of weights with random toys.
    """
    from .output_files import check_target

    for path in paths:
        check_target("make-tiny output", path, overwrite=True, replace_hint="", folder=folder)
    if force:
        return
    for path in map(Path, paths):
        empty_folder = path.is_dir() and not any(path.iterdir())
        if os.path.lexists(path) and not empty_folder:
            raise InputError("make-tiny output", str(path), "a path with nothing there yet: it would be "
                                                            "overwritten (pass --force, or force=True, to replace it)")


def write_diffusers_folder(out_dir: str | os.PathLike, seed: int = 0,
                           text_encoder_dtype: torch.dtype | None = None, force: bool = False) -> Path:
    """Write a complete tiny Qwen-Image-2.1 in the Hugging Face diffusers layout and return its path.

    `text_encoder_dtype=torch.bfloat16` halves the folder (the text encoder's 151936-row embedding table is 39 MB in
    fp32); the default keeps every component fp32, identical to `build_tiny_components(seed)`. A folder that exists
    and is not empty is refused unless `force`.
    """
    from diffusers import QwenImage21Pipeline

    out = Path(out_dir)
    check_writable([out], force, folder=True)
    parts = build_tiny_components(seed)
    if text_encoder_dtype is not None:
        parts["text_encoder"] = parts["text_encoder"].to(text_encoder_dtype)
    pipe = QwenImage21Pipeline(**parts)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def comfyui_file_paths(models_dir: str | os.PathLike) -> dict[str, Path]:
    """Where `write_comfyui_files` writes: the file names ComfyUI's own Qwen-Image-2.1 template downloads."""
    root = Path(models_dir)
    return {
        "transformer": root / "diffusion_models" / "qwen_image_2.1_bf16.safetensors",
        "text_encoder": root / "text_encoders" / "qwen3vl_8b_bf16.safetensors",
        "vae": root / "vae" / "qwen_image_2.1_vae_bf16.safetensors",
    }


def write_comfyui_files(models_dir: str | os.PathLike, seed: int = 0, force: bool = False) -> dict[str, Path]:
    """Write the tiny model as the single files ComfyUI's own Qwen-Image-2.1 template uses.

    Layout: see `comfyui_file_paths`; each file in ComfyUI's key layout and bf16. If any of them exists, nothing is
    written unless `force`.
    """
    from .loading.comfy_layout import (
        text_encoder_to_comfy_state_dict, transformer_to_comfy_state_dict, vae_to_comfy_state_dict,
    )

    files = comfyui_file_paths(models_dir)
    check_writable(list(files.values()), force)
    parts = build_tiny_components(seed)
    state_dicts = {
        "transformer": transformer_to_comfy_state_dict(parts["transformer"].state_dict()),
        "text_encoder": text_encoder_to_comfy_state_dict(parts["text_encoder"].state_dict()),
        "vae": vae_to_comfy_state_dict(parts["vae"].state_dict()),
    }
    for name, path in files.items():
        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state_dicts[name].items()}
        save_safetensors(tensors, path)
    return files


def save_safetensors(tensors: dict, path: Path) -> None:
    """Write a checkpoint under its final name only once it is complete (a full disk leaves no truncated file
    under a real checkpoint's name)."""
    from safetensors.torch import save

    from .output_files import write_atomically

    write_atomically(path, lambda file: file.write(save(tensors, metadata={"format": "pt"})))


# The ComfyUI file names of the released INT8 ConvRot checkpoints (ComfyUI's Qwen-Image-2.1 templates load these).
INT8_FILES = {
    "transformer": "diffusion_models/qwen_image_2.1_int8_convrot.safetensors",
    "turbo_transformer": "diffusion_models/qwen_image_2.1_turbo_int8_convrot.safetensors",
    "text_encoder": "text_encoders/qwen3vl_8b_int8_convrot.safetensors",
}


def _quantized_transformer_key(key: str) -> bool:
    # Every Linear of the blocks, as the released file does, and the shared modulation (outside the blocks: the
    # loader dequantizes it even in int8 mode, so the tiny file exercises that path too).
    return key.endswith(".weight") and (".transformer_blocks." in key and ".norm_" not in key
                                        or key.endswith("modulation.1.weight"))


def _quantized_text_encoder_key(key: str) -> bool:
    # The language model's projections and its embedding table, and the vision tower's Linear layers (their records
    # use ComfyUI's nested "params" spelling, which the loader reads too).
    if not key.endswith(".weight") or "norm" in key:
        return False
    return (key.startswith("model.language_model.layers.") or key == "model.language_model.embed_tokens.weight"
            or (key.startswith("model.visual.") and ("blocks." in key or "merger" in key) and "patch_embed" not in key))


def quantize_state_dict(state_dict, select, group_size: int, nested=lambda key: False) -> dict:
    """A float state dict in a file's key layout -> ComfyUI's INT8 ConvRot layout: each selected 2-D weight `P.weight`
    becomes int8 with `P.weight_scale` (fp32 per row) and a `P.comfy_quant` record; everything else goes to bf16."""
    from .quantized import quantize_weight, record_tensor

    out = {}
    for key, value in state_dict.items():
        value = value.detach()
        if select(key) and value.dim() == 2:
            prefix = key[: -len(".weight")]
            q, scale = quantize_weight(value, group_size)
            out[key], out[prefix + ".weight_scale"] = q.contiguous(), scale
            out[prefix + ".comfy_quant"] = (
                record_tensor(None, convrot=False, params={"convrot": True, "convrot_groupsize": group_size})
                if nested(key) else record_tensor(group_size))
        else:
            out[key] = value.to(torch.bfloat16).contiguous()
    return out


def comfyui_int8_file_paths(models_dir: str | os.PathLike) -> dict[str, Path]:
    """Where `write_comfyui_int8_files` writes: the released INT8 ConvRot file names (INT8_FILES)."""
    return {name: Path(models_dir) / relative for name, relative in INT8_FILES.items()}


def write_comfyui_int8_files(models_dir: str | os.PathLike, seed: int = 0, turbo_seed: int = TINY_TURBO_SEED,
                             group_size: int = TINY_CONVROT_GROUP, parts: dict | None = None,
                             force: bool = False) -> dict[str, Path]:
    """Write the tiny model as ComfyUI's INT8 ConvRot single files under the released names (see INT8_FILES): the
    DiT and the text encoder from `build_tiny_components(seed)` (the same weights as `write_comfyui_files(seed)`
    before quantization; `parts`: those components when the caller has them already), the Turbo DiT from
    `turbo_seed`. Quantized with comfy-kitchen from the fp32 weights, in ComfyUI's key layout, with `.weight_scale`
    / `.comfy_quant` next to every quantized weight. A file that exists already is not written unless `force`."""
    from .loading.comfy_layout import text_encoder_to_comfy_state_dict, transformer_to_comfy_state_dict

    files = comfyui_int8_file_paths(models_dir)
    check_writable(list(files.values()), force)
    base = parts or build_tiny_components(seed)
    torch.manual_seed(turbo_seed)
    turbo = random_tiny_transformer()
    state_dicts = {
        "transformer": quantize_state_dict(transformer_to_comfy_state_dict(base["transformer"].state_dict()),
                                           _quantized_transformer_key, group_size),
        "turbo_transformer": quantize_state_dict(transformer_to_comfy_state_dict(turbo.state_dict()),
                                                 _quantized_transformer_key, group_size),
        "text_encoder": quantize_state_dict(text_encoder_to_comfy_state_dict(base["text_encoder"].state_dict()),
                                            _quantized_text_encoder_key, group_size,
                                            nested=lambda key: key.startswith("model.visual.")),
    }
    for name, path in files.items():
        save_safetensors(state_dicts[name], path)
    return files
