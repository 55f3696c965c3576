"""The prefill: every block's prefix K/V, kept for the decode steps.

Two ways, one result (tests/test_cached_decode.py): the joint pass is diffusers' `kv_cache_mode="extract"`
forward over the whole sequence with the token layout precomputed (see `layout.py`), and also predicts step 1; the
prefix pass, which the sampler uses, runs the prefix rows alone through the decode step's block code, and step 1 is
then a decode step. With `causal_condition` no prefix row attends to a target row, so both give the same K/V.

Where the request has claimed a graph entry, the prefix K/V are written straight into the entry's static buffers
and the request's prefix tensors are views of them: one copy of the prefix in memory instead of two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVLayerCache

from .layout import TokenLayout
from .prefix_store import release_host_cache
from .step import PrefixInputs, TargetDecodeBlock, rope_tables, run_prefix_blocks


class OwnerToken:
    """What a graph entry's owner weak reference points at; it lives exactly as long as the request's cache."""

    __slots__ = ("__weakref__",)


@dataclass
class PrefixCache:
    """One request branch's prefix K/V and everything its decode steps need.

    The request owns these tensors: dropping the cache (or `release()`) frees them and kills `owner`, which is how
    the entry's owner record (`graphs.EntryOwners`) learns that the request is gone.
    """

    branch: str
    layout: TokenLayout
    k: list[torch.Tensor]  # per block, [B, P, H, D]
    v: list[torch.Tensor]
    cos: torch.Tensor  # target RoPE tables, [T, 1, D/2] fp32
    sin: torch.Tensor
    key_valid: torch.Tensor | None  # [B, P + T] bool when the text is padded, else None
    owner: OwnerToken | None = field(default_factory=OwnerToken)
    graph_key: object = None  # the graphs' key for this request, computed at its first graph step
    # A stream beside the blocks whose per-block residuals its steps add (graph_runtime/controlnet), or None.
    residuals: object = None
    skip: frozenset = frozenset()  # blocks left out of the prefix pass and of every decode step over it
    # Where the K/V live (prefix_store.py): "gpu" (`k`/`v` as above), "int8" or "host" (`k`/`v` are the store's
    # per-block int8 or host tensors, `store` holds them and the working buffers), or "recompute" (no K/V: `rows`
    # are the prefix rows before the first block, and every step runs the whole joint sequence).
    placement: str = "gpu"
    store: object = None
    rows: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return (self.rows if self.rows is not None else self.k[0]).shape[0]

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype attention reads the K/V in (an int8 prefix is read dequantized)."""
        if self.store is not None:
            return self.store.dtype
        return (self.rows if self.rows is not None else self.k[0]).dtype

    @property
    def nbytes(self) -> int:
        """What the prefix holds on its device (a host prefix's pinned rows not included)."""
        if self.store is not None:
            return self.store.device_bytes
        tensors = (*self.k, *self.v) + (() if self.rows is None else (self.rows,))
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self) -> None:
        self.k.clear()
        self.v.clear()
        self.owner = None
        self.residuals = None
        host = self.placement == "host"
        self.store = None
        self.rows = None
        if host:
            release_host_cache()  # a request's own host prefix (an entry's stays with the entry)


class _StaticPrefixLayer(QwenImage21KVLayerCache):
    """A layer cache whose `store` copies into a graph entry's static `[prefix | target]` buffers.

    diffusers hands `store` a fresh clone of the layer's prefix K/V; copying it into the buffer and dropping it keeps
    only one layer's clone alive at a time.
    """

    def __init__(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, prefix_len: int):
        super().__init__()
        self._k_buffer, self._v_buffer, self._prefix_len = k_buffer, v_buffer, prefix_len

    def store(self, k: torch.Tensor, v: torch.Tensor):
        self._k_buffer[:, : self._prefix_len].copy_(k)
        self._v_buffer[:, : self._prefix_len].copy_(v)
        super().store(self._k_buffer[:, : self._prefix_len], self._v_buffer[:, : self._prefix_len])


def _check_processors(transformer) -> None:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

    for block in transformer.transformer_blocks:
        if not isinstance(block.attn.processor, QwenImage21AttnProcessor):
            # The flex processor needs a BlockMask built per forward; the segment-wise SDPA prefill is exact and
            # needs no compilation, so the runtime always uses it.
            block.attn.set_processor(QwenImage21AttnProcessor())


@torch.no_grad()
def run_prefill(
    transformer,
    layout: TokenLayout,
    latents: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    text_mask: torch.Tensor | None = None,
    branch: str = "cond",
    static_kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    with_target: bool = True,
    prefix_runner=None,
    kv_heads: int | None = None,
    skip: frozenset = frozenset(),
    store=None,
) -> tuple[torch.Tensor | None, PrefixCache]:
    """Run step 1. `latents` is `[B, cond_tokens + T, C]` (condition images first); returns the target rows'
    prediction `[B, T, C]` and the branch's prefix cache. `static_kv` are per-block `[B, P + T, H, D]` buffers to
    write the prefix into (a claimed graph entry's).

    `with_target=False` runs the prefix rows alone and returns no prediction: with `causal_condition` no prefix row
    attends to a target row, so the prefix K/V are the same, and the target's step-1 prediction is then exactly a
    decode step over them (the property tests/test_cached_decode.py checks), which can replay a graph. The prefix
    rows then go through the decode step's own block code (`step.run_prefix_blocks`) rather than diffusers' blocks:
    `prefix_runner(inputs)` runs them (a graph entry's captured pass, or the decode step's own pass), else they run
    eagerly. `kv_heads`: the heads whose K/V fresh buffers keep (default all; a sequence-parallel rank keeps its
    share). `skip`: blocks left out (prefix pass only), as a skip-layer guidance pass leaves them out of every row.
    `store`: an int8 or host prefix's `PrefixStore` (prefix pass only), which keeps each block's rows as they are
    written.
    """
    if skip and with_target:
        raise ValueError("skipped blocks need the prefix pass (with_target=False)")
    if store is not None and with_target:
        raise ValueError("an int8 or host prefix needs the prefix pass (with_target=False)")
    model = transformer
    device = latents.device
    batch = latents.shape[0]
    hidden = model.img_in(latents)
    text = model.txt_in(encoder_hidden_states)

    # Text rows go to the non-image positions, latents to the image positions: the same joint sequence diffusers
    # builds with `repeat_interleave`, without its host syncs.
    joint = hidden.new_zeros(batch, layout.seq_len, hidden.shape[-1])
    joint[:, layout.image_positions] = hidden
    joint[:, layout.text_positions] = text[:, layout.vlm_text_positions.to(device)]

    rotary = layout.rotary(model.pos_embed)
    t = timestep.to(hidden.dtype)
    t = torch.cat([t, t.new_zeros(1)])
    temb = model.time_text_embed(t, hidden)
    modulation = model.modulation(temb)
    key_valid = layout.joint_key_valid(text_mask)

    cos, sin = rope_tables(rotary[layout.prefix_len:])
    if with_target:
        out, layers = _joint_pass(model, layout, joint, modulation, rotary, key_valid, temb, static_kv)
        k, v = [layer.k for layer in layers], [layer.v for layer in layers]
    else:
        out = None
        inputs = _prefix_inputs(model, layout, joint[:, :layout.prefix_len].contiguous(),
                                modulation[-1:].expand(batch, -1), rotary[:layout.prefix_len], key_valid, static_kv,
                                kv_heads, store)
        inputs.skip = frozenset(skip)
        if prefix_runner is None:
            # No graph entry, no step to ask: the pass over the transformer's own blocks.
            run_prefix_blocks([TargetDecodeBlock(block) for block in model.transformer_blocks], inputs)
        else:
            prefix_runner(inputs)
        k, v = (list(inputs.k), list(inputs.v)) if store is None else (list(store.k), list(store.v))

    prefix = PrefixCache(
        branch=branch,
        layout=layout,
        k=k,
        v=v,
        cos=cos,
        sin=sin,
        key_valid=key_valid,
        skip=frozenset(skip),
        placement="gpu" if store is None else store.placement,
        store=store,
    )
    return out, prefix


def _joint_pass(model, layout, joint, modulation, rotary, key_valid, temb, static_kv):
    """diffusers' extract forward over the whole joint sequence: the target's prediction and every layer's cache."""
    _check_processors(model)
    target_mask = layout.target_token_mask()
    blocks = model.transformer_blocks
    if static_kv is None:
        layers = [QwenImage21KVLayerCache() for _ in blocks]
    else:
        layers = [_StaticPrefixLayer(k, v, layout.prefix_len) for k, v in zip(*static_kv)]
    segments = list(layout.segments)
    for block, layer in zip(blocks, layers):
        joint = block(hidden_states=joint, modulation=modulation, rotary_emb=rotary, attention_mask=None,
                      target_token_mask=target_mask, layer_cache=layer, kv_cache_mode="extract",
                      cache_write_slice=slice(0, layout.prefix_len), segments=segments, key_valid=key_valid)
    joint = model.norm_out(joint, temb, target_mask)
    return model.proj_out(joint)[:, layout.prefix_len:], layers


def _prefix_inputs(model, layout, x, zero_modulation, rotary, key_valid, static_kv, kv_heads=None,
                   store=None) -> PrefixInputs:
    """The prefix pass's inputs: each prefix row is modulated from t = 0 (diffusers' trailing modulation row) and
    attends under the prefix's block-causal mask; its block's K/V land in rows `0:P` of the given buffers (fresh
    ones when the request has no graph entry)."""
    prefix_len, batch = layout.prefix_len, x.shape[0]
    cos, sin = rope_tables(rotary)
    mask = layout.prefix_attention_mask(x.device)[None, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :prefix_len]
    blocks = model.transformer_blocks
    if store is not None:
        rows = [store.prefix_rows(i) for i in range(len(blocks))]
        return PrefixInputs(hidden=x, modulation=zero_modulation, cos=cos, sin=sin, mask=mask,
                            k=[k for k, _ in rows], v=[v for _, v in rows], stash=store.stash,
                            segments=layout.segments if key_valid is None else None)
    if static_kv is None:
        attn = blocks[0].attn
        shape = (batch, prefix_len, kv_heads or attn.heads, attn.inner_dim // attn.heads)
        static_kv = ([x.new_empty(shape) for _ in blocks], [x.new_empty(shape) for _ in blocks])
    return PrefixInputs(hidden=x, modulation=zero_modulation, cos=cos, sin=sin, mask=mask,
                        k=[buffer[:, :prefix_len] for buffer in static_kv[0]],
                        v=[buffer[:, :prefix_len] for buffer in static_kv[1]],
                        segments=layout.segments if key_valid is None else None)

