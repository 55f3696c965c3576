"""Model configs inferred from tensor shapes, so a single-file checkpoint (which carries no config.json) loads the
tiny test model and the full 7B / 8B models the same way.

Each function takes {tensor name: shape} already in diffusers / transformers names. Values that no tensor
determines (RoPE axes, rope theta, vision head count, DeepStack tap layers) come from the released models' known
configs, with a rule that also reproduces the tiny model's values; docs/checkpoints.md lists which value came from
where.
"""

from __future__ import annotations

import math
import os
import re
from typing import Callable, Mapping

from ..errors import CheckpointError, shorten

Shapes = Mapping[str, tuple]

# Qwen3-VL token ids (identical in every Qwen2/Qwen3 tokenizer, and kept by graph_runtime.tiny's tokenizer).
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_TOKEN_ID, VISION_END_TOKEN_ID = 151655, 151656, 151652, 151653
QWEN3VL_ROPE_THETA = 5_000_000.0
QWEN3VL_MAX_POSITIONS = 262_144
QWEN3VL_VISION_HEADS = 16
# (vision depth, number of DeepStack mergers) -> the blocks they tap, from the released Qwen3-VL configs
# (8B/32B: 27 blocks, 2B/4B: 24 blocks).
KNOWN_DEEPSTACK_INDEXES = {(27, 3): [8, 16, 24], (24, 3): [5, 11, 17]}


def _same(key: str) -> str:
    return key


class _ShapeReader:
    def __init__(self, shapes: Shapes, path, expected: str, file_key: Callable[[str], str]):
        self.shapes, self.path, self.expected, self.file_key = shapes, path, expected, file_key

    def __call__(self, key: str) -> tuple:
        shape = self.shapes.get(key)
        if shape is None:
            raise CheckpointError(self.path, f"lacks the tensor {self.file_key(key)!r}, which is needed to tell the "
                                             "model's size.", self.expected)
        return tuple(shape)

    def count(self, pattern: str) -> int:
        """How many numbered parts (blocks, layers) keys matching `pattern` (a regex with one (\\d+) group) name, 0 if
        none. Every number from 0 up must be there: a damaged file naming only block 20000 would otherwise build a
        model of 20001 blocks (minutes and gigabytes) before its missing tensors are found."""
        regex = re.compile(pattern)
        first_key = {}
        for key in self.shapes:
            if m := regex.match(key):
                first_key.setdefault(int(m.group(1)), key)
        if len(first_key) == (max(first_key) + 1 if first_key else 0):
            return len(first_key)
        highest = max(first_key)
        gap = next(i for i in range(highest + 1) if i not in first_key)
        raise CheckpointError(self.path, f"names part {highest} ({shorten(self.file_key(first_key[highest]))}) but "
                                         f"has no tensors of part {gap}: it holds {len(first_key)} numbered parts "
                                         f"where parts 0 to {highest} are needed (a damaged file).", self.expected)

    def ratio(self, numerator: int, denominator: int, what: str) -> int:
        if denominator <= 0 or numerator % denominator:
            raise CheckpointError(self.path, f"has tensor shapes that do not fit together ({what}: {numerator} is not "
                                             f"a multiple of {denominator}).", self.expected)
        return numerator // denominator


def rope_axes_for_head_dim(head_dim: int) -> tuple[int, int, int]:
    """Qwen-Image's 3-axis RoPE split (frame, height, width). RoPE has no weights, so no shape tells it; the released
    model uses (16, 56, 56) for head_dim 128. Each axis must be even (complex pairs), so the 2:7:7 proportion is
    applied to the head_dim / 2 rotation pairs, height and width rounded down, the frame axis taking the rest:
    128 -> (16, 56, 56) and the tiny model's 16 -> (4, 6, 6)."""
    pairs = head_dim // 2
    spatial = pairs * 7 // 16
    return (2 * (pairs - 2 * spatial), 2 * spatial, 2 * spatial)


def mrope_section_for_head_dim(head_dim: int) -> list[int]:
    """Qwen3-VL's interleaved M-RoPE split (temporal, height, width) in rotation pairs. Qwen3-VL-8B has [24, 20, 20]
    for head_dim 128; the 6:5:5 proportion with height/width rounded up gives that and the tiny model's [2, 3, 3]."""
    pairs = head_dim // 2
    spatial = math.ceil(pairs * 5 / 16)
    return [pairs - 2 * spatial, spatial, spatial]


def vision_heads_for_hidden(hidden: int) -> int:
    """Every released Qwen3-VL vision tower has 16 heads (72- or 64-wide); the q/k/v weight is [3*hidden, hidden]
    whatever the head count, so it cannot be read off. A tower too narrow for 32-wide heads (the tiny model, hidden
    32) is taken to use 16-wide heads."""
    if hidden % QWEN3VL_VISION_HEADS == 0 and hidden // QWEN3VL_VISION_HEADS >= 32:
        return QWEN3VL_VISION_HEADS
    return max(1, hidden // 16)


def deepstack_indexes(depth: int, count: int) -> list[int]:
    """Which vision blocks feed the DeepStack mergers: the released configs where known, else evenly spaced."""
    if (depth, count) in KNOWN_DEEPSTACK_INDEXES:
        return list(KNOWN_DEEPSTACK_INDEXES[(depth, count)])
    return [(i + 1) * depth // (count + 1) for i in range(count)]


def infer_transformer_config(shapes: Shapes, path: str | os.PathLike, expected: str,
                             file_key: Callable[[str], str] = _same) -> dict:
    """QwenImage21Transformer2DModel kwargs from diffusers-named shapes."""
    read = _ShapeReader(shapes, path, expected, file_key)
    inner, in_features = read("img_in.weight")
    head_dim = read("transformer_blocks.0.attn.norm_q.weight")[0]
    mlp_hidden = read("transformer_blocks.0.img_mlp.proj.weight")[0]
    # Qwen-Image-2.1 feeds its 64 latent channels unpatched, so the input width is the channel count.
    return dict(
        patch_size=1,
        in_channels=in_features,
        out_channels=read("proj_out.weight")[0],
        num_layers=read.count(r"^transformer_blocks\.(\d+)\."),
        attention_head_dim=head_dim,
        num_attention_heads=read.ratio(inner, head_dim, "hidden width / attention head width"),
        context_in_dim=read("txt_in.text_norm.weight")[0],
        mlp_ratio=read.ratio(mlp_hidden, inner, "MLP width / hidden width"),
        axes_dims_rope=rope_axes_for_head_dim(head_dim),
    )


def infer_vae_config(shapes: Shapes, path: str | os.PathLike, expected: str,
                     file_key: Callable[[str], str] = _same) -> dict:
    """AutoencoderKLQwenImage21 kwargs from diffusers-named shapes. latents_mean/std are statistics, not weights: the
    class defaults (the released model's values) apply."""
    read = _ShapeReader(shapes, path, expected, file_key)
    base_dim, in_channels = read("encoder.conv_in.weight")[:2]
    z_dim = read("post_quant_conv.weight")[0]
    if read("encoder.conv_out.weight")[0] != 2 * z_dim:
        raise CheckpointError(path, "has an encoder output width that is not twice the latent width.", expected)
    blocks = read.count(r"^encoder\.down_blocks\.(\d+)\.")
    if blocks == 0:
        raise CheckpointError(path, "has no encoder.down_blocks.* tensors.", expected)
    dim_mult = [read.ratio(read(f"encoder.down_blocks.{i}.resnets.0.conv1.weight")[0], base_dim, "block width")
                for i in range(blocks)]
    temporal = [f"encoder.down_blocks.{i}.downsampler.time_conv.weight" in shapes for i in range(blocks - 1)]
    return dict(
        base_dim=base_dim,
        decoder_base_dim=read.ratio(read("decoder.norm_out.gamma")[0], dim_mult[0], "decoder width"),
        z_dim=z_dim,
        dim_mult=dim_mult,
        num_res_blocks=read.count(r"^encoder\.down_blocks\.0\.resnets\.(\d+)\."),
        attn_scales=[],
        temperal_downsample=temporal,
        in_channels=in_channels,
        out_channels=read("decoder.conv_out.weight")[0],
        scale_factor_spatial=2 ** (blocks - 1),
        scale_factor_temporal=2 ** sum(temporal),
    )


def infer_text_encoder_config(shapes: Shapes, path: str | os.PathLike, expected: str,
                              file_key: Callable[[str], str] = _same):
    """A transformers Qwen3VLConfig from transformers-named shapes."""
    from transformers import Qwen3VLConfig

    read = _ShapeReader(shapes, path, expected, file_key)
    lm = "model.language_model."
    vocab, hidden = read(lm + "embed_tokens.weight")
    head_dim = read(lm + "layers.0.self_attn.q_norm.weight")[0]
    v = "model.visual."
    vision_hidden = read(v + "blocks.0.norm1.weight")[0]
    _, in_channels, temporal_patch, patch, _ = read(v + "patch_embed.proj.weight")
    merge_area = read.ratio(read(v + "merger.linear_fc1.weight")[1], vision_hidden, "merger input / vision width")
    merge = math.isqrt(merge_area)
    if merge * merge != merge_area:
        raise CheckpointError(path, "has a vision merger whose input is not a square patch group.", expected)
    depth = read.count(r"^model\.visual\.blocks\.(\d+)\.")
    mergers = read.count(r"^model\.visual\.deepstack_merger_list\.(\d+)\.")
    return Qwen3VLConfig(
        text_config=dict(
            hidden_size=hidden,
            intermediate_size=read(lm + "layers.0.mlp.gate_proj.weight")[0],
            num_hidden_layers=read.count(r"^model\.language_model\.layers\.(\d+)\."),
            num_attention_heads=read.ratio(read(lm + "layers.0.self_attn.q_proj.weight")[0], head_dim, "q heads"),
            num_key_value_heads=read.ratio(read(lm + "layers.0.self_attn.k_proj.weight")[0], head_dim, "kv heads"),
            head_dim=head_dim,
            vocab_size=vocab,
            max_position_embeddings=QWEN3VL_MAX_POSITIONS,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": QWEN3VL_ROPE_THETA,
                             "mrope_section": mrope_section_for_head_dim(head_dim), "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=depth,
            hidden_size=vision_hidden,
            intermediate_size=read(v + "blocks.0.mlp.linear_fc1.weight")[0],
            num_heads=vision_heads_for_hidden(vision_hidden),
            out_hidden_size=read(v + "merger.linear_fc2.weight")[0],
            deepstack_visual_indexes=deepstack_indexes(depth, mergers),
            num_position_embeddings=read(v + "pos_embed.weight")[0],
            in_channels=in_channels,
            patch_size=patch,
            spatial_merge_size=merge,
            temporal_patch_size=temporal_patch,
        ),
        image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID, vision_end_token_id=VISION_END_TOKEN_ID,
        # Without an lm_head the checkpoint can only be used with the head tied to the embeddings.
        tie_word_embeddings="lm_head.weight" not in shapes,
    )


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def check_config_values(where: str | os.PathLike, given: Mapping[str, object], inferred: Mapping[str, object],
                        expected: str, prefix: str = "") -> None:
    """A folder's config.json must describe the weights beside it before a model is built from it: a width, depth
    or layer count it gets wrong would build another model (minutes, or terabytes) before any shape is compared.
    `given`: config.json's value of each key of `inferred` (the class default where it leaves one out); `prefix`
    names the section in the message (e.g. "text_config.")."""
    for key, value in inferred.items():
        said = given.get(key)
        if isinstance(said, bool) or _plain(said) != _plain(value):
            raise CheckpointError(where, f"says {prefix}{key}={shorten(repr(said))}, but the weights beside it are "
                                         f"of a model with {prefix}{key}={_plain(value)!r}: this config.json does not "
                                         "belong to them.", expected)


def config_values(config: Mapping, cls, keys, none_means: Mapping[str, str] | None = None) -> dict:
    """What a diffusers config.json says for each of `keys`: its value, else the default of `cls.__init__`; where
    the class reads None as another key's value (`none_means`: {key: that key}), that value."""
    import inspect

    defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()}
    given = {key: config.get(key, defaults.get(key)) for key in keys}
    for key, other in (none_means or {}).items():
        if given.get(key) is None:
            given[key] = config.get(other, defaults.get(other))
    return given
