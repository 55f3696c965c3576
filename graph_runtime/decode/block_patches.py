"""A step with Python block and attention patches: the whole joint sequence, eagerly, with ComfyUI's Qwen-Image-2.1
patch conventions.

A patch that is arbitrary Python (another node's function) may read or change any row, prefix rows included, so its
step cannot reuse a cached prefix or replay a captured graph: each such step runs the text, reference and target
rows through every block, as ComfyUI's own Qwen-Image-2.1 model does when a patch is present (it switches its prefix
cache off then). The conventions a patch sees are that model's:

- `replace[i](args, {"original_block": f})` stands in for block `i`; `args` holds `img` (the joint rows `[B, N, D]`),
  `vec` (the timestep embedding), `pe` (RoPE `[1, N, 1, D/2, 2, 2]`), `mod`, `attn_fn(q, k, v, heads)` (the block's
  masked attention over `[B, N, H, D]`, returning `[B, N, H * D]`), `prefix_len` and `transformer_options`;
  `f(args)` runs the block itself and returns `{"img": ...}`.
- `attn1` patches get q, k, v as `[B, H, N, D]` after the q/k norms and before RoPE, `pe` as `[1, 1, N, ...]`, and
  `extra_options["img_slice"] = [prefix_len, N]`; they return a dict that may replace any of q, k, v, pe.
- `post_input` patches get `{"img", "pe", "transformer_options"}` once, before the blocks; `after_block` patches
  (ComfyUI's `single_block`) get `{"img", "x", "block_index", "transformer_options"}` after each block.

Without patches the result equals the decode step over the cached prefix (tests/test_block_patches.py): the prefix
rows attend only to the prefix, the target rows to everything, each row modulated at its own timestep.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import KVGraphError, shorten
from ..placement import block_on_device
from .layout import TokenLayout


class PatchFailed(KVGraphError):
    """A patch raised: the message names the node it comes from and the convention it was called with."""


def origin(fn) -> str:
    """The node (or function) a patch comes from, for messages: a node's patch is a function defined inside its
    class (`SelfAttentionGuidance.execute.<locals>.attn_and_record`), so the class names the node."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    scope = qualname.rsplit(".<locals>.", 1)[0].split(".")  # where it was defined: [..., class, method]
    node = scope[-2] if len(scope) > 1 and scope[-2] != "<locals>" else scope[-1]
    return f"{node} ({module})" if module else node


def _call(kind: str, patch, *args, **kwargs):
    """`patch(*args, **kwargs)`; a failure names the node: a patch written for another architecture (a UNet's
    attention patch, say) fails on this model's conventions, and the raw error would not say whose it is."""
    try:
        return patch(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the node's name
        raise PatchFailed(f"KV-Graph: the {kind} of {origin(patch)} failed on a Qwen-Image-2.1 model, which "
                          f"calls it with ComfyUI's Qwen-Image-2.1 conventions: {type(exc).__name__}: "
                          f"{shorten(str(exc))}. Remove that node from the workflow.") from exc


@dataclass(frozen=True)
class BlockPatches:
    """The Python patches of one model call. `options`: what the patches receive as `transformer_options`."""

    replace: dict = field(default_factory=dict)  # block index -> fn(args, {"original_block": f}) -> {"img": ...}
    attn1: tuple = ()
    post_input: tuple = ()
    after_block: tuple = ()
    options: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.replace or self.attn1 or self.post_input or self.after_block)


def rope_pe(rotary: torch.Tensor) -> torch.Tensor:
    """ComfyUI's RoPE layout `[1, N, 1, D/2, 2, 2]` (rows `(cos, -sin), (sin, cos)`) from a complex table `[N, D/2]`."""
    cos, sin = rotary.real.float(), rotary.imag.float()
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))[None, :, None]


def apply_pe(x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved channel pairs of `x` `[B, N, H, D]` by `pe` `[1, N, 1, D/2, 2, 2]`, in fp32."""
    pairs = x.float().unflatten(-1, (-1, 1, 2))
    out = pe[..., 0] * pairs[..., 0] + pe[..., 1] * pairs[..., 1]
    return out.flatten(-2).to(x.dtype)


def joint_mask(layout: TokenLayout, key_valid: torch.Tensor | None, device) -> torch.Tensor:
    """`[B or 1, 1, N, N]` bool: prefix rows see the prefix under its block-causal mask, target rows see everything."""
    prefix_len, seq = layout.prefix_len, layout.seq_len
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device)
    mask[:prefix_len] = False
    mask[:prefix_len, :prefix_len] = layout.prefix_attention_mask(device)
    mask = mask[None, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :].to(device)
    return mask


def masked_attention(mask: torch.Tensor):
    """An `attn_fn(q, k, v, heads)` over `[B, N, H, D]` rows (RoPE applied) under `mask`: `[B, N, H * D]`."""

    def attn_fn(q, k, v, heads=None, preferred_attention=None, **_):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2).flatten(2).type_as(q)

    return attn_fn


def _block(block, x, mod, pe, attn_fn, prefix_len, options, attn1) -> torch.Tensor:
    """One transformer block over the joint rows; `mod` is `(scale1, gate1, scale2, gate2)`, each `[B, N, D]`."""
    scale1, gate1, scale2, gate2 = mod
    attn = block.attn
    h = block.img_norm1(x) * (1 + scale1)
    head_dim = attn.inner_dim // attn.heads
    q = attn.norm_q(attn.to_q(h).unflatten(-1, (-1, head_dim))).to(h.dtype)
    k = attn.norm_k(attn.to_k(h).unflatten(-1, (-1, head_dim))).to(h.dtype)
    v = attn.to_v(h).unflatten(-1, (-1, head_dim))
    if attn1:
        q, k, v, pe_heads = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pe.transpose(1, 2)
        extra = {**options, "img_slice": [prefix_len, x.shape[1]]}
        for patch in attn1:
            out = _call("attn1_patch", patch, q, k, v, pe=pe_heads, attn_mask=None, extra_options=extra)
            q, k, v, pe_heads = out.get("q", q), out.get("k", k), out.get("v", v), out.get("pe", pe_heads)
        q, k, v, pe = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pe_heads.transpose(1, 2)
    out = attn.to_out[0](attn_fn(apply_pe(q, pe), apply_pe(k, pe), v, attn.heads))
    x = x + gate1.tanh() * out
    x = x + gate2.tanh() * block.img_mlp(block.img_norm2(x) * (1 + scale2))
    if x.dtype == torch.float16:
        x = x.clip(-65504, 65504)
    return x


@torch.no_grad()
def patched_step(transformer, prefix_rows: torch.Tensor, layout: TokenLayout, hidden: torch.Tensor,
                 timestep: torch.Tensor, key_valid, patches: BlockPatches, latent=None,
                 skip: frozenset = frozenset()) -> torch.Tensor:
    """One step's prediction `[B, T, C]` for target latents `hidden` `[B, T, C]`, with `patches` applied.

    `prefix_rows`: the prefix rows after the text and image input layers, `[B, P, D]` (`joint_prefix_rows`); `latent`:
    the call's latent as the patches' `x`; `skip`: blocks left out (a static skip-layer choice made alongside).
    """
    model = transformer
    batch = hidden.shape[0]
    x = torch.cat([prefix_rows.to(hidden.dtype), model.img_in(hidden)], dim=1)
    prefix_len, seq = layout.prefix_len, layout.seq_len
    t = torch.cat([timestep.to(x.dtype), timestep.new_zeros(1, dtype=x.dtype)])
    temb = model.time_text_embed(t, x)
    rows = model.modulation(temb)
    # Prefix rows modulate from t = 0 (the trailing row), target rows from their sample's timestep.
    per_row = torch.cat([rows[-1:, None].expand(batch, prefix_len, -1),
                         rows[:batch, None].expand(batch, seq - prefix_len, -1)], dim=1)
    mod = tuple(per_row.chunk(4, dim=-1))
    pe = rope_pe(layout.rotary(model.pos_embed)).to(x.device)
    options = dict(patches.options, total_blocks=len(model.transformer_blocks), block_type="single")
    for patch in patches.post_input:
        out = _call("post_input patch", patch, {"img": x, "pe": pe, "transformer_options": options})
        x, pe = out["img"], out.get("pe", pe)
        if x.shape[1] != seq:
            raise ValueError(f"a post_input patch changed the sequence from {seq} to {x.shape[1]} rows; a "
                             "KV-Graph model keeps its token layout")
    attn_fn = masked_attention(joint_mask(layout, key_valid, x.device))
    for i, block in enumerate(model.transformer_blocks):
        if i in skip:
            continue
        options["block_index"] = i
        with block_on_device(block):
            replace = patches.replace.get(i)
            if replace is None:
                x = _block(block, x, mod, pe, attn_fn, prefix_len, options, patches.attn1)
            else:
                def original(args, block=block):
                    return {"img": _block(block, args["img"], mod, args["pe"], attn_fn, prefix_len,
                                          args["transformer_options"], patches.attn1)}

                args = {"img": x, "vec": temb, "pe": pe, "mod": mod, "attn_fn": attn_fn, "prefix_len": prefix_len,
                        "transformer_options": options}
                x = _call("single_block replace", replace, args, {"original_block": original})["img"]
        for patch in patches.after_block:
            x = _call("single_block patch", patch, {"img": x, "x": latent, "block_index": i,
                                              "transformer_options": options})["img"]
    norm_out = model.norm_out
    scale = norm_out.linear(norm_out.silu(temb).to(x.dtype))[:batch]
    return model.proj_out(norm_out.norm(x[:, prefix_len:]) * (1 + scale[:, None]))


def joint_prefix_rows(transformer, layout: TokenLayout, references: torch.Tensor | None,
                      encoder_hidden_states: torch.Tensor) -> torch.Tensor:
    """The prefix rows `[B, P, D]` before the first block: text rows from `txt_in`, reference latents (`[B, R, C]`,
    condition images in order, or None) from `img_in`, at the layout's positions."""
    model = transformer
    text = model.txt_in(encoder_hidden_states)
    batch = text.shape[0]
    rows = text.new_zeros(batch, layout.prefix_len, text.shape[-1])
    image_positions = layout.image_positions[layout.image_positions < layout.prefix_len]
    if references is not None and references.shape[1]:
        rows[:, image_positions] = model.img_in(references.to(text.dtype))
    rows[:, layout.text_positions] = text[:, layout.vlm_text_positions.to(text.device)]
    return rows

