"""True CFG where the negative was encoded with other reference images than the positive: each branch prefills with
the references its own prompt was encoded with (the K/V prefix is per branch anyway), on the KV-Graph Sampler (the
runtime and the node) and on core samplers over the pack's MODEL.

diffusers' `QwenImage21Pipeline` gives both branches one set of images, so it does not define this case; the
reference here is an independent loop: diffusers' transformer run whole (no prefix cache) per branch, with each
branch's own prompt embeddings and reference latents, combined as the pipeline combines true CFG, stepped with
flow-match Euler. Tolerance: on CPU in fp32 the cached prefix and the whole forward do the same products in another
grouping (float32 round-off of latents of magnitude ~5, scaled by cfg 4 through the combination): 5e-5 absolute;
a branch sampled with the wrong references moves the latents by 1e-2 or more (asserted too, so the check has teeth).
"""

import numpy as np
import pytest
import torch
from PIL import Image

from graph_runtime.encoding.images import encode_pixels, prepare_references
from graph_runtime.sampling.sampler import SamplingRequest, pack, sample, unpack
from graph_runtime.sampling.schedule import build_schedule, model_timestep

ATOL = 5e-5
H = W = 8  # latent tokens of the target (128 px)
CFG = 4.0
STEPS = 3


def _image(seed, size=(128, 96)):
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def branches(generator, tiny_models, reference_image):
    """A positive encoded with one image and a negative encoded with another of the same size, with their latents
    (normalized space), plus a text-only negative. The tiny random VAE maps different images to nearly the same
    latents (max difference ~0.1), so the negative's reference latents are a stand-in far from the positive's (its
    negation), which the tiny transformer tells apart."""
    ref_a = prepare_references([reference_image], 128)[0]
    ref_b = prepare_references([_image(7)], 128)[0]
    enc = generator.encoder
    return {
        "positive": enc.encode("make the sky purple", [ref_a.vision_image]),
        "negative": enc.encode("blurry, low quality", [ref_b.vision_image]),
        "negative_text": enc.encode("blurry, low quality"),
        "latent_a": encode_pixels(tiny_models.vae, ref_a.vae_pixels),
        "latent_b": -encode_pixels(tiny_models.vae, ref_a.vae_pixels),
    }


def reference_cfg(transformer, scheduler_config, seed, positive, pos_refs, negative, neg_refs):
    """Independent reference: the whole diffusers transformer per branch and step, each branch with its own prompt
    and reference latents; `neg + cfg * (pos - neg)`; flow-match Euler in fp32."""
    timesteps, sigmas = build_schedule(scheduler_config, STEPS, H * W)
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = pack(torch.randn((1, 1, 64, H, W), generator=generator)[:, 0])

    def predict(embeds, refs, t):
        joint = torch.cat([*(pack(r) for r in refs), latents], dim=1)
        img_mask = torch.cat([embeds.image_mask.bool(), torch.ones(1, H * W // 4, dtype=torch.bool)], dim=1)
        shapes = [[*((1, r.shape[2], r.shape[3]) for r in refs), (1, H, W)]]
        out = transformer(hidden_states=joint, encoder_hidden_states=embeds.embeds,
                          timestep=model_timestep(t, torch.float32), img_shapes=shapes, img_mask=img_mask,
                          return_dict=False)[0]
        return out[:, -H * W:]

    with torch.no_grad():
        for i, t in enumerate(timesteps):
            t = t.reshape(1)
            cond, uncond = predict(positive, pos_refs, t), predict(negative, neg_refs, t)
            velocity = uncond + CFG * (cond - uncond)
            latents = latents + (sigmas[i + 1] - sigmas[i]) * velocity
    return unpack(latents, H, W)


def kvgraph(generator, tiny_models, positive, pos_refs, negative, neg_refs, seed):
    request = SamplingRequest(positive=positive, negative=negative, cfg=CFG, reference_latents=pos_refs,
                              negative_reference_latents=neg_refs, latent_height=H, latent_width=W, steps=STEPS,
                              seed=seed, decode_mode="eager", scheduler_config=tiny_models.scheduler_config)
    return sample(generator.engine, request).latents


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def test_each_cfg_branch_prefills_with_its_own_references(generator, tiny_models, branches):
    """A negative encoded with another image of the same size: the sampler's latents equal the independent loop
    where each branch sees its own image, and differ from the positive's image used for both."""
    b = branches
    ours = kvgraph(generator, tiny_models, b["positive"], [b["latent_a"]], b["negative"], [b["latent_b"]], 3)
    expected = reference_cfg(tiny_models.transformer, tiny_models.scheduler_config, 3, b["positive"],
                             [b["latent_a"]], b["negative"], [b["latent_b"]])
    assert max_diff(ours, expected) <= ATOL
    wrong = reference_cfg(tiny_models.transformer, tiny_models.scheduler_config, 3, b["positive"],
                          [b["latent_a"]], b["negative"], [b["latent_a"]])
    assert max_diff(wrong, expected) > 1e-2


def test_a_text_only_negative_runs_without_references(generator, tiny_models, branches):
    """A negative encoded without images (another prefix length) prefills only its text, as its conditioning says."""
    b = branches
    ours = kvgraph(generator, tiny_models, b["positive"], [b["latent_a"]], b["negative_text"], [], 4)
    expected = reference_cfg(tiny_models.transformer, tiny_models.scheduler_config, 4, b["positive"],
                             [b["latent_a"]], b["negative_text"], [])
    assert max_diff(ours, expected) <= ATOL


def test_without_negative_references_the_positives_serve_both(generator, tiny_models, branches):
    """Left unset (the command line, diffusers' pipeline: one set of images for the prompt), the negative branch
    prefills with the positive's references."""
    b = branches
    ours = kvgraph(generator, tiny_models, b["positive"], [b["latent_a"]], b["negative"], None, 5)
    expected = reference_cfg(tiny_models.transformer, tiny_models.scheduler_config, 5, b["positive"],
                             [b["latent_a"]], b["negative"], [b["latent_a"]])
    assert max_diff(ours, expected) <= ATOL


def test_a_negative_reference_with_nan_is_refused_by_name(generator, tiny_models, branches):
    from graph_runtime.errors import InputError

    b = branches
    bad = torch.full_like(b["latent_b"], float("nan"))
    with pytest.raises(InputError, match="negative reference latent 0"):
        kvgraph(generator, tiny_models, b["positive"], [b["latent_a"]], b["negative"], [bad], 1)


def test_core_samplers_give_each_branch_its_own_references(generator, tiny_models, branches):
    """Core's CFG on the pack's MODEL (the model function as CFGGuider calls it, one conditioning entry per branch,
    each carrying its own reference latents): the same latents as the independent loop."""
    from graph_runtime.comfy_interop.latents import latent_stats
    from graph_runtime.core_model import ModelFunction, SamplingRun
    from tests.test_core_model import comfy_noise, core_euler, source

    b = branches
    stats = latent_stats()  # what a conditioning entry's raw references are normalized with (PrefixSource)
    raw_a, raw_b = (b[k] * stats.std + stats.mean for k in ("latent_a", "latent_b"))
    _, sigmas = build_schedule(tiny_models.scheduler_config, STEPS, H * W)
    with SamplingRun(generator.engine, "eager") as run:
        ours, calls = core_euler(ModelFunction(generator.engine), comfy_noise(6, (1, 64, H, W)), sigmas,
                                 source(b["positive"], [raw_a]), source(b["negative"], [raw_b]), cfg=CFG, run=run)
        assert run.counts.prefills == 2 and calls == [0, 1] * STEPS
    expected = reference_cfg(tiny_models.transformer, tiny_models.scheduler_config, 6, b["positive"],
                             [b["latent_a"]], b["negative"], [b["latent_b"]])
    assert max_diff(ours, expected) <= ATOL
