"""Inpainting with the KV-Graph Sampler from a bf16 LATENT (the pack's VAE Encode with a bf16 VAE): the area the
noise mask keeps is the input latent itself. The input is normalized in float32 and the result goes back to raw
space in float32, so the kept area differs from the input by float32 round-off of the normalize and back (~1e-7
relative on latents of magnitude ~1: 1e-5 absolute allowed); normalizing in bf16 rounds it by ~4e-3 relative
(0.036 on real latents)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_execute import VAE_FILE, image, load_all, encode, run, sampler  # noqa: E402


def test_the_kept_area_of_a_bf16_latent_is_the_input(comfy_env):
    transformer, text_encoder, _ = load_all(comfy_env)
    vae, = run(comfy_env, "KVGraphLoadVAE", vae_name=VAE_FILE, dtype="bf16")
    positive, _, _ = encode(comfy_env, text_encoder)
    start, = run(comfy_env, "KVGraphVAEEncode", vae=vae, image=image(96, 128, seed=4))
    assert start["samples"].dtype == torch.bfloat16
    mask = torch.zeros(1, 1, 96, 128)
    mask[..., 64:] = 1.0
    out = sampler(comfy_env, transformer, positive, {"samples": start["samples"], "noise_mask": mask},
                  seed=2)["samples"]
    kept = (out[..., :4].float() - start["samples"][..., :4].float()).abs().max()
    assert kept <= 1e-5, f"the kept area moved by {kept:.3g}"
    assert (out[..., 4:].float() - start["samples"][..., 4:].float()).abs().max() > 1e-1
