"""What a generation needs on its device, worked out from the model's config before anything is allocated.

The estimate adds up, for one request:
- the weights that must be on the device together: the transformer, the VAE, and the text encoder where its
  placement keeps it there;
- the prefix K/V of every CFG branch: 2 x blocks x heads x head_dim values per prefix token and batch row (0.5 MiB
  per token in bf16 at full size). On the graph path they are written straight into the graph entry's buffers;
- the sampler's latent-sized tensors (noise, latents, predictions: LATENT_COPIES), which grow with the batch;
- the decoded images the request keeps on the device until it ends (the command line's images, on the CPU);
- each graph entry's other static buffers: the target rows of K/V for every block, the target hidden state, the
  timestep and the RoPE tables (graph_runtime/decode/capture.py); a short prefix's captured pass adds its own
  inputs (decode/step.py);
- the graph pool, which keeps one decode step's activations (below) for as long as a graph is held;
- the largest eager phase after that: the prefill, or the VAE decode of one image at the output size (sequential,
  so they share the allocator's cache; the graph pool is private to the graphs, so it is not shared with them);
- a margin (MARGIN_BYTES + MARGIN_FRACTION of the rest) for what is not modelled: cuBLAS / cuDNN workspaces, the
  allocator's rounding and splitting of blocks, and the small tensors (embeddings, modulation rows).

The device is a CUDA GPU or the CPU: on the CPU the same budget is checked against the host's available memory
(`free.host_available_bytes`). Every size is computed from the model's own config and tensors (int8 weights are sized by
their real bytes), and the formulas are checked in tests/test_memory.py against a trace of the real code's
allocations and on a GPU (tests/gpu/test_gpu_memory.py; the figures are in docs/memory.md). `device_free_bytes` honours
`torch.cuda.set_per_process_memory_fraction`, so a large card can stand in for a small one. Refusing what does not
fit, and saying what would, is graph_runtime/memory/budget.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .. import free_memory as free
from ..decode import DecodeEngine, store_bytes
from ..decode.prefix_store import GPU, HOST, RECOMPUTE
from ..report import GiB, MiB, compute_dtype, gib, module_bytes  # noqa: F401 - re-exported as memory.<name>


# One decode step's activations per target token, as tensors of the activation dtype: while the MLP runs, the
# residual stream, the handed-on MLP residual, the normed input, q, k, v, the attention output and its projection
# are alive (8 x hidden width) next to the MLP's gate, up and SwiGLU product (3 x MLP width). A trace of the step's
# allocations at full size gives exactly this (tests/test_memory.py), and so does a GPU's peak (docs/memory.md).
STEP_HIDDEN_TENSORS = 8
STEP_MLP_TENSORS = 3

# The Qwen-Image-2.1 VAE decoder, run without the temporal feature cache (graph_runtime/vae_decode.py), peaks at its
# full-resolution stage: per output pixel about 9 tensors of `decoder_base_dim` channels in the VAE's dtype and 2 in
# fp32 (its RMS norms), plus the output. A trace of the full-size VAE in bf16 and in fp32 agrees with this to a
# fraction of a percent (tests/test_memory.py; the figures are in docs/memory.md).
VAE_DTYPE_TENSORS = 9
VAE_FP32_TENSORS = 2
# A tiled decode (diffusers' 256 px tiles with their temporal cache) holds one tile's activations, which the same
# trace puts at 1.7x the cache-free decode per pixel (2.0x with three res blocks per stage), plus the output.
VAE_TILE_PIXELS = 256 * 256
VAE_TILE_CACHE_FACTOR = 2.0

# What to have free before encoding one image with the VAE, per input pixel: a rough figure (the ComfyUI nodes have
# always asked for this much), not traced like the decoder's.
VAE_ENCODE_BYTES_PER_PIXEL = 600

# The sampler's latent-sized tensors, in fp32 (the Euler update's precision) per latent value: the start noise kept
# for the run, the current latents, the Euler update's result, and one prediction per CFG branch. Negligible at a
# batch of one (0.5% of a full-size step's activations), they are what grows with a large batch (tests/test_memory.py
# traces a whole sampling run).
LATENT_COPIES = 3

MARGIN_BYTES = 256 * MiB
MARGIN_FRACTION = 0.02


# -- model dimensions ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerDims:
    """What the transformer's memory depends on, from its config (and its tensors, for the int8 case)."""

    blocks: int
    heads: int
    head_dim: int
    mlp_hidden: int
    in_channels: int
    out_channels: int
    activation_bytes: int
    int8: bool = False  # block Linears hold int8 weights (W8A8 GEMMs need scratch for quantized activations)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @classmethod
    def from_config(cls, config, dtype: torch.dtype = torch.bfloat16, int8: bool = False) -> "TransformerDims":
        get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
        heads, head_dim = int(get("num_attention_heads")), int(get("attention_head_dim"))
        in_channels = int(get("in_channels"))
        return cls(blocks=int(get("num_layers")), heads=heads, head_dim=head_dim,
                   mlp_hidden=heads * head_dim * int(get("mlp_ratio", 3)), in_channels=in_channels,
                   out_channels=int(get("out_channels") or in_channels), activation_bytes=dtype.itemsize, int8=int8)

    @classmethod
    def of(cls, transformer: torch.nn.Module) -> "TransformerDims":
        int8 = any(p.dtype == torch.int8 for p in transformer.transformer_blocks.parameters())
        return cls.from_config(transformer.config, compute_dtype(transformer), int8=int8)

    def int8_weight_bytes(self, weight_bytes: int) -> int:
        """The same transformer with its block Linears in int8 (one byte per weight, an fp32 scale per row)."""
        if self.int8:
            return weight_bytes
        h, m = self.hidden, self.mlp_hidden
        values = self.blocks * (4 * h * h + 3 * h * m)
        rows = self.blocks * (4 * h + 2 * m + h)
        return weight_bytes - values * (self.activation_bytes - 1) + rows * 4


@dataclass(frozen=True)
class VaeDims:
    decoder_dim: int
    out_channels: int
    activation_bytes: int
    weight_bytes: int
    spatial_ratio: int = 16

    @classmethod
    def of(cls, vae: torch.nn.Module) -> "VaeDims":
        config = vae.config
        return cls(decoder_dim=int(config.decoder_base_dim or config.base_dim),
                   out_channels=int(config.out_channels), activation_bytes=compute_dtype(vae).itemsize,
                   weight_bytes=module_bytes(vae),
                   spatial_ratio=int(getattr(config, "scale_factor_spatial", None) or 16))

    @classmethod
    def standard(cls, dtype: torch.dtype = torch.bfloat16) -> "VaeDims":
        """The published Qwen-Image-2.1 VAE (diffusers' default config), for a budget made before a VAE is loaded."""
        from diffusers import AutoencoderKLQwenImage21

        with torch.device("meta"):
            vae = AutoencoderKLQwenImage21()
        params = sum(t.numel() for t in (*vae.parameters(), *vae.buffers()))
        return dataclasses.replace(cls.of(vae), activation_bytes=dtype.itemsize, weight_bytes=params * dtype.itemsize)


# -- the pieces ----------------------------------------------------------------------------------------------------


def kv_bytes_per_token(d: TransformerDims) -> int:
    """K and V of one token in every block: 0.5 MiB at full size in bf16."""
    return 2 * d.blocks * d.hidden * d.activation_bytes


def step_activation_bytes(d: TransformerDims, tokens: int) -> int:
    """One decode step's peak activations for `tokens` target rows (batch included), and its output."""
    per_token = (STEP_HIDDEN_TENSORS * d.hidden + STEP_MLP_TENSORS * d.mlp_hidden) * d.activation_bytes
    if d.int8:
        # A W8A8 GEMM quantizes its input (one byte per value, plus a rotated copy for ConvRot) and may accumulate
        # into int32 before scaling: the widest one, gate/up, is counted.
        per_token += d.hidden * (1 + d.activation_bytes) + d.mlp_hidden * 4
    return tokens * (per_token + d.out_channels * d.activation_bytes)


def entry_buffer_bytes(d: TransformerDims, batch: int, prefix: int, target: int) -> int:
    """A graph entry's static buffers other than the prefix rows of K/V: target K/V rows, hidden, timestep, RoPE."""
    rope = 2 * target * (d.head_dim // 2) * 4
    return batch * (target * kv_bytes_per_token(d) + target * d.in_channels * d.activation_bytes
                    + d.activation_bytes) + rope


def _is_captured(prefix: int) -> bool:
    """Whether a prefix of this length is captured (its pass replays from the graph pool): decode/engine.py."""
    return DecodeEngine.captures_prefix_pass(prefix)


def prefix_graph_bytes(d: TransformerDims, batch: int, prefix: int) -> int:
    """The static inputs of a short prefix's captured pass (rows, modulation, RoPE, block-causal mask)."""
    if not _is_captured(prefix):
        return 0
    return (batch * (prefix + 4) * d.hidden * d.activation_bytes + 2 * prefix * (d.head_dim // 2) * 4
            + batch * prefix * prefix)


def placement_bytes(d: TransformerDims, batch: int, prefix: int, target: int, placement: str,
                    graphs: bool = True) -> tuple[int, int]:
    """`(device bytes, host bytes)` one branch's prefix K/V take under `placement` (decode/prefix_store.py), with
    the graph entry's other static buffers when `graphs`:

    - gpu: every block's K and V rows, prefix and target (0.5 MiB per token at full size in bf16);
    - int8: one byte per value plus an fp32 scale per token and head (about 0.27 MiB per prefix token), and one
      working K and V buffer of `prefix + target` rows for all blocks;
    - host: the prefix rows in pinned host memory (the gpu figure, on the host), two working buffers on the device;
    - recompute: nothing kept (every step runs the whole sequence: `recompute_step_bytes`).
    """
    device, host = store_bytes(placement, batch, prefix, target, d.heads, d.head_dim, d.blocks, d.activation_bytes)
    if graphs and placement != RECOMPUTE:
        # The entry's hidden, timestep and RoPE buffers; its target K/V rows are in `device` already.
        device += entry_buffer_bytes(d, batch, prefix, target) - batch * target * kv_bytes_per_token(d)
        if placement == GPU:
            device += prefix_graph_bytes(d, batch, prefix)  # a stored prefix's pass is never captured
    elif placement == GPU:
        device -= batch * target * kv_bytes_per_token(d)  # an eager request keeps only its prefix rows
    return device, host


def recompute_step_bytes(d: TransformerDims, batch: int, prefix: int, target: int) -> int:
    """A step without a prefix cache: the whole joint sequence's activations, its prefix rows, and its block-causal
    mask over all rows: the boolean mask and the additive bias in the activation dtype SDPA turns it into (a trace of
    the tiny model's run shows both alive, tests/test_prefix_placement.py)."""
    rows = batch * (prefix + target)
    return (step_activation_bytes(d, rows) + batch * prefix * d.hidden * d.activation_bytes
            + (prefix + target) ** 2 * (1 + d.activation_bytes))


def prefill_bytes(d: TransformerDims, batch: int, prefix: int, target: int) -> int:
    """The prefill's transient memory: the joint rows it scatters (and their sources), the prefix pass's
    activations and its mask."""
    rows = 2 * batch * (prefix + target) * d.hidden * d.activation_bytes
    return rows + step_activation_bytes(d, batch * prefix) + batch * prefix * prefix


def eager_step_bytes(d: TransformerDims, batch: int, prefix: int, target: int) -> int:
    """An eager decode step: the activations plus one block's K and V concatenated with the prefix."""
    return step_activation_bytes(d, batch * target) + 2 * batch * (prefix + target) * d.hidden * d.activation_bytes


def vae_decode_bytes(v: VaeDims, width: int, height: int, tiled: bool = False) -> int:
    """One image's VAE decode at `width` x `height` pixels (the nodes and the CLI decode a batch one at a time)."""
    per_pixel = v.decoder_dim * (VAE_DTYPE_TENSORS * v.activation_bytes + VAE_FP32_TENSORS * 4)
    output = width * height * v.out_channels * (v.activation_bytes + 4)  # the decoded image and its fp32 copy
    if tiled:
        return int(per_pixel * VAE_TILE_CACHE_FACTOR * min(VAE_TILE_PIXELS, width * height)) + 2 * output
    return per_pixel * width * height + output


def latent_bytes(d: TransformerDims, batch: int, target: int, branches: int = 1) -> int:
    """The sampler's latent-sized tensors for `batch` x `target` tokens (see LATENT_COPIES), in fp32."""
    return (LATENT_COPIES + branches - 1) * batch * target * d.in_channels * 4


# ComfyUI's IMAGE: float32 RGB; its MASK: float32, one channel.
IMAGE_BYTES_PER_PIXEL = 12
MASK_BYTES_PER_PIXEL = 4


def decoded_images_bytes(width: int, height: int, batch: int, bytes_per_pixel: int) -> int:
    """A batch of decoded images kept together: `bytes_per_pixel` is 3 for 8-bit RGB (PIL), 12 for ComfyUI's float32
    IMAGE."""
    return width * height * batch * bytes_per_pixel


def vae_encode_bytes(width: int, height: int) -> int:
    """The memory to have free before encoding one `width` x `height` px image (images are encoded one at a time)."""
    return width * height * VAE_ENCODE_BYTES_PER_PIXEL


# -- the budget ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationShape:
    """The settings memory depends on: output size, batch, prefix tokens per CFG branch, decode mode."""

    width: int
    height: int
    batch: int = 1
    prefix_tokens: tuple[int, ...] = (128,)
    decode_mode: str = "auto"
    prefix_placement: str = GPU  # where the prefix K/V live (decode/prefix_store.py); never "auto" here
    # Bytes per pixel of the decoded images the request keeps on this device until it ends (the command line's
    # images, on the CPU); 0 where they go elsewhere (ComfyUI's VAE decode node checks its own batch).
    decoded_bytes_per_pixel: int = 0

    @property
    def target_tokens(self) -> int:
        return (self.width // 16) * (self.height // 16)

    @property
    def branches(self) -> int:
        return len(self.prefix_tokens)


@dataclass
class MemoryBudget:
    """What one request needs on its device: named parts (bytes) plus the margin."""

    parts: list[tuple[str, int]]
    margin: int
    vae_tiled: bool = False
    notes: list[str] = field(default_factory=list)
    plan: object = None  # the memory plan the request runs under (plan.py `MemoryPlan`), where one was made
    host_parts: list[tuple[str, int]] = field(default_factory=list)  # held in host memory (a host prefix's rows)
    prefix_placement: str = GPU

    @property
    def host_total(self) -> int:
        return sum(n for _, n in self.host_parts)

    @property
    def need(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def total(self) -> int:
        return self.need + self.margin

    def part(self, label_start: str) -> int:
        return sum(n for label, n in self.parts if label.startswith(label_start))

    def describe(self) -> str:
        items = ", ".join(f"{label} {n / GiB:.2f}" for label, n in self.parts if n)
        host = "".join(f", and {label} {n / GiB:.2f} GiB on the host" for label, n in self.host_parts if n)
        return f"{gib(self.total)} ({items}, margin {self.margin / GiB:.2f} GiB){host}"

    def as_dict(self) -> dict:
        return {"total_bytes": self.total, "margin_bytes": self.margin, "vae_tiled": self.vae_tiled,
                "parts": {label: n for label, n in self.parts}, "notes": list(self.notes),
                "prefix_placement": self.prefix_placement, "host_parts": {label: n for label, n in self.host_parts},
                "plan": self.plan.as_dict() if self.plan is not None else None}


def estimate(dims: TransformerDims, shape: GenerationShape, weights: dict[str, int], vae: VaeDims | None = None,
             vae_tiled: bool = False) -> MemoryBudget:
    """The budget of one request. `weights`: label -> bytes of every model that must be on the device during it
    (the transformer's and the VAE's, and the text encoder's where its placement keeps it there)."""
    batch, target = shape.batch, shape.target_tokens
    placement = shape.prefix_placement
    if placement != GPU:
        return _estimate_placed(dims, shape, weights, vae, vae_tiled)
    kv = kv_bytes_per_token(dims)
    parts = [(f"{label} weights", n) for label, n in weights.items()]
    branches = f", {shape.branches} CFG branches" if shape.branches > 1 else ""
    parts.append((f"prefix K/V ({'+'.join(map(str, shape.prefix_tokens))} tokens{branches})",
                  sum(batch * p * kv for p in shape.prefix_tokens)))
    parts.append((f"latents (batch {batch})", latent_bytes(dims, batch, target, shape.branches)))
    if shape.decoded_bytes_per_pixel:
        parts.append((f"decoded images ({batch}x {shape.width}x{shape.height})",
                      decoded_images_bytes(shape.width, shape.height, batch, shape.decoded_bytes_per_pixel)))
    eager_phases = [prefill_bytes(dims, batch, p, target) for p in shape.prefix_tokens]
    if vae is not None:
        eager_phases.append(vae_decode_bytes(vae, shape.width, shape.height, vae_tiled))
    if shape.decode_mode == "eager":
        eager_phases += [eager_step_bytes(dims, batch, p, target) for p in shape.prefix_tokens]
    else:
        parts.append(("graph buffers", sum(entry_buffer_bytes(dims, batch, p, target)
                                           + prefix_graph_bytes(dims, batch, p) for p in shape.prefix_tokens)))
        # Graphs of every branch (and the short prefix passes) are captured into one pool and replayed one at a
        # time, so the pool holds the largest of them.
        short = [p for p in shape.prefix_tokens if _is_captured(p)]
        parts.append(("graph pool", max([step_activation_bytes(dims, batch * target)]
                                        + [step_activation_bytes(dims, batch * p) for p in short])))
    label = "largest eager phase (" + ("tiled VAE decode" if vae_tiled else "VAE decode") + " or prefill"
    parts.append((label + (" or eager steps)" if shape.decode_mode == "eager" else ")"), max(eager_phases)))
    need = sum(n for _, n in parts)
    return MemoryBudget(parts=parts, margin=int(MARGIN_BYTES + MARGIN_FRACTION * need), vae_tiled=vae_tiled)


def _estimate_placed(dims: TransformerDims, shape: GenerationShape, weights: dict[str, int], vae: VaeDims | None,
                     vae_tiled: bool) -> MemoryBudget:
    """The budget with the prefix K/V placed int8, on the host or not kept (`recompute`): `placement_bytes` per
    branch instead of the bf16 prefix and the entries' buffers."""
    batch, target, placement = shape.batch, shape.target_tokens, shape.prefix_placement
    graphs = shape.decode_mode != "eager" and placement != RECOMPUTE
    placed = [placement_bytes(dims, batch, p, target, placement, graphs) for p in shape.prefix_tokens]
    parts = [(f"{label} weights", n) for label, n in weights.items()]
    branches = f", {shape.branches} CFG branches" if shape.branches > 1 else ""
    tokens = f"{'+'.join(map(str, shape.prefix_tokens))} tokens{branches}"
    if placement != RECOMPUTE:
        parts.append((f"prefix K/V {placement} ({tokens}; working buffers" + (" and graph buffers)" if graphs else ")"),
                      sum(device for device, _ in placed)))
    parts.append((f"latents (batch {batch})", latent_bytes(dims, batch, target, shape.branches)))
    if shape.decoded_bytes_per_pixel:
        parts.append((f"decoded images ({batch}x {shape.width}x{shape.height})",
                      decoded_images_bytes(shape.width, shape.height, batch, shape.decoded_bytes_per_pixel)))
    if graphs:
        parts.append(("graph pool", step_activation_bytes(dims, batch * target)))
    phases = [vae_decode_bytes(vae, shape.width, shape.height, vae_tiled)] if vae is not None else []
    if placement == RECOMPUTE:
        phases += [recompute_step_bytes(dims, batch, p, target) for p in shape.prefix_tokens]
        label = "largest eager phase (whole-sequence steps" + (" or VAE decode)" if vae is not None else ")")
    else:
        phases += [prefill_bytes(dims, batch, p, target) for p in shape.prefix_tokens]
        if not graphs:
            phases += [step_activation_bytes(dims, batch * target)]
        label = "largest eager phase (prefill" + (" or VAE decode" if vae is not None else "") + (
            " or eager steps)" if not graphs else ")")
    parts.append((label, max(phases)))
    need = sum(n for _, n in parts)
    host = [(f"pinned prefix K/V ({tokens})", sum(h for _, h in placed))] if placement == HOST else []
    return MemoryBudget(parts=parts, margin=int(MARGIN_BYTES + MARGIN_FRACTION * need), vae_tiled=vae_tiled,
                        host_parts=host, prefix_placement=placement)


def fitting_estimate(dims, shape, weights, vae, available: int) -> MemoryBudget:
    """The budget with a whole VAE decode, or with a tiled one when a whole one does not fit (how vae_decode
    decides): the least the request needs."""
    whole = estimate(dims, shape, weights, vae)
    if vae is None or whole.total <= available:
        return whole
    tiled = estimate(dims, shape, weights, vae, vae_tiled=True)
    tiled.notes.append(f"the VAE decode is tiled: a whole one needs {gib(whole.total)}")
    return tiled


# -- what the device has -------------------------------------------------------------------------------------------


def available_bytes(device, engines=()) -> int | None:
    """What eager work on `device` can allocate: `eager_free_bytes` on CUDA (`engines`: the loaded models' decode
    engines, whose graph pools it leaves out), the host's available memory on the CPU, None elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return eager_free_bytes(device, engines)
    if device.type == "cpu":
        return free.host_available_bytes()
    return None


def eager_free_bytes(device, engines=()) -> int | None:
    """`device_free_bytes` for eager work (a prefill, a VAE decode): the graph pools of `engines` (every loaded
    model's, as the caller that holds them passes them) left out."""
    return free.device_free_bytes(device, exclude=graph_pool_bytes(engines))


def graph_bytes_held(engines) -> int:
    """The static buffers the engines' graph managers hold (what releasing their graphs would free)."""
    return sum(engine.bytes_held() for engine in engines)


def graph_pool_bytes(engines) -> int:
    """Memory the engines' captured graphs hold in their private pools (reserved, reusable only by them)."""
    return sum(engine.pool_bytes() for engine in engines)
