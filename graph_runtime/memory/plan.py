"""The memory plan of one request: where each part lives so that it fits the card, and what a step will cost.

Given the bytes a request may use on its GPU (ComfyUI's figure where the nodes run under its model management, the
runtime's `free_memory` otherwise), the host's budget, the models' sizes and the request's shape, `plan_memory`
decides:

- how many transformer blocks stay **resident** (all, or N, the others streamed from pinned host memory through
  `slots` fixed GPU slots of one block's weights each);
- where the **prefix K/V** lives: `gpu` (bf16), `int8` (int8 rows + per-token-per-head scales, dequantized into a
  shared bf16 working buffer), `host` (pinned host memory, copied into working buffers block by block) or
  `recompute` (no cache: every step runs the whole joint sequence);
- the **text encoder's** placement (`always gpu`, `gpu while encoding, then offload`, `streamed by layer`, `cpu`),
  with a smaller file suggested where one would place it better;
- the **VAE decode**: whole, or tiled where a whole one does not fit;
- the estimated **step cost**: the compute + max(0, streamed bytes / host-to-device bandwidth - the compute the
  uploads overlap).

Among the plans that fit (GPU and host), the one with the lowest estimated step wins; ties go to more resident
blocks, then to the prefix placement earlier in PREFIX_PLACEMENTS. A plan that keeps every block and the prefix on
the GPU is exactly today's budget (sizes.estimate), so whatever fitted before is planned whole. When nothing fits
(not even every block streamed, the prefix recomputed and the text encoder on the CPU), `plan_memory` returns the
smallest plan with `fits` False, for the refusal to quote.

The runtime reads the decisions off the plan (`resident_blocks`, `prefix_placement`: the sampler's request carries it
as `planned_placement`). A placement's GPU and host bytes are the prefix store's (sizes.py `placement_bytes`, through
`sizes.estimate`), so the plan prices what the runtime allocates. Every placement is built (PREFIX_PLACEMENTS_BUILT);
a user's forced placement is planned alone (`placements=(choice,)`), and budget.py `check_sampling_request` is the one
caller that decides what runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..decode.prefix_store import HOST, PLACEMENTS, STORED, working_slots
from ..text_encoder_layers import decoder_layer_bytes
from .. import free_memory
from . import link
from ..report import block_sizes
from .sizes import (
    MARGIN_BYTES, MARGIN_FRACTION, GenerationShape, GiB, MemoryBudget, TransformerDims, VaeDims, estimate, gib,
    kv_bytes_per_token, module_bytes, placement_bytes,
)

PREFIX_PLACEMENTS = PLACEMENTS  # fastest first: the order ties are broken in
# What the runtime carries out (decode/prefix_store.py builds every placement).
PREFIX_PLACEMENTS_BUILT = frozenset(PREFIX_PLACEMENTS)
# Whether streamed blocks replay inside the captured decode graph (else a streamed load steps eagerly, uploads not
# overlapped with compute: the step estimate then adds the whole upload time).
STREAMED_GRAPH_BUILT = True

TE_GPU = "always gpu"
TE_OFFLOAD = "gpu while encoding, then offload"
TE_STREAMED = "streamed by layer"
TE_CPU = "cpu"
TE_PLACEMENTS = (TE_GPU, TE_OFFLOAD, TE_STREAMED, TE_CPU)  # best first
TE_AUTO = "auto"  # a user's choice, not a placement: run the plan's placement

DEFAULT_SLOTS = 2
# A conservative host-to-device rate for pinned copies: PCIe 4.0 x16 moves about twice this, PCIe 3.0 x16 a bit more.
DEFAULT_H2D_BYTES_PER_S = 10e9
BANDWIDTH_SETTING = "KVGRAPH_H2D_GB_S"  # the link's measured rate, in GB/s, where the user knows it
# A conservative device-memory rate for the int8 prefix's dequantization (consumer cards have 0.3-1 TB/s).
DEVICE_BYTES_PER_S = 0.4e12

# The int8 prefix: one byte per value, plus one fp32 scale per token, head, block and K/V.
INT8_SCALE_BYTES = 4
# bf16 working buffers of one block's K/V (the largest branch), as the prefix store allocates them: the int8 prefix
# dequantizes into one; the host prefix double-buffers, one being read by attention while the next block's copy lands.
PREFIX_WORK_BUFFERS = {p: working_slots(p) for p in STORED}
# The text encoder streamed by layer: this many layers' weights on the GPU at once.
TE_SLOTS = 2

# An estimate of one model evaluation's compute, in ms, for 1024x1024 (STEP_TOKENS target tokens) on an H100-class GPU
# with graph replay: (with a 128-token prompt, with one 4096-token reference more). Taken from the side-by-side step in
# docs/memory.md; scaled linearly in target tokens and in prefix tokens. Unknown precisions use bf16's (the slower).
# A smaller card computes slower, so it hides more of an upload: the streamed estimate errs high there.
STEP_MS = {"bf16": (109.0, 123.0), "int8": (73.0, 89.0)}
STEP_TOKENS = 4096
STEP_PROMPT_TOKENS = 128
EAGER_FACTOR = 1.2  # an eager step against a replayed one (docs/memory.md: "each step ~20% slower")

# The published Qwen3-VL-8B text encoder files (docs/memory.md), for a plan made before one is loaded; an int8 file is
# this fraction of a bf16 one.
STANDARD_TEXT_ENCODER_BYTES = {"bf16": int(15.2 * GiB), "int8": int(8.8 * GiB)}
INT8_TEXT_ENCODER_FRACTION = 8.8 / 15.2
# The decoder layers' share of an unmeasured text encoder's bytes: Qwen3-VL-8B built on the meta device in bf16 has 36
# layers of 368 MiB (12.94 GiB) in 15.17 GiB; the rest (embeddings 1.16 GiB, vision tower 1.07 GiB, norm) stays on the
# GPU when it streams by layer.
STANDARD_LAYER_SHARE = 12.94 / 15.17


def default_bandwidth(device=None) -> float:
    """The host-to-device bytes per second plans assume: KVGRAPH_H2D_GB_S where set, else the rate measured on
    `device` (a CUDA device: link.py), else the conservative default."""
    gb = free_memory.gb_setting(BANDWIDTH_SETTING, "the host-to-device rate in GB/s, a number above 0")
    if gb is not None:
        return gb * 1e9
    measured = None if device is None else link.measured_h2d_bytes_per_s(device)
    return DEFAULT_H2D_BYTES_PER_S if measured is None else measured


@dataclass(frozen=True)
class TextEncoderSize:
    """What the text encoder's placement depends on."""

    bytes: int
    precision: str = "bf16"
    layers: int = 36
    hidden: int = 4096
    mlp_hidden: int = 12288
    largest_layer: int | None = None  # measured (`of`); else the standard file's share
    outside: int | None = None  # bytes outside the decoder layers, measured; else the standard file's share

    @property
    def layer_bytes(self) -> int:
        """The largest decoder layer's bytes."""
        if self.largest_layer is not None:
            return self.largest_layer
        return -(-int(self.bytes * STANDARD_LAYER_SHARE) // self.layers)

    @property
    def outside_bytes(self) -> int:
        """What stays on the GPU while it streams by layer: everything outside the decoder layers."""
        if self.outside is not None:
            return self.outside
        return max(0, self.bytes - self.layers * self.layer_bytes)

    def gpu_bytes(self, placement: str, tokens: int) -> int:
        """The GPU bytes one encode of `tokens` needs under `placement`: the weights there and its activations."""
        if placement == TE_CPU:
            return 0
        if placement == TE_STREAMED:
            return self.outside_bytes + min(TE_SLOTS, self.layers) * self.layer_bytes + self.encode_bytes(tokens)
        return self.bytes + self.encode_bytes(tokens)

    def encode_bytes(self, tokens: int) -> int:
        """One encode's activations (as a transformer block's: 8 hidden + 3 MLP rows per token, bf16) and margin."""
        return tokens * (8 * self.hidden + 3 * self.mlp_hidden) * 2 + MARGIN_BYTES

    @classmethod
    def standard(cls, precision: str = "bf16") -> "TextEncoderSize":
        return cls(STANDARD_TEXT_ENCODER_BYTES[precision], precision)

    @classmethod
    def of(cls, module: torch.nn.Module) -> "TextEncoderSize":
        config = getattr(module, "config", None)
        text = getattr(config, "text_config", config)
        int8 = any(p.dtype == torch.int8 for p in module.parameters())
        total, layers = decoder_layer_bytes(module)
        return cls(total, "int8" if int8 else "bf16",
                   largest_layer=max(layers) if layers else None,
                   outside=total - sum(layers) if layers else None,
                   layers=len(layers) or int(getattr(text, "num_hidden_layers", 36) or 36),
                   hidden=int(getattr(text, "hidden_size", 4096) or 4096),
                   mlp_hidden=int(getattr(text, "intermediate_size", 12288) or 12288))


@dataclass(frozen=True)
class ModelSizes:
    """The models' bytes a plan places: the transformer by block, the VAE, other weights that stay on the GPU (a
    ControlNet), the text encoder."""

    dims: TransformerDims
    block_bytes: tuple[int, ...]
    other_bytes: int  # the transformer outside its blocks (embeddings, modulation, output layers): always resident
    vae: VaeDims | None = None
    extra_weights: tuple[tuple[str, int], ...] = ()
    text_encoder: TextEncoderSize | None = None

    @property
    def transformer_bytes(self) -> int:
        return self.other_bytes + sum(self.block_bytes)

    @property
    def blocks(self) -> int:
        return len(self.block_bytes)

    @property
    def precision(self) -> str:
        return "int8" if self.dims.int8 else "bf16"

    @classmethod
    def of(cls, transformer: torch.nn.Module, vae: VaeDims | None = None, extra_weights: dict | None = None,
           text_encoder: TextEncoderSize | None = None) -> "ModelSizes":
        total, blocks = block_sizes(transformer)
        return cls(TransformerDims.of(transformer), tuple(blocks), total - sum(blocks), vae,
                   tuple((extra_weights or {}).items()), text_encoder)

    @classmethod
    def standard(cls, precision: str = "bf16", text_encoder: str | None = "bf16") -> "ModelSizes":
        """The published Qwen-Image-2.1 (its diffusers default config, built on the meta device) in `precision`
        ("bf16", or "int8": the ConvRot file, block Linears in int8), the standard VAE and text encoder."""
        from diffusers import QwenImage21Transformer2DModel

        with torch.device("meta"):
            model = QwenImage21Transformer2DModel().to(torch.bfloat16)
        sizes = cls.of(model, VaeDims.standard(), text_encoder=(
            None if text_encoder is None else TextEncoderSize.standard(text_encoder)))
        if precision not in ("bf16", "int8"):
            raise ValueError(f"precision {precision!r}: expected 'bf16' or 'int8'")
        return sizes.as_int8() if precision == "int8" else sizes

    def as_int8(self) -> "ModelSizes":
        """The same model from its int8 ConvRot file: block Linears in int8 (TransformerDims.int8_weight_bytes)."""
        if self.dims.int8:
            return self
        one_block = dataclasses.replace(self.dims, blocks=1)
        return dataclasses.replace(self, dims=dataclasses.replace(self.dims, int8=True),
                                   block_bytes=tuple(one_block.int8_weight_bytes(b) for b in self.block_bytes))


def request_shape(width: int, height: int, batch: int = 1, cfg: bool = False, references: int = 0,
                  prompt_tokens: int = 128, reference_tokens: int | None = None,
                  decode_mode: str = "auto") -> GenerationShape:
    """The shape of a request described by its settings: each reference adds `reference_tokens` prefix tokens (None:
    as many as the output has, a reference at the output's size) to each CFG branch."""
    per_reference = (width // 16) * (height // 16) if reference_tokens is None else reference_tokens
    prefix = prompt_tokens + references * per_reference
    return GenerationShape(width=width, height=height, batch=batch, prefix_tokens=(prefix,) * (2 if cfg else 1),
                           decode_mode=decode_mode)


@dataclass
class MemoryPlan:
    """One plan: the decisions, the GPU budget itemized as sizes.MemoryBudget, the host's parts, the step estimate."""

    blocks: int
    resident_blocks: int
    slots: int
    prefix_placement: str
    vae_decode: str  # "whole" / "tiled" / "none" (no VAE counted)
    budget: MemoryBudget  # the GPU side
    host_parts: list[tuple[str, int]]
    compute_ms: float
    upload_bytes: int  # bytes copied from the host every step (streamed blocks, a host prefix)
    bandwidth: float
    shape: GenerationShape
    available: int | None = None
    host_available: int | None = None
    text_encoder: str | None = None
    text_encoder_suggestion: str | None = None
    text_encoder_gpu_bytes: int = 0  # what the encode needs on the GPU under `text_encoder` (TextEncoderSize.gpu_bytes)
    fits: bool = True
    notes: list[str] = field(default_factory=list)
    device: str = "GPU"  # what the plan's device is called in its description
    overlapped: bool = True  # uploads overlap the compute (streamed blocks inside the graph); else they add to it

    @property
    def streamed_blocks(self) -> int:
        return self.blocks - self.resident_blocks

    @property
    def whole(self) -> bool:
        """Every block resident and the prefix on the GPU: what ran before plans existed."""
        return self.resident_blocks == self.blocks and self.prefix_placement == "gpu"

    @property
    def gpu_bytes(self) -> int:
        return self.budget.total

    @property
    def host_bytes(self) -> int:
        return sum(n for _, n in self.host_parts)

    @property
    def new_host_bytes(self) -> int:
        """Host memory the plan adds: the streamed blocks' and a host prefix's pinned copies (the text encoder's copy
        is held whatever its placement, so it is shown but not checked)."""
        return sum(n for label, n in self.host_parts if not label.startswith("text encoder"))

    @property
    def upload_ms(self) -> float:
        return self.upload_bytes / self.bandwidth * 1e3

    @property
    def step_ms(self) -> float:
        """The estimated step: compute, plus the uploads the compute does not hide (all of them where they are not
        overlapped: streamed blocks stepping eagerly)."""
        if not self.overlapped:
            return self.compute_ms + self.upload_ms
        return self.compute_ms + max(0.0, self.upload_ms - self.compute_ms)

    @property
    def runnable(self) -> bool:
        """Whether the runtime built here can carry the plan out (a streamed load runs eagerly where streamed graphs
        are not built; its cost is then compute + the whole upload)."""
        return self.prefix_placement in PREFIX_PLACEMENTS_BUILT

    def _blocks_text(self) -> str:
        if not self.streamed_blocks:
            return f"all {self.blocks} blocks resident"
        host = sum(n for label, n in self.host_parts if label.startswith("streamed blocks"))
        return (f"{self.resident_blocks} of {self.blocks} blocks resident, {self.streamed_blocks} streamed through "
                f"{self.slots} slots ({gib(host)} pinned on the host)")

    def _prefix_text(self) -> str:
        tokens = "+".join(map(str, self.shape.prefix_tokens))
        text = {"gpu": "on the GPU (bf16)", "int8": "on the GPU in int8", "host": "in pinned host memory",
                "recompute": "recomputed every step (no cache)"}[self.prefix_placement]
        return f"prefix K/V ({tokens} tokens) {text}"

    def summary(self) -> str:
        """The decisions: blocks, prefix, text encoder, VAE decode."""
        te = ""
        if self.text_encoder is not None:
            needs = f", {gib(self.text_encoder_gpu_bytes)} on the {self.device} while encoding" if (
                self.text_encoder_gpu_bytes) else ""
            te = f"; text encoder {self.text_encoder}{needs}" + (
                f" ({self.text_encoder_suggestion})" if self.text_encoder_suggestion else "")
        return f"transformer {self._blocks_text()}; {self._prefix_text()}{te}; VAE decode {self.vae_decode}"

    def describe(self) -> str:
        """One line for the load log."""
        upload = f", uploads {self.upload_ms:.0f} ms at {self.bandwidth / 1e9:g} GB/s" if self.upload_bytes else ""
        available = f" of {gib(self.available)}" if self.available is not None else ""
        host = f", {gib(self.host_bytes)} host" + (
            f" of {gib(self.host_available)}" if self.host_available is not None else "")
        return (f"{'memory plan' if self.fits else 'smallest memory plan (does not fit)'} for {self.shape.batch}x "
                f"{self.shape.width}x{self.shape.height}: {self.summary()}; needs {gib(self.gpu_bytes)}{available} "
                f"{self.device}{host}; step "
                f"~{self.step_ms:.0f} ms (compute {self.compute_ms:.0f} ms{upload}, an estimate)"
                + "".join(f"; {note}" for note in self.notes))

    def as_dict(self) -> dict:
        """For GET /kvgraph/status and the panel."""
        return {
            "fits": self.fits, "whole": self.whole, "runnable": self.runnable,
            "blocks": self.blocks, "resident_blocks": self.resident_blocks, "streamed_blocks": self.streamed_blocks,
            "slots": self.slots if self.streamed_blocks else 0, "prefix_placement": self.prefix_placement,
            "text_encoder": self.text_encoder, "text_encoder_suggestion": self.text_encoder_suggestion,
            "text_encoder_gpu_bytes": self.text_encoder_gpu_bytes,
            "vae_decode": self.vae_decode,
            "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes, "available_bytes": self.available,
            "host_available_bytes": self.host_available,
            "gpu_parts": {label: n for label, n in self.budget.parts} | {"margin": self.budget.margin},
            "host_parts": dict(self.host_parts),
            "step_ms": round(self.step_ms, 1), "compute_ms": round(self.compute_ms, 1),
            "upload_bytes": self.upload_bytes, "upload_ms": round(self.upload_ms, 1),
            "uploads_overlapped": self.overlapped,
            "bandwidth_bytes_per_s": self.bandwidth, "notes": list(self.notes), "text": self.describe(),
        }


# -- the pieces of one candidate -------------------------------------------------------------------------------------


def _int8_kv_bytes_per_token(d: TransformerDims) -> int:
    return 2 * d.blocks * (d.hidden + d.heads * INT8_SCALE_BYTES)


def _gpu_budget(sizes: ModelSizes, shape: GenerationShape, resident: int, slots: int, placement: str,
                vae_tiled: bool) -> MemoryBudget:
    weights = {"transformer": sizes.other_bytes + sum(sizes.block_bytes[:resident])}
    if sizes.vae is not None:
        weights["VAE"] = sizes.vae.weight_bytes
    weights.update(dict(sizes.extra_weights))
    # The budget of the placement with every block resident (sizes.estimate: the prefix by `placement_bytes`, the
    # one byte model of the placements), then the streamed blocks' slots in place of their weights.
    base = estimate(sizes.dims, dataclasses.replace(shape, prefix_placement=placement), weights, sizes.vae,
                    vae_tiled)
    if resident == sizes.blocks:
        return base
    parts = []
    for label, n in base.parts:
        parts.append((f"transformer weights ({resident} of {sizes.blocks} blocks)" if label == "transformer weights"
                      else label, n))
        if label == "transformer weights":
            streamed = sizes.block_bytes[resident:]
            parts.append((f"streaming slots ({min(slots, len(streamed))} blocks)",
                          min(slots, len(streamed)) * max(streamed)))
    need = sum(n for _, n in parts)
    return dataclasses.replace(base, parts=parts, margin=int(MARGIN_BYTES + MARGIN_FRACTION * need),
                               notes=list(base.notes), host_parts=list(base.host_parts))


def _host_parts(sizes: ModelSizes, shape: GenerationShape, resident: int, placement: str) -> list[tuple[str, int]]:
    parts = []
    if resident < sizes.blocks:
        parts.append((f"streamed blocks ({sizes.blocks - resident})", sum(sizes.block_bytes[resident:])))
    if placement == HOST:
        parts.append(("prefix K/V", _host_prefix_bytes(sizes, shape)))
    if sizes.text_encoder is not None:
        parts.append(("text encoder (held)", sizes.text_encoder.bytes))  # its pinned copy, or its weights on the CPU
    return parts


def compute_ms(sizes: ModelSizes, shape: GenerationShape, placement: str) -> float:
    """The estimated compute of one step (every CFG branch), from STEP_MS."""
    base, one_reference = STEP_MS.get(sizes.precision, STEP_MS["bf16"])
    per_prefix_token = (one_reference - base) / STEP_TOKENS

    def evaluation(target: int, prefix: int) -> float:
        return shape.batch * target / STEP_TOKENS * (base + per_prefix_token * max(0, prefix - STEP_PROMPT_TOKENS))

    target = shape.target_tokens
    if placement == "recompute":  # the prefix rows run too, eagerly, attending to the whole sequence
        total = sum(EAGER_FACTOR * evaluation(p + target, p + target) for p in shape.prefix_tokens)
    else:
        total = sum(evaluation(target, p) for p in shape.prefix_tokens)
        if shape.decode_mode == "eager":
            total *= EAGER_FACTOR
    if placement == "int8":  # read the int8 rows and scales, write and read the bf16 working buffer
        per_token = _int8_kv_bytes_per_token(sizes.dims) + 2 * kv_bytes_per_token(sizes.dims)
        total += sum(shape.batch * p for p in shape.prefix_tokens) * per_token / DEVICE_BYTES_PER_S * 1e3
    return total


def upload_bytes(sizes: ModelSizes, shape: GenerationShape, resident: int, placement: str) -> int:
    """Bytes copied from the host each step: the streamed blocks once per CFG branch, a host prefix once."""
    total = shape.branches * sum(sizes.block_bytes[resident:])
    if placement == HOST:
        total += _host_prefix_bytes(sizes, shape)
    return total


def _host_prefix_bytes(sizes: ModelSizes, shape: GenerationShape) -> int:
    """A host prefix's pinned rows, every branch (`placement_bytes`' host side)."""
    return sum(placement_bytes(sizes.dims, shape.batch, p, shape.target_tokens, HOST)[1]
               for p in shape.prefix_tokens)


def _candidate(sizes, shape, resident, slots, placement, vae_tiled, bandwidth, available, host_available,
               streamed_graphs: bool) -> MemoryPlan:
    overlapped = streamed_graphs or resident == sizes.blocks
    shape = dataclasses.replace(shape, prefix_placement=placement)
    if not overlapped:
        # Streamed blocks without graphs: every step runs eagerly (no graph buffers or pool, an eager step's memory).
        shape = dataclasses.replace(shape, decode_mode="eager")
    return MemoryPlan(
        blocks=sizes.blocks, resident_blocks=resident, slots=slots, prefix_placement=placement, overlapped=overlapped,
        vae_decode="none" if sizes.vae is None else ("tiled" if vae_tiled else "whole"),
        budget=_gpu_budget(sizes, shape, resident, slots, placement, vae_tiled),
        host_parts=_host_parts(sizes, shape, resident, placement),
        compute_ms=compute_ms(sizes, shape, placement), upload_bytes=upload_bytes(sizes, shape, resident, placement),
        bandwidth=bandwidth, shape=shape, available=available, host_available=host_available)


def _fits(plan: MemoryPlan, available: int, host_available: int | None) -> bool:
    return plan.gpu_bytes <= available and (host_available is None or plan.new_host_bytes <= host_available)


# -- the text encoder --------------------------------------------------------------------------------------------------


def text_encoder_placement(te: TextEncoderSize, tokens: int, available: int, sampling_bytes: int | None = None) -> str:
    """Where the text encoder runs an encode of `tokens` with `available` GPU bytes: beside the request's
    `sampling_bytes` where both fit (None: not considered, the encode decides alone), alone while it encodes, streamed
    by layer (its outside part and TE_SLOTS layers), or on the CPU."""
    if sampling_bytes is not None and sampling_bytes + te.bytes <= available:
        return TE_GPU  # stays next to the transformer and its graphs
    for placement in (TE_OFFLOAD, TE_STREAMED):  # alone on the GPU (ComfyUI unloads the transformer for it), streamed
        if te.gpu_bytes(placement, tokens) <= available:
            return placement
    return TE_CPU


def _text_encoder(plan: MemoryPlan, te: TextEncoderSize, available: int) -> tuple[str, str | None]:
    tokens = plan.shape.batch * max(plan.shape.prefix_tokens)  # an upper bound of the encoder's own tokens
    placement = text_encoder_placement(te, tokens, available, plan.gpu_bytes)
    if te.precision == "int8" or placement == TE_GPU:
        return placement, None
    smaller = dataclasses.replace(
        te, bytes=int(te.bytes * INT8_TEXT_ENCODER_FRACTION), precision="int8",
        largest_layer=None if te.largest_layer is None else int(te.largest_layer * INT8_TEXT_ENCODER_FRACTION),
        outside=None if te.outside is None else int(te.outside * INT8_TEXT_ENCODER_FRACTION))
    better = text_encoder_placement(smaller, tokens, available, plan.gpu_bytes)
    if TE_PLACEMENTS.index(better) < TE_PLACEMENTS.index(placement):
        return placement, f"an int8 text encoder file (about {gib(smaller.bytes)}) would run '{better}'"
    return placement, None


# -- the planner -----------------------------------------------------------------------------------------------------


def plan_memory(sizes: ModelSizes, shape: GenerationShape, available: int, host_available: int | None = None, *,
                bandwidth: float = DEFAULT_H2D_BYTES_PER_S, slots: int = DEFAULT_SLOTS,
                placements: tuple[str, ...] = PREFIX_PLACEMENTS, stream: bool = True,
                device: str = "GPU", streamed_graphs: bool | None = None) -> MemoryPlan:
    """The fastest plan of `shape` that fits `available` GPU bytes and `host_available` host bytes (None: the host is
    not checked), or the smallest plan with `fits` False when none does. `placements`: the prefix placements to
    consider (a forced one, or those the runtime has built); `stream=False` keeps every block resident (a CPU, where
    the host is the device). `streamed_graphs`: whether streamed blocks replay inside the decode graph, their
    uploads overlapped (None: STREAMED_GRAPH_BUILT, what the runtime here does); without, a streamed plan steps
    eagerly and its uploads add to the compute."""
    if available is None or available < 0:
        raise ValueError(f"available: {available!r}: expected the GPU bytes the request may use")
    if slots < 1:
        raise ValueError(f"slots: {slots!r}: expected at least 1")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth: {bandwidth!r}: expected bytes per second above 0")
    unknown = [p for p in placements if p not in PREFIX_PLACEMENTS]
    if unknown or not placements:
        raise ValueError(f"placements: {placements!r}: expected some of {PREFIX_PLACEMENTS}")

    graphs = STREAMED_GRAPH_BUILT if streamed_graphs is None else streamed_graphs

    def candidate(resident: int, placement: str, vae_tiled: bool = True) -> MemoryPlan:
        plan = _candidate(sizes, shape, resident, slots, placement, vae_tiled and sizes.vae is not None, bandwidth,
                          available, host_available, graphs)
        plan.device = device
        return plan

    def most_resident(placement: str) -> MemoryPlan | None:
        """The most resident blocks that fit the GPU with `placement`, if that fits the host too. Every block first
        (a whole load may replay graphs a streamed one cannot, so it is not the end of a monotone range); below
        that the GPU need grows with the resident blocks and the host need shrinks, so no fewer could fit the host
        where these do not."""
        plan = candidate(sizes.blocks, placement)
        if plan.gpu_bytes > available:
            if not stream or candidate(0, placement).gpu_bytes > available:
                return None
            low, high = 0, sizes.blocks - 1
            while low < high:
                mid = (low + high + 1) // 2
                if candidate(mid, placement).gpu_bytes <= available:
                    low = mid
                else:
                    high = mid - 1
            plan = candidate(low, placement)
        return plan if _fits(plan, available, host_available) else None

    fitting = [plan for plan in map(most_resident, placements) if plan is not None]
    if not fitting:
        smallest = min((candidate(0 if stream else sizes.blocks, p) for p in placements),
                       key=lambda p: (p.gpu_bytes, p.host_bytes))
        smallest.fits = False
        if sizes.text_encoder is not None:
            smallest.text_encoder = TE_CPU
        return smallest
    # Recomputing the prefix every step is the last resort (issue's rule, and what a user expects of a cache): it is
    # taken only where no plan with a kept prefix fits, even where its estimate is lower.
    fitting = [plan for plan in fitting if plan.prefix_placement != "recompute"] or fitting
    best = min(fitting, key=lambda p: (round(p.step_ms, 2), -p.resident_blocks,
                                       PREFIX_PLACEMENTS.index(p.prefix_placement)))
    if sizes.vae is not None:
        whole = candidate(best.resident_blocks, best.prefix_placement, vae_tiled=False)
        if _fits(whole, available, host_available):
            best = whole
        else:
            best.notes.append(f"the VAE decode is tiled: a whole one needs {gib(whole.gpu_bytes)}")
    if sizes.text_encoder is not None:
        best.text_encoder, best.text_encoder_suggestion = _text_encoder(best, sizes.text_encoder, available)
        best.text_encoder_gpu_bytes = sizes.text_encoder.gpu_bytes(
            best.text_encoder, best.shape.batch * max(best.shape.prefix_tokens))
    return best


__all__ = [
    "DEFAULT_H2D_BYTES_PER_S", "DEFAULT_SLOTS", "TE_AUTO", "MemoryPlan", "ModelSizes", "PREFIX_PLACEMENTS",
    "PREFIX_PLACEMENTS_BUILT", "STEP_MS", "STREAMED_GRAPH_BUILT", "TE_CPU", "TE_GPU", "TE_OFFLOAD", "TE_PLACEMENTS",
    "TE_STREAMED", "TextEncoderSize", "compute_ms", "default_bandwidth", "plan_memory", "request_shape",
    "text_encoder_placement",
    "upload_bytes",
]
