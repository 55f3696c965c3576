"""The cached decode step against the no-cache full forward, at every step of a real sampling trajectory.

This is the property the whole product rests on: with `causal_condition`, text and condition-image K/V do not
depend on the step, so recomputing only the target rows against the cached prefix gives the full forward's
target output. Tolerance (fp32, CPU): 1e-4 absolute on outputs of magnitude ~1-5. The two differ only in how
attention is split (the full forward runs one SDPA per prefix segment plus one for the target; decode runs the
target's call over cached keys that the prefill computed in its own segment calls), i.e. float32 reassociation;
a wrong prefix (stale step, wrong modulation row, wrong RoPE offset) is off by >1e-2.
"""

import pytest
import torch

from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.encoding.images import encode_pixels, prepare_references
from graph_runtime.sampling.sampler import initial_noise, pack
from graph_runtime.sampling.schedule import build_schedule, euler_step

ATOL = 1e-4


def _full_forward(transformer, embeds, image_mask, cond_tokens, latents, timestep, img_shapes):
    target_slots = latents.shape[1] // 4
    img_mask = torch.cat([image_mask, image_mask.new_ones(image_mask.shape[0], target_slots)], dim=1)
    hidden = latents if cond_tokens is None else torch.cat([cond_tokens, latents], dim=1)
    out = transformer(hidden_states=hidden, encoder_hidden_states=embeds, timestep=timestep,
                      img_shapes=[img_shapes], img_mask=img_mask, return_dict=False)[0]
    return out[:, -latents.shape[1]:]


@pytest.mark.parametrize("with_reference", [False, True], ids=["text-to-image", "edit"])
def test_cached_decode_equals_full_forward_every_step(tiny_models, generator, reference_image, with_reference):
    """At every decode step, decode(prefix cache) == full forward over [prefix, target] for the target rows."""
    transformer = tiny_models.transformer
    engine = DecodeEngine(transformer)
    images = [reference_image] if with_reference else []
    refs = prepare_references(images, 256)
    embeds = generator.encoder.encode("make it glow", [r.vision_image for r in refs])
    cond_latents = [encode_pixels(tiny_models.vae, r.vae_pixels) for r in refs]
    h, w = 12, 10
    img_shapes = [(1, c.shape[2], c.shape[3]) for c in cond_latents] + [(1, h, w)]
    cond_tokens = torch.cat([pack(c) for c in cond_latents], 1) if cond_latents else None
    layout = TokenLayout.build(embeds.image_mask, img_shapes, "cpu")
    latents = pack(initial_noise(7, 1, 64, h, w, torch.float32))
    timesteps, sigmas = build_schedule(tiny_models.scheduler_config, 6, h * w)
    with torch.no_grad():
        prefix = None
        for i, t in enumerate(timesteps):
            timestep = t.expand(1) / 1000
            full = _full_forward(transformer, embeds.embeds, embeds.image_mask, cond_tokens, latents, timestep,
                                 img_shapes)
            if i == 0:
                hidden = latents if cond_tokens is None else torch.cat([cond_tokens, latents], 1)
                pred, prefix = engine.prefill(layout, hidden, embeds.embeds, timestep)
            else:
                pred = engine.decode_step(prefix, latents, timestep, mode="eager").output
            assert (pred - full).abs().max().item() <= ATOL, f"step {i + 1}"
            latents = euler_step(latents, pred, sigmas[i], sigmas[i + 1])
    assert prefix.layout.prefix_len == layout.prefix_len


def test_wrong_prefix_would_be_detected(tiny_models, generator):
    """The comparison above is sensitive: prefix values off by the scale a wrong modulation row gives (x2) break it
    by far more than ATOL. (Permuting prefix tokens would not: attention is order-free once RoPE is applied.)"""
    transformer = tiny_models.transformer
    engine = DecodeEngine(transformer)
    a = generator.encoder.encode("a red cube")
    img_shapes = [(1, 8, 8)]
    layout = TokenLayout.build(a.image_mask, img_shapes, "cpu")
    latents = pack(initial_noise(0, 1, 64, 8, 8, torch.float32))
    t = torch.full((1,), 0.5)
    with torch.no_grad():
        full = _full_forward(transformer, a.embeds, a.image_mask, None, latents, t, img_shapes)
        _, prefix = engine.prefill(layout, latents, a.embeds, t)
        right = engine.decode_step(prefix, latents, t, mode="eager").output
        prefix.v[:] = [v * 2 for v in prefix.v]
        wrong = engine.decode_step(prefix, latents, t, mode="eager").output
    assert (right - full).abs().max().item() <= ATOL
    assert (wrong - full).abs().max().item() > 10 * ATOL


def lamp_request(tiny_models, generator, images):
    """A prompt's prefill inputs on the CPU: the token layout, the joint hidden rows (references first), the prompt's
    embeddings and the 8x6 target latents."""
    refs = prepare_references(images, 256)
    embeds = generator.encoder.encode("a lamp", [r.vision_image for r in refs])
    cond_latents = [encode_pixels(tiny_models.vae, r.vae_pixels) for r in refs]
    img_shapes = [(1, c.shape[2], c.shape[3]) for c in cond_latents] + [(1, 8, 6)]
    layout = TokenLayout.build(embeds.image_mask, img_shapes, "cpu")
    latents = pack(initial_noise(3, 1, 64, 8, 6, torch.float32))
    hidden = torch.cat([*(pack(c) for c in cond_latents), latents], 1)
    return layout, hidden, embeds, latents


@pytest.mark.parametrize("with_reference,padded", [(False, False), (True, False), (True, True)],
                         ids=["text-to-image", "edit", "edit-padded-text"])
def test_prefix_only_prefill_gives_the_same_cache(tiny_models, generator, reference_image, with_reference, padded):
    """The sampler's prefill runs the prefix rows alone (`with_target=False`) and predicts step 1 with a decode step.
    Invariant: its prefix K/V equal those of the joint forward, and that decode equals the joint forward's target
    rows (fp32, 1e-4 as above: the two differ only in how attention is split into calls), also with padded text
    (the last two text positions masked out, as a shorter prompt of a batch is)."""
    transformer = tiny_models.transformer
    engine = DecodeEngine(transformer)
    layout, hidden, embeds, latents = lamp_request(tiny_models, generator, [reference_image] if with_reference else [])
    t = torch.full((1,), 0.9)
    text_mask = None
    if padded:
        text_mask = torch.ones_like(embeds.image_mask)
        text_mask[:, -2:] = False
    with torch.no_grad():
        joint_pred, joint = engine.prefill(layout, hidden, embeds.embeds, t, text_mask=text_mask)
        none, alone = engine.prefill(layout, hidden, embeds.embeds, t, text_mask=text_mask, with_target=False)
        decoded = engine.decode_step(alone, latents, t, mode="eager").output
    assert none is None
    for a, b in zip(joint.k + joint.v, alone.k + alone.v):
        assert (a - b).abs().max().item() <= ATOL
    assert (decoded - joint_pred).abs().max().item() <= ATOL


def test_prefix_pass_stops_each_request_at_the_last_blocks_kv(tiny_models, generator):
    """The prefix pass keeps only K/V rows, so its last block stops after writing them: its output projection and
    MLP never run, every earlier block's do (and test_prefix_only_prefill_gives_the_same_cache holds the K/V to the
    joint forward's)."""
    transformer = tiny_models.transformer
    calls = []
    hooks = [module.register_forward_hook(lambda m, a, o, name=name: calls.append(name))
             for i, block in enumerate(transformer.transformer_blocks)
             for name, module in ((f"out{i}", block.attn.to_out[0]), (f"mlp{i}", block.img_mlp.out))]
    try:
        embeds = generator.encoder.encode("a lamp")
        layout = TokenLayout.build(embeds.image_mask, [(1, 8, 6)], "cpu")
        latents = pack(initial_noise(3, 1, 64, 8, 6, torch.float32))
        with torch.no_grad():
            DecodeEngine(transformer).prefill(layout, latents, embeds.embeds, torch.full((1,), 0.9),
                                              with_target=False)
    finally:
        for hook in hooks:
            hook.remove()
    last = len(transformer.transformer_blocks) - 1
    assert sorted(calls) == sorted(f"{kind}{i}" for i in range(last) for kind in ("out", "mlp"))
