"""The control stream inside the pack's prefill and decode step.

Native semantics (ComfyUI's Qwen-Image-2.1 with the Fun ControlNet, which runs the whole joint sequence every step
while a ControlNet is active):
- the stream starts from the embedded joint sequence `x`: `before_proj(joint) + x`, `joint` = embedded control tokens
  in the target rows, zeros in the prefix rows;
- control block j runs on the stream with the base model's modulation, RoPE and block-causal attention, and
  `strength * after_proj(stream)` is added to *every* row of the base sequence after base block `layers[j]`: the
  prefix (text and reference) rows too, so the base model's prefix K/V after the first injected block differ from
  those of a run without the ControlNet.

Prefix rows never attend to target rows and are modulated from t = 0, so the stream's prefix rows, and the base
prefix rows with their control added, are the same at every step. The pack therefore prefills a *controlled*
prefix once (`ControlledPrefix.run`: base K/V with the control added to the prefix rows, and each control block's
prefix K/V), and each decode step recomputes the target rows only (`BlockResiduals`): the control blocks run on the
target rows against their cached prefix K/V, and each residual is added after its base block. Steps outside the
ControlNet's start/end range use the plain prefix and the plain step, as native does (its prefix cache is used there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..decode.attention import PrefixMask
from ..decode.step import TargetDecodeBlock
from ..placement import block_on_device
from .model import CONTROL_CHANNELS, FunControlNet

# Counted (and logged once) for every controlled prefill: the pass with the control stream is not captured.
CONTROL_PREFIX_EAGER = "a ControlNet prefix pass (not captured: it runs once per prompt)"


def settle(x: torch.Tensor, pending) -> torch.Tensor:
    """`x` with a block's handed-on MLP residual added (the step adds it inside the next norm otherwise), rounded
    once as the native block's in-place `addcmul_` rounds it."""
    if pending is None:
        return x
    delta, gate = pending
    x = torch.addcmul(x, delta, gate.tanh())
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


def add_residual(x: torch.Tensor, skip: torch.Tensor, strength: torch.Tensor) -> torch.Tensor:
    """`x + strength * skip` in fp32, rounded once to `x`'s dtype: what native's `add_(skip, alpha=strength)`
    computes, with the strength a (graph input) fp32 tensor instead of a Python number."""
    return torch.addcmul(x.float(), skip.float(), strength).to(x.dtype)


def _decode_blocks(net: FunControlNet, kernels: bool) -> list[TargetDecodeBlock]:
    # Kept on the net: wrappers are cheap, but a captured step must see the same modules every warm-up and capture.
    cache = net.__dict__.setdefault("_decode_blocks", {})
    if kernels not in cache:
        cache[kernels] = [TargetDecodeBlock(block, kernels) for block in net.blocks]
    return cache[kernels]


@dataclass
class BlockResiduals:
    """What a controlled decode step reads besides the base step's inputs: the net, the target's control tokens, the
    strength and each control block's K/V (`static_kv`: `[B, P + T, H, D]` buffers, prefix rows filled; else the
    request's `[B, P, H, D]` prefix rows). The decode step finds it as `DecodeInputs.extra["block_residuals"]`."""

    net: FunControlNet
    layers: tuple[int, ...]
    tokens: torch.Tensor  # [B, T, 129], model dtype
    strength: torch.Tensor  # [1], fp32
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    static_kv: bool = False
    _sources: list = field(default_factory=list, repr=False)

    # -- what the graphs ask -------------------------------------------------------------------------------------

    def graph_key(self) -> tuple:
        """The part of a graph key a controlled step adds: the control stream is extra captured work."""
        return (*self.net.weights_key(), self.layers)

    def static_bytes(self, batch: int, prefix_len: int, target_tokens: int, dtype: torch.dtype) -> int:
        heads, head_dim = self.net.blocks[0].attn.heads, self.net.head_dim
        kv = 2 * len(self.k) * batch * (prefix_len + target_tokens) * heads * head_dim
        return (kv + batch * target_tokens * CONTROL_CHANNELS) * dtype.itemsize + 4

    def static_copy(self, prefix_len: int, target_tokens: int) -> "BlockResiduals":
        """Zeroed static buffers of this request's shapes, for a graph entry (allocated outside inference mode)."""
        with torch.inference_mode(False):
            kv = lambda t: t.new_zeros((t.shape[0], prefix_len + target_tokens, *t.shape[2:]))  # noqa: E731
            return BlockResiduals(self.net, self.layers, torch.zeros_like(self.tokens),
                                  torch.zeros_like(self.strength), [kv(t) for t in self.k], [kv(t) for t in self.v],
                                  static_kv=True)

    def load_into(self, static: "BlockResiduals", prefix_len: int) -> None:
        """Copy this request's control into a graph entry's static buffers: tokens and strength every step (small),
        the control blocks' prefix K/V only when they are other tensors than the buffers hold."""
        static.tokens.copy_(self.tokens)
        static.strength.copy_(self.strength)
        sources = [*self.k, *self.v]
        held = [ref() for ref in static._sources]
        if len(held) == len(sources) and all(a is b for a, b in zip(held, sources)):
            return
        for dst, src in zip([*static.k, *static.v], sources):
            dst[:, :prefix_len].copy_(src)
        static._sources = [weakref.ref(t) for t in sources]

    # -- the decode step's hook ----------------------------------------------------------------------------------

    def start(self, step, x: torch.Tensor, modulation: torch.Tensor, inputs) -> "_StepRun":
        """Begin one decode step: the stream's target rows from the embedded target rows `x`."""
        net = self.net
        blocks = _decode_blocks(net, step.kernels)
        step.use_attention(blocks, x.device, x.dtype)  # the kernel the step's own blocks run (FlashAttention-3 or SDPA)
        stream = net.before_proj(net.control_img_in(self.tokens)) + x
        return _StepRun(self, blocks, stream, modulation, inputs)


class _StepRun:
    """One decode step's control stream: `after_block(i, x, pending)` after each base block."""

    def __init__(self, residuals: BlockResiduals, blocks, stream, modulation, inputs):
        self.residuals, self.blocks, self.stream = residuals, blocks, stream
        self.modulation, self.inputs = modulation, inputs
        self.index = {layer: j for j, layer in enumerate(residuals.layers)}

    def after_block(self, i: int, x: torch.Tensor, pending):
        j = self.index.get(i)
        if j is None:
            return x, pending
        r, inputs = self.residuals, self.inputs
        stream, handed = self.blocks[j](self.stream, None, self.modulation, inputs.cos, inputs.sin, r.k[j], r.v[j],
                                        inputs.prefix_len, r.static_kv, inputs.attn_mask)
        self.stream = settle(stream, handed)
        return add_residual(settle(x, pending), r.net.after_proj[j](self.stream), r.strength), None


@dataclass
class ControlledPrefix:
    """One request branch's ControlNet before its prefill: the net (on the model's device), the branch's control
    tokens `[B, T, 129]` and the strength. `run` is the prefix pass with the control stream; it returns the
    `BlockResiduals` the branch's decode steps read."""

    net: FunControlNet
    layers: tuple[int, ...]
    tokens: torch.Tensor
    strength: float

    prefill_reason = CONTROL_PREFIX_EAGER

    def run(self, step, inputs) -> BlockResiduals:
        """The prefix pass (`PrefixInputs`: base K/V land in `inputs.k` / `inputs.v`) with the control stream beside
        the base blocks: each control block's prefix K/V kept, its residual added to the base prefix rows."""
        net, layers = self.net, self.layers
        x = inputs.hidden
        batch, prefix_len = x.shape[0], x.shape[1]
        attn = net.blocks[0].attn
        shape = (batch, prefix_len, attn.heads, net.head_dim)
        k = [x.new_empty(shape) for _ in layers]
        v = [x.new_empty(shape) for _ in layers]
        strength = torch.full((1,), float(self.strength), dtype=torch.float32, device=x.device)
        base = step.prefix_blocks()
        control = _decode_blocks(net, True)
        # As the plain prefix pass (`run_prefix_blocks`): the step's kernel, and the mask with its segments (which
        # FlashAttention-3 runs one segment at a time; a bare dense mask would send it to SDPA).
        step.use_attention([*base, *control], x.device, x.dtype)
        mask = PrefixMask(inputs.mask, inputs.segments)
        stream = net.before_proj(torch.zeros_like(x)) + x
        index = {layer: j for j, layer in enumerate(layers)}
        pending, last = None, len(base) - 1
        for i, (block, k_rows, v_rows) in enumerate(zip(base, inputs.k, inputs.v)):
            with block_on_device(block.block):
                x, pending = block(x, pending, inputs.modulation, inputs.cos, inputs.sin, k_rows, v_rows, 0, True,
                                   mask, kv_only=i == last)
            j = index.get(i)
            if j is None:
                continue
            # The last base block's output is not kept, so neither is what would be added to it.
            stream, handed = control[j](stream, None, inputs.modulation, inputs.cos, inputs.sin, k[j], v[j], 0, True,
                                        mask, kv_only=i == last)
            if i == last:
                continue
            stream = settle(stream, handed)
            x, pending = add_residual(settle(x, pending), net.after_proj[j](stream), strength), None
        tokens = self.tokens.to(x.device, x.dtype)
        return BlockResiduals(net, layers, tokens, strength, k, v)
