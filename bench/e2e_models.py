"""The three models of a prompt-to-image run, full size with random weights, built straight on the GPU.

No download and no disk: the transformer is `model.build_transformer`'s (the real architecture, small normal
weights), the text encoder is Qwen3-VL-8B built from its released config (`QWEN3VL_8B`) with transformers' own
initialisation, the VAE is Qwen-Image-2.1's (the class defaults are the released config). The tokenizer is the tiny
byte-level BPE of `graph_runtime.tiny` with Qwen's special tokens at their real ids: the real vocabulary is not
needed for timing, only the token count, which `e2e_scenarios.prompt_of_tokens` sets. `tiny=True` builds the tiny
models of the CPU tests instead, through the same code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

# Qwen3-VL-8B-Instruct's config (text: 36 layers, hidden 4096, MLP 12288, 32 query / 8 key-value heads of 128;
# vision: 27 blocks of 1152 wide, DeepStack taps 8/16/24, merged to 4096). The same constants the loader infers a
# single file's config from (loading/config_infer.py) where no tensor shape tells them.
QWEN3VL_8B = dict(
    text_config=dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                         "mrope_interleaved": True},
    ),
    vision_config=dict(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
        deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, in_channels=3, hidden_act="gelu_pytorch_tanh",
    ),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False,
)


@dataclass
class E2EModels:
    """What `QwenImageGenerator` and `QwenImage21Pipeline` are built from (the loaders' `QwenImageModels` shape)."""

    transformer: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    processor: object
    scheduler_config: dict
    build_s: dict = field(default_factory=dict)  # seconds per component

    @property
    def sources(self) -> dict:
        return {"model": "random weights (benchmark)"}


def _timed(build_s: dict, name: str, fn):
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    build_s[name] = round(time.perf_counter() - start, 2)
    return out


def build_text_encoder(device, dtype, tiny: bool = False):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from graph_runtime.tiny import tiny_text_encoder_config

    config = tiny_text_encoder_config() if tiny else Qwen3VLConfig(**QWEN3VL_8B)
    torch.manual_seed(1)
    with torch.device(device):
        # `_from_config(dtype=...)` builds in the target dtype as `from_pretrained` does: the RoPE frequency buffers
        # stay fp32, and no fp32 copy of 8 B parameters is ever made. (transformers before 4.56 names it torch_dtype.)
        try:
            model = Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype)
        except TypeError:
            model = Qwen3VLForConditionalGeneration._from_config(config, torch_dtype=dtype)
    return model.eval().requires_grad_(False)


def build_vae(device, dtype, tiny: bool = False):
    from diffusers import AutoencoderKLQwenImage21

    from graph_runtime.tiny import TINY_VAE

    torch.manual_seed(2)
    with torch.device(device):
        vae = AutoencoderKLQwenImage21(**(TINY_VAE if tiny else {}))
    return vae.to(dtype).eval().requires_grad_(False)


def build_models(device="cuda", dtype=torch.bfloat16, tiny: bool = False) -> E2EModels:
    from graph_runtime.loading import default_scheduler_config
    from graph_runtime.tiny import build_processor
    from .model import build_transformer

    build_s: dict = {}
    transformer = _timed(build_s, "transformer", lambda: build_transformer(tiny=tiny, device=device, dtype=dtype))
    text_encoder = _timed(build_s, "text_encoder", lambda: build_text_encoder(device, dtype, tiny))
    vae = _timed(build_s, "vae", lambda: build_vae(device, dtype, tiny))
    processor = _timed(build_s, "processor", build_processor)
    return E2EModels(transformer=transformer, vae=vae, text_encoder=text_encoder, processor=processor,
                     scheduler_config=default_scheduler_config(), build_s=build_s)


def diffusers_pipeline(models: E2EModels):
    """diffusers' reference pipeline over the very same modules (no copy: the same weights run both paths)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(models.scheduler_config)
    pipe = QwenImage21Pipeline(transformer=models.transformer, vae=models.vae, text_encoder=models.text_encoder,
                               processor=models.processor, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parameter_count(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e9
