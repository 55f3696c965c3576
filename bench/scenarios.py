"""Benchmark scenarios and their inputs: random text embeddings, latents and reference latents.

No text encoder or VAE is involved: the decode step only sees embeddings and latents, so random ones of the real
shapes measure the same work. A 128-token prompt, as in our anchors; each reference image takes 8 text tokens of
framing plus its image slots, like the pipeline's `<imageN><|vision_start|>...<|vision_end|>` template.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graph_runtime.decode import TokenLayout

TEXT_TOKENS = 128
NEGATIVE_TEXT_TOKENS = 96  # a shorter negative prompt: CFG branches then have different prefix lengths


@dataclass(frozen=True)
class Scenario:
    name: str
    resolution: int
    references: int = 0
    batch: int = 1
    cfg: bool = False
    quality: bool = False  # compare every path against an fp32 run of the reference

    @property
    def grid(self) -> int:
        return self.resolution // 16


DEFAULT_SCENARIOS = [
    Scenario("t2i-512", 512, quality=True),
    Scenario("t2i-1024", 1024, quality=True),
    Scenario("t2i-1328", 1328),
    Scenario("edit1-1024", 1024, references=1, quality=True),
    Scenario("edit2-1024", 1024, references=2),
    Scenario("t2i-1024-b2", 1024, batch=2),
    Scenario("t2i-1024-cfg", 1024, cfg=True),
]
QUICK_SCENARIOS = [Scenario("t2i-512", 512, quality=True), Scenario("t2i-1024", 1024, quality=True)]
# Named only: 16384 target tokens, where a step's attention and GEMMs are four times the 1024x1024 ones.
LARGE_SCENARIOS = [Scenario("t2i-2048", 2048)]
TINY_SCENARIOS = [Scenario("tiny-t2i", 128, quality=True), Scenario("tiny-edit1-cfg", 128, references=1, cfg=True,
                                                                     quality=True)]


@dataclass
class BranchInputs:
    name: str
    embeds: torch.Tensor  # [B, L, context]
    vlm_mask: torch.Tensor  # [1, L] image-slot mask
    layout: TokenLayout


@dataclass
class ScenarioInputs:
    scenario: Scenario
    latents: torch.Tensor  # [B, T, C] target
    cond_tokens: torch.Tensor | None  # [B, cond_tokens, C]
    img_shapes: list
    timestep: torch.Tensor  # [B]
    branches: list[BranchInputs]

    @property
    def hidden_all(self) -> torch.Tensor:
        return self.latents if self.cond_tokens is None else torch.cat([self.cond_tokens, self.latents], dim=1)

    def to(self, dtype) -> "ScenarioInputs":
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        return ScenarioInputs(self.scenario, cast(self.latents), cast(self.cond_tokens), self.img_shapes,
                              cast(self.timestep),
                              [BranchInputs(b.name, cast(b.embeds), b.vlm_mask, b.layout) for b in self.branches])


def _vlm_mask(text_tokens: int, references: int, slots_per_ref: int) -> torch.Tensor:
    pattern = []
    for _ in range(references):
        pattern += [False] * 8 + [True] * slots_per_ref
    pattern += [False] * (text_tokens - 8 * references)
    return torch.tensor(pattern)[None]


def build_inputs(scenario: Scenario, context_dim: int, channels: int, device, dtype, seed: int = 0):
    generator = torch.Generator("cpu").manual_seed(seed)
    g = scenario.grid
    target = g * g
    b = scenario.batch
    shapes = [(1, g, g)] * scenario.references + [(1, g, g)]
    slots = target // 4

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    branches = []
    for name, tokens in [("cond", TEXT_TOKENS)] + ([("uncond", NEGATIVE_TEXT_TOKENS)] if scenario.cfg else []):
        tokens = max(tokens, 8 * scenario.references + 16)
        mask = _vlm_mask(tokens, scenario.references, slots)
        layout = TokenLayout.build(mask, shapes, device)
        branches.append(BranchInputs(name, randn(b, mask.shape[1], context_dim), mask.to(device), layout))
    cond = randn(b, target * scenario.references, channels) if scenario.references else None
    return ScenarioInputs(scenario, randn(b, target, channels), cond, shapes,
                          torch.full((b,), 0.7, device=device, dtype=dtype), branches)


def decode_flops(config, scenario: Scenario, branches: list[BranchInputs]) -> float:
    """FLOPs of one decode step (every CFG branch): block GEMMs over target tokens + attention over prefix+target."""
    d = config.num_attention_heads * config.attention_head_dim
    mlp = d * config.mlp_ratio
    layers = config.num_layers
    total = 0.0
    for branch in branches:
        t, p = branch.layout.target_tokens, branch.layout.prefix_len
        gemm = 2 * t * (4 * d * d + 3 * d * mlp) * layers + 2 * t * d * (config.in_channels + config.out_channels)
        attn = 4 * t * (p + t) * d * layers
        total += scenario.batch * (gemm + attn)
    return total


def prefill_flops(config, scenario: Scenario, branches: list[BranchInputs]) -> float:
    d = config.num_attention_heads * config.attention_head_dim
    mlp = d * config.mlp_ratio
    total = 0.0
    for branch in branches:
        s = branch.layout.seq_len
        total += scenario.batch * (2 * s * (4 * d * d + 3 * d * mlp) * config.num_layers
                                   + 2 * s * s * d * config.num_layers)  # ~half of the full square is attended
    return total


def describe(scenario: Scenario, branches) -> dict:
    return {"resolution": scenario.resolution, "references": scenario.references, "batch": scenario.batch,
            "cfg": scenario.cfg, "prefix_tokens": [b.layout.prefix_len for b in branches],
            "target_tokens": branches[0].layout.target_tokens,
            "pixels": f"{scenario.resolution}x{scenario.resolution}", "latent_tokens": math.prod((scenario.grid,) * 2)}
