"""The KV-Graph Sampler node with true CFG and a negative conditioning that carries other reference latents than the
positive's (core's Text Encode Qwen Image 2.1 on another image, or a hand-edited conditioning): each branch prefills
with its own references, as core's samplers do with each conditioning entry. The runtime against an independent
reference: tests/test_cfg_references.py. Tolerance: the node and the runtime run the same code on the same values,
so 1e-6 on raw latents; using the positive's references for both branches moves them by ~8e-3 here (asserted
above 1e-3, a thousand times the tolerance)."""

import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_execute import encode, image, load_all, sampler  # noqa: E402


def runtime_latents(env, transformer, positive, negative, latent, seed, cfg):
    """The runtime's latents (raw space) for the two conditionings, each branch given its own references."""
    pack = env.pack.__name__
    cond_mod = importlib.import_module(f"{pack}.graph_runtime.comfy_interop.conditioning")
    latents_mod = importlib.import_module(f"{pack}.graph_runtime.comfy_interop.latents")
    sampler_mod = importlib.import_module(f"{pack}.graph_runtime.sampling.sampler")
    stats = latents_mod.latent_stats()
    pos, neg = (cond_mod.conditioning_to_prompt(c, n, 64, transformer.module.config.context_in_dim)
                for c, n in ((positive, "positive"), (negative, "negative")))
    height, width = latent["samples"].shape[-2:]
    request = sampler_mod.SamplingRequest(
        positive=pos.embeds, negative=neg.embeds, cfg=cfg, latent_height=height, latent_width=width, seed=seed,
        steps=3, reference_latents=[latents_mod.raw_to_normalized(r, stats) for r in pos.reference_latents],
        negative_reference_latents=[latents_mod.raw_to_normalized(r, stats) for r in neg.reference_latents],
        decode_mode="eager", scheduler_config=transformer.scheduler_config)
    return latents_mod.normalized_to_raw(sampler_mod.sample(transformer.engine, request).latents, stats)


def test_the_negative_branch_prefills_with_its_own_references(comfy_env):
    env = comfy_env
    transformer, text_encoder, vae = load_all(env)
    positive, negative, latent = encode(env, text_encoder, vae=vae, images={"image1": image(96, 128)})
    (neg_cond, neg_extras), = negative
    other = [-r for r in neg_extras["reference_latents"]]  # another image's latents, the same shape
    negative_other = [[neg_cond, dict(neg_extras, reference_latents=other)]]

    out = sampler(env, transformer, positive, latent, negative=negative_other, cfg=4.0, seed=3)["samples"]
    same = sampler(env, transformer, positive, latent, negative=negative, cfg=4.0, seed=3)["samples"]
    expected = runtime_latents(env, transformer, positive, negative_other, latent, 3, 4.0)
    assert torch.allclose(out, expected, atol=1e-6, rtol=0)
    assert (out - same).abs().max() > 1e-3


def test_a_text_only_negative_with_a_reference_edit_runs(comfy_env):
    """A negative encoded without the positive's images (core's text encode node on the negative prompt alone) was
    refused; the negative branch now prefills its text alone, as its conditioning says."""
    env = comfy_env
    transformer, text_encoder, vae = load_all(env)
    positive, _, latent = encode(env, text_encoder, vae=vae, images={"image1": image(96, 128)})
    _, text_only, _ = encode(env, text_encoder)
    out = sampler(env, transformer, positive, latent, negative=text_only, cfg=2.0, seed=4)["samples"]
    expected = runtime_latents(env, transformer, positive, text_only, latent, 4, 2.0)
    assert torch.allclose(out, expected, atol=1e-6, rtol=0)
