"""The target-only decode step: the body that runs eagerly and that the engine captures into a graph entry, and the
prefix pass (the prefix rows through the same block code, K/V kept).

It is the math of diffusers' `kv_cache_mode="cached"` forward, called through the model's own modules (so LoRA
layers and weight swaps are seen), with the per-step host work hoisted out:

- RoPE is applied with precomputed real cos/sin tables instead of complex multiplication: the same products in
  fp32, but inductor can fuse it (it generates no code for complex operators).
- Modulation reads the sample's own row directly. Every decode row is a target row, so diffusers'
  `torch.where(target_mask, real, zero)` would only materialize a full-size copy of the same values.
- K/V of the target are written into a static `[prefix | target]` buffer when one is given, so a captured step
  does not allocate and concatenate the prefix every block; the eager fallback concatenates as diffusers does.
- Our own kernels (`graph_runtime/kernels`) run each residual + LayerNorm + modulation, the MLP's SwiGLU product
  and, on that static path, q/k norm + RoPE + the K/V write, when the block's modules are diffusers' own;
  `kernels=False` (or a replaced module) keeps the modules' own code. The benchmark's
  `compile+graph-inductor-only` path measures the difference.
- Each block hands its MLP residual to the next block instead of adding it, so the add shares a pass with the next
  LayerNorm (or the final norm): one read and write of the residual stream per block fewer.
- A streamed model (a partial load, graph_runtime/streaming.py) has some blocks' weights on the host: the loops
  below run a `stream_slots.StreamPass` (a no-op without streamed blocks), started before any other work so the
  first uploads overlap it, whose copy-stream uploads and events are captured with the step.
- An int8 or host prefix (`prefix_store.py`) is not in per-block buffers: the step's `PrefixStore` brings each block's
  prefix rows into a working buffer before the block runs (dequantized, or copied from pinned memory one block ahead)
  and the block attends over that buffer; the stream slots' uploads and the store's copies run beside each other.
- Attention runs the kernel `attention.py` chose for the step's device when the step first ran there
  (FlashAttention-3 on Hopper where installed, SDPA elsewhere): one seam, `TargetDecodeBlock.attention`.
- FP8 blocks (`graph_runtime/fp8`, Linears converted with `apply_precision`): where a norm or the SwiGLU product
  feeds FP8 Linears, our kernel writes its output as per-token e4m3 + scales (`Fp8Rows`) instead of bf16, so the
  FP8 GEMMs need no quantization pass; any other input (the attention output into `to_out`) is quantized by the
  Linear itself.
- A graph entry's K/V format (`kv_format.py`) decides what a block's static K/V are: the model's dtype, or e4m3
  with per-head scales (`Fp8KV`), which `attend` hands to FlashAttention-3's FP8 forward (`attend_fp8`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21SwiGLUFeedForward

from ..fp8.convert import precision_of
from ..fp8.linear import is_fp8_linear
from ..quantized.int8_convrot import is_int8_linear
from ..kernels.fp8_quant import norm_modulate_fp8, residual_norm_modulate_fp8, silu_mul_fp8
from ..kernels.int8_quant import norm_modulate_int8, residual_norm_modulate_int8, silu_mul_int8
from ..kernels.norm_modulate import norm_modulate, residual_norm_modulate
from ..kernels.qk_norm_rope import qk_norm_rope_write, qk_norm_rope_write_fp8, quantize_heads_e4m3, rotate_pairs
from ..kernels.silu_mul import silu_mul
from ..stream_slots import exclusive, stream_pass, streamer_of
from .attention import FA3_FP8, SDPA_ATTENTION, AttentionChoice, PrefixMask, sdpa
from .kv_format import FP8, NATIVE, Fp8KV


@dataclass
class DecodeInputs:
    """What one decode step reads. Graph entries hold static ones; the eager path builds them per call.

    `k`/`v` are per block: either a `[B, P + T, H, D]` static buffer whose first `prefix_len` rows hold the prefix
    (`static_kv=True`; the step writes the target rows), or the request's own `[B, P, H, D]` prefix tensors
    (`static_kv=False`; the step concatenates).
    """

    hidden: torch.Tensor  # [B, T, in_channels] target latents
    timestep: torch.Tensor  # [B], model dtype, in [0, 1]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    cos: torch.Tensor  # [T, 1, head_dim / 2] fp32
    sin: torch.Tensor
    prefix_len: int
    static_kv: bool
    attn_mask: torch.Tensor | None = None  # [B, 1, 1, P + T] bool, only on the eager padded-text path
    extra: dict = field(default_factory=dict)
    # Blocks the step leaves out (a skip-layer guidance pass, decode/block_patches.py); a graph key pins them.
    skip: frozenset = frozenset()
    # The K/V format (kv_format.py): with "fp8", `k`/`v` are e4m3 static buffers and `fp8` their `Fp8KVStore`.
    kv_format: str = NATIVE
    fp8: object = None

    def block_kv(self, i: int) -> tuple:
        """Block `i`'s `(k_cache, v_cache)` as the block reads them: tensors, or `(Fp8KV, None)` in the fp8
        format."""
        if self.kv_format == FP8:
            return self.fp8.block(i), None
        return self.k[i], self.v[i]


def rope_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Real cos/sin tables `[S, 1, D/2]` (fp32) from diffusers' complex RoPE table `[S, D/2]`."""
    return freqs.real.float()[:, None, :].contiguous(), freqs.imag.float()[:, None, :].contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved (real, imag) channel pairs of `x` `[B, S, H, D]` in fp32, as the reference does.

    Eagerly, one complex multiply is fewest kernels; under torch.compile the same products are written in real
    arithmetic, because inductor generates no code for complex operators and would leave RoPE unfused.
    """
    if not torch.compiler.is_compiling():
        pairs = x.float().unflatten(-1, (-1, 2))
        rotated = torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin))
        return rotated.flatten(-2).to(x.dtype)
    return rotate_pairs(x, cos, sin).to(x.dtype)


@dataclass
class PrefixInputs:
    """What the prefix pass reads. Everything but `hidden` and `modulation` follows from the token layout, which a
    graph entry's key pins, so a captured pass copies only those two per prompt."""

    hidden: torch.Tensor  # [B, P, D] prefix rows after txt_in / img_in
    modulation: torch.Tensor  # [B, 4D] the t = 0 row diffusers modulates prefix rows with
    cos: torch.Tensor  # [P, 1, head_dim / 2] fp32
    sin: torch.Tensor
    mask: torch.Tensor  # [B or 1, 1, P, P] bool: the prefix's block-causal mask (and valid keys)
    k: list[torch.Tensor]  # per block, [B, P, H, head_dim]: where the block's K land
    v: list[torch.Tensor]
    segments: tuple | None = None  # the layout's (start, end, is_text) runs `mask` encodes; None with key padding
    skip: frozenset = frozenset()  # blocks the pass leaves out, as the decode steps of its prefix do
    # `stash(i)` after block i wrote its rows into `k[i]`/`v[i]`: an int8 or host prefix (prefix_store.py) keeps
    # them elsewhere, so the next block may reuse those rows.
    stash: object = None


# Up to this many prefix tokens (a text-only prompt) the pass is host-bound: it is captured and replayed, and its
# masked attention runs on the memory-efficient kernel. SDPA would pick cuDNN, which generates a kernel for every
# new prompt length (slow on the first prefill of each length, slower on the first one in the process), for
# attention that is a sliver of a short pass. A long prefix (reference images) keeps cuDNN, which is
# faster there (docs/performance.md).
SHORT_PREFIX_TOKENS = 1024


def run_prefix_blocks(blocks, inputs: PrefixInputs) -> None:
    """The pass itself, over `TargetDecodeBlock`s: prefix rows are decoded like target rows with a zero timestep."""
    with stream_pass([b.block for b in blocks], inputs.skip) as stream:
        x = inputs.hidden
        mask = PrefixMask(inputs.mask, inputs.segments)
        short = x.is_cuda and x.shape[1] <= SHORT_PREFIX_TOKENS
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]) if short else contextlib.nullcontext():
            kept = [i for i in range(len(blocks)) if i not in inputs.skip]
            pending, last = None, kept[-1] if kept else -1
            for i, (block, k_rows, v_rows) in enumerate(zip(blocks, inputs.k, inputs.v)):
                if i in inputs.skip:
                    continue  # a skipped block is the identity: the residual stream (and its pending add) passes on
                # Only the K/V rows are kept: the last block stops once it has written them.
                stream.before(i)
                x, pending = block(x, pending, inputs.modulation, inputs.cos, inputs.sin, k_rows, v_rows, 0, True,
                                   mask, kv_only=i == last)
                stream.after(i)
                if inputs.stash is not None:
                    inputs.stash(i)


class TargetDecodeBlock(torch.nn.Module):
    """One transformer block restricted to the target rows; wraps (does not copy) a diffusers block.

    A module per block, rather than one function taking a block argument, so each can be `torch.compile`d on its
    own: a shared compiled function would guard on the block's identity and recompile past dynamo's cache limit.
    """

    def __init__(self, block: torch.nn.Module, kernels: bool = True):
        super().__init__()
        self.block = block
        # The hand-written kernels of `graph_runtime/kernels` (off: inductor's or PyTorch's own code throughout).
        self.fuse_qk = kernels
        self.fuse_norms = kernels
        self.fuse_mlp = kernels

    def _can_fuse_qk(self) -> bool:
        # Only diffusers' own modules are fused; a replaced module (a patch, an adapter) runs as itself.
        norm_q, norm_k = self.block.attn.norm_q, self.block.attn.norm_k
        return (self.fuse_qk and type(norm_q) is RMSNorm and type(norm_k) is RMSNorm
                and norm_q.weight is not None and norm_k.weight is not None and norm_k.bias is None
                and norm_q.bias is None and norm_q.eps == norm_k.eps)

    def _can_fuse_norms(self) -> bool:
        norms = (self.block.img_norm1, self.block.img_norm2)
        return (self.fuse_norms and all(type(n) is torch.nn.LayerNorm and not n.elementwise_affine for n in norms)
                and norms[0].eps == norms[1].eps and norms[0].normalized_shape == norms[1].normalized_shape)

    def _can_fuse_mlp(self) -> bool:
        mlp = self.block.img_mlp
        return (self.fuse_mlp and type(mlp) is QwenImage21SwiGLUFeedForward
                and type(mlp.activation_fn) is torch.nn.SiLU)

    def _fp8_inputs(self, *linears) -> bool:
        """Whether our kernel should hand `linears` their input as FP8 rows (they are all ours, FP8, and fused)."""
        return self.fuse_norms and all(map(is_fp8_linear, linears))

    def _int8_inputs(self, device, *linears) -> bool | None:
        """None, or whether the int8 rows our kernel hands `linears` are rotated: when they are all int8 layers
        that run on our INT8 GEMM on `device` and agree on the rotation."""
        if not (self.fuse_norms and all(map(is_int8_linear, linears))):
            return None
        if any(linear.our_kernel_reason(device) is not None for linear in linears):
            return None
        rotations = {linear.convrot for linear in linears}
        return rotations.pop() if len(rotations) == 1 else None

    def _eight_bit(self, device, *linears) -> str | bool:
        """What the norm feeding `linears` writes: "fp8", "int8", "int8-rotated", or False (the model's dtype)."""
        if self._fp8_inputs(*linears):
            return "fp8"
        rotate = self._int8_inputs(device, *linears)
        if rotate is None:
            return False
        return "int8-rotated" if rotate else "int8"

    def mlp(self, h) -> torch.Tensor:
        """The block's SwiGLU MLP; with our kernels, its product runs as one pass (its projections still run as the
        module's own Linear layers, so adapters on them are seen). `h` is 8-bit rows only when `_mlp_input` says."""
        mlp = self.block.img_mlp
        if self._can_fuse_mlp():
            # One expression, so the gate and up projections are freed before `out` runs (named locals would keep
            # them alive through it, and a captured graph's pool would hold them too).
            kind = self._eight_bit((h.data if isinstance(h, tuple) else h).device, mlp.out)
            if kind == "fp8":
                return mlp.out(silu_mul_fp8(mlp.gate_layer(h), mlp.proj(h)))
            if kind:
                return mlp.out(silu_mul_int8(mlp.gate_layer(h), mlp.proj(h), kind == "int8-rotated"))
            return mlp.out(silu_mul(mlp.gate_layer(h), mlp.proj(h)))
        return mlp(h)

    def _mlp_input(self, device) -> str | bool:
        mlp = self.block.img_mlp
        return self._can_fuse_mlp() and self._eight_bit(device, mlp.gate_layer, mlp.proj)

    def forward(self, x, pending, modulation, cos, sin, k_cache, v_cache, prefix_len: int, static_kv: bool,
                attn_mask, kv_only: bool = False):
        """Returns `(x, pending)`: the block's MLP residual is handed on, not added, so the next block (or the final
        norm) adds it in the same pass as its LayerNorm; `pending` is `(mlp_out, gate)` or None for the first block.

        `kv_only` (static K/V only) stops once the block's K/V rows are written and returns `(x, None)`: the prefix
        pass keeps nothing else of its last block, so its attention and MLP would be work thrown away."""
        block, attn = self.block, self.block.attn
        fuse_norms = self._can_fuse_norms()
        scale1, gate1, scale2, gate2 = modulation[:, None].chunk(4, dim=-1)

        x, h = self.add_pending_and_norm(x, pending, block.img_norm1, scale1, fuse_norms,
                                         eight_bit=self._eight_bit(x.device, attn.to_q, attn.to_k, attn.to_v))
        head_dim = attn.inner_dim // attn.heads
        q = attn.to_q(h).unflatten(-1, (-1, head_dim))
        k = attn.to_k(h).unflatten(-1, (-1, head_dim))
        v = attn.to_v(h).unflatten(-1, (-1, head_dim))
        out = self.attend(q, k, v, cos, sin, k_cache, v_cache, prefix_len, static_kv, attn_mask,
                          kv_only and static_kv)
        if out is None:
            return x, None
        out = attn.to_out[0](out.flatten(2))
        x, h = self.add_pending_and_norm(x, (out, gate1), block.img_norm2, scale2, fuse_norms, mlp_residual=False,
                                         eight_bit=self._mlp_input(x.device))
        return x, (self.mlp(h), gate2)

    def attend(self, q, k, v, cos, sin, k_cache, v_cache, prefix_len: int, static_kv: bool, attn_mask,
               kv_only: bool = False):
        """q/k normed and rotated, the rows' K/V kept (written into the static buffer's rows `prefix_len:`, or
        concatenated after the prefix's), then attention: `[B, S, H, D]`, or None once the K/V are written when
        `kv_only`. Sequence parallelism (graph_runtime/parallel) overrides this one method."""
        if isinstance(k_cache, Fp8KV):  # the graph entry's K/V format is "fp8"
            return self.attend_fp8(q, k, v, cos, sin, k_cache, prefix_len, kv_only)
        if static_kv and self._can_fuse_qk():
            q = self.norm_rope_write(q, k, v, cos, sin, k_cache, v_cache, prefix_len)
            keys, values = k_cache, v_cache
        else:
            q, k = self.norm_rope(q, k, v, cos, sin)
            keys, values = self.keep_kv(k, v, k_cache, v_cache, prefix_len, static_kv)
        if kv_only:
            return None
        return self.attention(q, keys, values, attn_mask)

    def attend_fp8(self, q, k, v, cos, sin, kv: Fp8KV, prefix_len: int, kv_only: bool = False):
        """`attend` for e4m3 static K/V: q/k normed and rotated, q/k/v over their per-head scales in e4m3 (one pass
        of our kernel, which writes the K/V rows too), then FlashAttention-3's FP8 forward, out in the model's dtype.
        """
        attn = self.block.attn
        if self._can_fuse_qk():
            q8 = qk_norm_rope_write_fp8(q, k, v, attn.norm_q.weight, attn.norm_k.weight, cos, sin, kv.k, kv.v,
                                        prefix_len, attn.norm_q.eps, kv.inverse[0], kv.inverse[1], kv.inverse[2])
        else:  # our kernels off: the modules' own norms, quantized as the kernel would
            q, k = self.norm_rope(q, k, v, cos, sin)
            self.keep_kv(quantize_heads_e4m3(k, kv.inverse[1]), quantize_heads_e4m3(v, kv.inverse[2]), kv.k, kv.v,
                         prefix_len, True)
            q8 = quantize_heads_e4m3(q, kv.inverse[0])
        if kv_only:
            return None
        return self.attention_backend.fp8(q8, kv.k, kv.v, kv.descale, v.dtype)

    @staticmethod
    def keep_kv(k, v, k_cache, v_cache, prefix_len: int, static_kv: bool):
        """The rows' K/V after the prefix's: written into the static buffer's rows `prefix_len:`, or concatenated.
        Returns the keys and values attention reads."""
        if static_kv:
            k_cache[:, prefix_len:].copy_(k)
            v_cache[:, prefix_len:].copy_(v)
            return k_cache, v_cache
        return torch.cat([k_cache, k], dim=1), torch.cat([v_cache, v], dim=1)

    def norm_rope(self, q, k, v, cos, sin):
        """q and k RMS-normed and rotated (the modules' own code)."""
        attn = self.block.attn
        return (apply_rope(attn.norm_q(q).to(v.dtype), cos, sin), apply_rope(attn.norm_k(k).to(v.dtype), cos, sin))

    def norm_rope_write(self, q, k, v, cos, sin, k_cache, v_cache, prefix_len: int):
        """Our one-pass kernel: returns q normed and rotated; k (normed, rotated) and v land in rows `prefix_len:`
        of the caches. Only when `_can_fuse_qk()`."""
        attn = self.block.attn
        return qk_norm_rope_write(q, k, v, attn.norm_q.weight, attn.norm_k.weight, cos, sin, k_cache, v_cache,
                                  prefix_len, attn.norm_q.eps)

    # SDPA over `[B, S, H, D]` queries and `[B, L, H, D]` keys/values (a mask: a tensor or a `PrefixMask`).
    sdpa_attention = staticmethod(sdpa)

    # The kernel the step chose for this block's device (`DecodeStep.use_attention`); SDPA until one is chosen.
    attention_backend = SDPA_ATTENTION

    def attention(self, q, keys, values, attn_mask):
        """The attention every block runs, `[B, S, H, D]` out (the benchmark swaps in 8-bit ones to measure them
        over whole steps)."""
        return self.attention_backend(q, keys, values, attn_mask)

    @staticmethod
    def add_pending_and_norm(x, pending, norm, scale, fuse: bool, mlp_residual: bool = True,
                             eight_bit: str | bool = False):
        """`x + tanh(gate) * delta` for a pending `(delta, gate)`, then `norm(x) * (1 + scale)`.

        Fused, both are one pass of our kernel (its norm reads the sum before rounding); with `eight_bit` the normed
        rows come out as per-token 8-bit values + scales for the FP8 or INT8 Linears that read them ("fp8", "int8",
        or "int8-rotated" for ConvRot weights). An fp16 MLP residual is left unfused: the reference clips the
        residual stream to fp16's range at the end of each block, before the next norm reads it.
        """
        if fuse and not (mlp_residual and x.dtype == torch.float16):
            rotate = eight_bit == "int8-rotated"
            if pending is None:
                if eight_bit == "fp8":
                    return x, norm_modulate_fp8(x, scale[:, 0], norm.eps)
                if eight_bit:
                    return x, norm_modulate_int8(x, scale[:, 0], norm.eps, rotate)
                return x, norm_modulate(x, scale[:, 0], norm.eps)
            delta, gate = pending
            if eight_bit == "fp8":
                return residual_norm_modulate_fp8(x, delta, gate[:, 0], scale[:, 0], norm.eps)
            if eight_bit:
                return residual_norm_modulate_int8(x, delta, gate[:, 0], scale[:, 0], norm.eps, rotate)
            return residual_norm_modulate(x, delta, gate[:, 0], scale[:, 0], norm.eps)
        if pending is not None:
            delta, gate = pending
            x = x + gate.tanh() * delta
            if mlp_residual and x.dtype == torch.float16:
                x = x.clip(-65504, 65504)
        return x, norm(x) * (1 + scale)


# e4m3 q/k take their scale from the static bound of an RMSNorm's weight (kv_format.py); other norms have none.
FP8_UNBOUNDED = "FP8 attention runs in bf16: a block's q/k norm is not an RMSNorm with a weight (no static e4m3 bound)"
# Head widths FlashAttention-3's FP8 forward and our e4m3 Triton kernel (a power of two) both have on CUDA.
FP8_HEAD_DIMS = (64, 128, 256)
FP8_HEAD_DIM = f"FP8 attention runs in bf16: its kernels take head widths {', '.join(map(str, FP8_HEAD_DIMS))}"


# Where `auto` takes FP8 attention: INT8 Linears (a model whose weights already sit at the INT8 ConvRot bound) and the
# head width the whole step was measured within that bound at (the published model's); a tiny 64-wide model landed at
# the bound itself, so other widths keep bf16 attention unless a user asks for `fp8`.
AUTO_FP8_HEAD_DIM = 128


def prefers_fp8(model) -> bool:
    """Whether `auto` takes FP8 attention for `model` (attention.py)."""
    return (model is not None and model.config.attention_head_dim == AUTO_FP8_HEAD_DIM
            and precision_of(model) == "int8")


def _fp8_kv_reason(model, device: torch.device) -> str | None:
    """Why this model's entries cannot keep e4m3 K/V on `device`, or None."""
    if device.type == "cuda" and model.config.attention_head_dim not in FP8_HEAD_DIMS:
        return FP8_HEAD_DIM
    for block in model.transformer_blocks:
        if not all(type(n) is RMSNorm and n.weight is not None for n in (block.attn.norm_q, block.attn.norm_k)):
            return FP8_UNBOUNDED
    return None


class DecodeStep(torch.nn.Module):
    """The whole decode step over a transformer's blocks: `forward(inputs) -> [B, T, out_channels]`."""

    def __init__(self, transformer: torch.nn.Module, kernels: bool = True, block_factory=TargetDecodeBlock,
                 attention: str = "auto"):
        """`block_factory(block, kernels)` wraps each diffusers block (sequence parallelism passes its own).
        `attention`: "auto" (FlashAttention-3 where it runs, its FP8 forward where `prefers_fp8`, else SDPA),
        "sdpa", "fa3", or "fp8" (FlashAttention-3's FP8 forward over e4m3 K/V in the graph entries where it runs, else
        what "auto" picks) (attention.py)."""
        super().__init__()
        # A weak reference: the transformer holds this step (through its engine), and the weights must not be
        # registered twice under this module.
        self._model = weakref.ref(transformer)
        self.block_factory = block_factory
        self.blocks = torch.nn.ModuleList(block_factory(b, kernels) for b in transformer.transformer_blocks)
        self.kernels = kernels
        self.compiled = False
        self.attention = AttentionChoice(attention, prefers_fp8=lambda: prefers_fp8(self.model))

    @property
    def model(self):
        return self._model()

    @property
    def kv_heads(self) -> int:
        """Attention heads whose K/V this step keeps (all of them; a sequence-parallel rank keeps its share)."""
        return self.model.config.num_attention_heads

    def parallel_key(self) -> tuple:
        """What graph keys carry about parallelism: nothing here; a sequence-parallel step names its group."""
        return ()

    def prefix_blocks(self) -> list[TargetDecodeBlock]:
        # Uncompiled wrappers: a few hundred rows gain nothing from inductor, and the decode step's compiled blocks
        # would recompile for the prefix's shapes and mask.
        return [self.block_factory(b, True) for b in self.model.transformer_blocks]

    def use_attention(self, blocks, device, dtype) -> None:
        """Hand `blocks` the attention kernel chosen for `device` and `dtype` (chosen, logged and counted the first
        time). Set only when it changes: a compiled block guards on its attributes."""
        backend = self.attention.pick(device, dtype)
        for block in blocks:
            inner = getattr(block, "_orig_mod", block)
            if inner.attention_backend is not backend:
                inner.attention_backend = backend

    def run_prefix(self, inputs) -> None:
        """The prefix pass (`PrefixInputs`) over this step's kind of block: K/V rows written, eagerly; the engine
        calls it, and captures it for a short prefix."""
        blocks = self.prefix_blocks()
        self.use_attention(blocks, inputs.hidden.device, inputs.hidden.dtype)
        run_prefix_blocks(blocks, inputs)

    def compile_blocks(self) -> None:
        """Regionally compile every block; inductor's own CUDA graphs stay off so graph layers never stack.

        Shapes are left to dynamo's automatic dynamism rather than pinned: every new prompt length changes the
        prefix K/V length, and pinned shapes would recompile for each one (and fall back to eager past dynamo's
        recompile limit). The first size change recompiles once with symbolic sizes; later ones reuse it.
        """
        if self.compiled:
            return
        for i, block in enumerate(self.blocks):
            self.blocks[i] = torch.compile(block, options={"triton.cudagraphs": False})
        self.compiled = True

    def variant(self, device=None, dtype=None) -> str:
        """Names what a captured graph of this step recorded on `device` with `dtype` (default: the model's own;
        graph keys include it): the attention kernel, compiled blocks, our kernels, the precision."""
        if device is None or dtype is None:
            first = next(self.model.parameters())
            device, dtype = device or first.device, dtype or first.dtype
        name = self.attention.pick(device, dtype).name + ("+compiled-blocks" if self.compiled else "")
        precision = precision_of(self.model)
        return name + ("+kernels" if self.kernels else "") + ("" if precision == "bf16" else f"+{precision}")

    def exclusive(self):
        """Context manager around replaying a captured graph of this step: a streamed model's slots are held for it
        (stream_slots.py); nothing for a whole model."""
        return exclusive(self.model.transformer_blocks)

    def streaming_key(self) -> tuple:
        """What graph keys carry about streamed blocks (which stream, through how many slots); empty when whole."""
        streamer = streamer_of(self.model.transformer_blocks)
        return () if streamer is None else streamer.graph_key()

    def kv_format(self, device=None, dtype=None) -> str:
        """The K/V format of this step's graph entries on `device` with `dtype` (kv_format.py): "fp8" where the
        attention chosen there is FlashAttention-3's FP8 forward, else "native"."""
        if device is None or dtype is None:
            first = next(self.model.parameters())
            device, dtype = device or first.device, dtype or first.dtype
        if self.attention.pick(device, dtype).name != FA3_FP8:
            return NATIVE
        reason = _fp8_kv_reason(self.model, torch.device(device))
        if reason is not None:
            self.attention.count_fallback(reason, device)
            return NATIVE
        return FP8

    def forward(self, inputs: DecodeInputs) -> torch.Tensor:
        # First, so the first streamed blocks' uploads run behind img_in, the modulation and the resident blocks.
        with stream_pass(self.model.transformer_blocks, inputs.skip) as stream:
            return self._forward(inputs, stream)

    def _forward(self, inputs: DecodeInputs, stream) -> torch.Tensor:
        model = self.model
        x = model.img_in(inputs.hidden)
        self.use_attention(self.blocks, x.device, x.dtype)
        batch = x.shape[0]
        # The trailing t = 0 row is what diffusers computes for the prefix rows; keeping it makes the target rows'
        # GEMMs run at the same M as the reference forward, so they round the same way.
        timestep = torch.cat([inputs.timestep.to(x.dtype), inputs.timestep.new_zeros(1, dtype=x.dtype)])
        temb = model.time_text_embed(timestep, x)
        modulation = model.modulation(temb)[:batch]
        pending = None
        # Per-block residuals from a stream beside the blocks (a ControlNet, graph_runtime/controlnet): added after
        # their base block, here and nowhere else.
        residuals = inputs.extra.get("block_residuals")
        residuals = residuals.start(self, x, modulation, inputs) if residuals is not None else None
        # An int8 or host prefix (prefix_store.py): each block's prefix rows reach a working buffer before it runs.
        store = inputs.extra.get("prefix_store")
        order = [i for i in range(len(self.blocks)) if i not in inputs.skip]
        if store is not None:
            store.begin_step(order)
        # The stream pass runs outside the wrappers, which may be compiled.
        for position, i in enumerate(order):
            if store is not None:
                store.before_block(position)
            stream.before(i)
            kv = inputs.block_kv(i) if store is None else store.working(position)
            x, pending = self.blocks[i](x, pending, modulation, inputs.cos, inputs.sin, *kv,
                                        inputs.prefix_len, inputs.static_kv, inputs.attn_mask)
            stream.after(i)
            if store is not None:
                store.after_block(position)
            if residuals is not None:
                x, pending = residuals.after_block(i, x, pending)
        if store is not None:
            store.end_step()
        norm_out = model.norm_out
        scale = norm_out.linear(norm_out.silu(temb).to(x.dtype))[:batch]
        fuse = self.kernels and type(norm_out.norm) is torch.nn.LayerNorm and not norm_out.norm.elementwise_affine
        _, x = TargetDecodeBlock.add_pending_and_norm(x, pending, norm_out.norm, scale[:, None], fuse)
        return model.proj_out(x)
