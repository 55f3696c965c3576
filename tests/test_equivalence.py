"""Our sampler against diffusers' `QwenImage21Pipeline(use_kv_cache=True)` on the same tiny model.

Tolerance: on CPU in fp32 both run the same operations on the same values in the same order (our prefill calls
diffusers' own blocks; our decode step does the same products, only with RoPE written in real arithmetic and the
modulation rows read directly), so the latents agree to float32 round-off. We allow 1e-5 absolute on latents of
magnitude ~5 (a few ulps) so a future torch that reorders a reduction does not fail the test, while any real
difference (a wrong mask, position, sigma or modulation row) moves them by 1e-2 or more.
"""

import pytest
import torch

ATOL = 1e-5


def _ours(result):
    return result.latents.flatten(2).transpose(1, 2)


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def test_text_to_image_matches_pipeline(reference_pipeline, generator):
    """Text-to-image latents equal the pipeline's for the same seed, sigmas and prompt."""
    ref = reference_pipeline("a red cube on a blue sphere", height=256, width=256, num_inference_steps=4,
                             generator=torch.Generator("cpu").manual_seed(3), output_type="latent").images
    ours = generator.generate("a red cube on a blue sphere", width=256, height=256, steps=4, seed=3,
                              decode_mode="eager")
    assert ours.paths == ["eager", "eager", "eager", "eager"]  # step 1 too: prefix prefill, then a decode step
    assert _max_diff(ref, _ours(ours)) <= ATOL


def test_text_to_image_with_cfg_matches_pipeline(reference_pipeline, generator):
    """True CFG (separate cond/uncond prefix caches) equals the pipeline's, on a non-square size."""
    ref = reference_pipeline("a red cube", negative_prompt="blurry, low quality, watermark", true_cfg_scale=4.0,
                             height=256, width=192, num_inference_steps=4,
                             generator=torch.Generator("cpu").manual_seed(5), output_type="latent").images
    ours = generator.generate("a red cube", negative_prompt="blurry, low quality, watermark", cfg=4.0, width=192,
                              height=256, steps=4, seed=5, decode_mode="eager")
    assert len(ours.paths) == 8  # two branches per step
    assert _max_diff(ref, _ours(ours)) <= ATOL


def test_one_reference_edit_matches_pipeline(reference_pipeline, generator, reference_image):
    """A one-reference edit (VLM sees the image, VAE latents form a condition block) equals the pipeline's."""
    ref = reference_pipeline("make the sky purple", image=reference_image, height=256, width=256,
                             num_inference_steps=3, generator=torch.Generator("cpu").manual_seed(0),
                             output_type="latent", output_resolution=256).images
    ours = generator.generate("make the sky purple", images=[reference_image], width=256, height=256, steps=3,
                              seed=0, reference_resolution=256, decode_mode="eager")
    assert _max_diff(ref, _ours(ours)) <= ATOL


def test_turbo_sigmas_match_pipeline(reference_pipeline, generator):
    """The Turbo preset is the pipeline's `sigmas=` run of the 8-step grid under a scheduler that uses the grid as
    given (no dynamic shift, no terminal stretch), which is how ComfyUI's Turbo templates sample the Turbo model."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from graph_runtime.sampling.schedule import TURBO_SIGMAS, fixed_grid_scheduler_config

    base = reference_pipeline.scheduler
    reference_pipeline.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        fixed_grid_scheduler_config(dict(base.config)))
    try:
        ref = reference_pipeline("a lighthouse", height=128, width=128, sigmas=list(TURBO_SIGMAS),
                                 generator=torch.Generator("cpu").manual_seed(1), output_type="latent").images
    finally:
        reference_pipeline.scheduler = base
    ours = generator.generate("a lighthouse", width=128, height=128, steps=8, seed=1, sigma_preset="turbo",
                              decode_mode="eager")
    assert len(ours.paths) == 8
    assert _max_diff(ref, _ours(ours)) <= ATOL


def test_different_seeds_differ(generator):
    """Guards the tests above against a sampler that ignores its inputs."""
    a = generator.generate("a red cube", width=128, height=128, steps=2, seed=1, decode_mode="eager").latents
    b = generator.generate("a red cube", width=128, height=128, steps=2, seed=2, decode_mode="eager").latents
    assert _max_diff(a, b) > 1e-2


def test_batch_of_two_matches_pipeline_images_per_prompt(reference_pipeline, generator):
    """batch_size=2 draws the same [2, ...] noise and repeats the prompt as `num_images_per_prompt=2` does."""
    ref = reference_pipeline("a red cube", height=128, width=128, num_inference_steps=3, num_images_per_prompt=2,
                             generator=torch.Generator("cpu").manual_seed(9), output_type="latent").images
    ours = generator.generate("a red cube", width=128, height=128, steps=3, seed=9, batch_size=2,
                              decode_mode="eager")
    assert ours.latents.shape[0] == 2
    assert _max_diff(ref, _ours(ours)) <= ATOL
