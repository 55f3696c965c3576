"""graph_runtime.comfy_interop: ComfyUI's LATENT / CONDITIONING conventions <-> the runtime's, in pure code.

The conditioning format is core ComfyUI's Qwen-Image-2.1 one (comfy/text_encoders/qwen_image21.py drops the vision
tokens and records `image_slots`; comfy/ldm/qwen_image21/model.py splices each reference latent in at its slot, or
after the text when it has none; comfy/model_base.py normalizes `reference_latents` with the latent format).
"""

import inspect
import os
import time

import numpy as np
import pytest
import torch

from graph_runtime import comfy_interop as ci
from graph_runtime.encoding.images import encode_pixels, prepare_references
from graph_runtime.errors import InputError
from tests.owners import loaded_for
from graph_runtime.sampling.sampler import SamplingRequest, sample

C = 64


def core_conditioning(text_len=12, slots=(3, 10), ref_shapes=((4, 4), (2, 4)), mask=None, width=8):
    """A conditioning shaped like core's TextEncodeQwenImage21 output (values are just distinguishable)."""
    cond = torch.arange(text_len, dtype=torch.float32).view(1, text_len, 1).expand(1, text_len, width).clone()
    refs = [torch.randn(1, C, h, w) for h, w in ref_shapes]
    extras = {"pooled_output": None, "reference_latents": refs}
    if slots is not None:
        extras["image_slots"] = list(slots)
    if mask is not None:
        extras["attention_mask"] = mask
    return [[cond, extras]], cond, refs


def test_core_slots_splice_each_reference_at_its_index():
    conditioning, cond, refs = core_conditioning()
    parsed = ci.conditioning_to_prompt(conditioning)
    mask = parsed.embeds.image_mask[0]
    # image 1 (4x4 tokens = 4 slots) before text row 3, image 2 (2x4 = 2 slots) before text row 10
    assert mask.nonzero(as_tuple=True)[0].tolist() == [3, 4, 5, 6, 14, 15]
    assert parsed.embeds.embeds.shape == (1, 12 + 6, 8)
    text_rows = parsed.embeds.embeds[0, ~mask, 0]
    assert text_rows.tolist() == list(range(12))  # every text row kept, in order
    assert bool((parsed.embeds.embeds[0, mask] == 0).all())
    assert parsed.embeds.text_mask is None
    assert all(torch.equal(r, s) for r, s in zip(parsed.reference_latents, refs)) and len(refs) == 2


def test_references_without_slots_go_after_the_text_and_extra_slots_are_ignored():
    parsed = ci.conditioning_to_prompt(core_conditioning(slots=None)[0])
    assert parsed.embeds.image_mask[0].nonzero(as_tuple=True)[0].tolist() == list(range(12, 18))
    parsed = ci.conditioning_to_prompt(core_conditioning(slots=(5,), ref_shapes=((2, 2), (2, 2)))[0])
    assert parsed.embeds.image_mask[0].nonzero(as_tuple=True)[0].tolist() == [5, 13]
    parsed = ci.conditioning_to_prompt(core_conditioning(slots=(1, 2, 7), ref_shapes=((2, 2),))[0])
    assert parsed.embeds.image_mask[0].nonzero(as_tuple=True)[0].tolist() == [1]


def test_video_style_reference_and_attention_mask():
    conditioning, _, _ = core_conditioning(slots=(2,), ref_shapes=((2, 2),))
    conditioning[0][1]["reference_latents"] = [torch.randn(1, C, 1, 2, 2)]
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, :3] = 0
    conditioning[0][1]["attention_mask"] = mask
    parsed = ci.conditioning_to_prompt(conditioning)
    assert parsed.reference_latents[0].shape == (1, C, 2, 2)
    # the padding rows stay masked, the image slot is valid
    assert parsed.embeds.text_mask[0].tolist() == [False, False, True, False] + [True] * 9


@pytest.mark.parametrize("mutate, names", [
    (lambda c: c.append(c[0]), "positive"),
    (lambda c: c[0][1].update(image_slots=[13, 14]), "image_slots[0]"),
    (lambda c: c[0][1].update(image_slots=[6, 2]), "image_slots[1]"),
    (lambda c: c[0][1].update(reference_latents=[torch.randn(1, C, 3, 3), torch.randn(1, C, 2, 2)]),
     "reference_latents[0]"),
    (lambda c: c[0][1].update(reference_latents=[torch.randn(1, 16, 2, 2)]), "reference_latents[0]"),
])
def test_malformed_conditioning_names_what_is_wrong(mutate, names):
    conditioning = core_conditioning()[0]
    mutate(conditioning)
    with pytest.raises(InputError) as err:
        ci.conditioning_to_prompt(conditioning, "positive")
    assert names in str(err.value) and "expected" in str(err.value)


def test_not_a_conditioning():
    with pytest.raises(InputError, match="positive"):
        ci.conditioning_to_prompt({"samples": torch.zeros(1)}, "positive")
    with pytest.raises(InputError, match="negative"):
        ci.conditioning_to_prompt([[torch.zeros(4, 4), {}]], "negative")


@pytest.fixture(scope="module")
def two_references(reference_image):
    from PIL import Image

    second = Image.fromarray((np.random.RandomState(1).rand(64, 96, 4) * 255).astype("uint8"), mode="RGBA")
    return prepare_references([reference_image, second], 128)


def test_pack_conditioning_matches_core_layout_and_round_trips(generator, tiny_models, two_references):
    refs = two_references
    embeds = generator.encoder.encode("put image 2 on image 1", [r.vision_image for r in refs])
    raw = [ci.encode_pixels_raw(tiny_models.vae, r.vae_pixels) for r in refs]
    conditioning = ci.prompt_to_conditioning(embeds, raw)
    cond, extras = conditioning[0]
    # core's format: no vision rows in cond, one slot index per image, raw latents, no mask when unpadded
    assert cond.shape[1] == embeds.embeds.shape[1] - int(embeds.image_mask[0].sum())
    assert len(extras["image_slots"]) == 2 and extras["image_slots"][0] < extras["image_slots"][1]
    assert "attention_mask" not in extras and extras["pooled_output"] is None
    parsed = ci.conditioning_to_prompt(conditioning)
    assert torch.equal(parsed.embeds.image_mask, embeds.image_mask)
    keep = ~embeds.image_mask[0]
    assert torch.equal(parsed.embeds.embeds[:, keep], embeds.embeds[:, keep])
    assert all(torch.equal(a, b) for a, b in zip(parsed.reference_latents, raw))


def test_round_trip_is_lossless_for_sampling(generator, tiny_models, two_references):
    """Sampling from the parsed conditioning gives bit-identical latents to sampling from the encoder's output:
    the dropped vision rows are never read by the transformer."""
    refs = two_references
    embeds = generator.encoder.encode("swap them", [r.vision_image for r in refs])
    raw = [ci.encode_pixels_raw(tiny_models.vae, r.vae_pixels) for r in refs]
    parsed = ci.conditioning_to_prompt(ci.prompt_to_conditioning(embeds, raw))
    stats = ci.latent_stats(tiny_models.vae)
    normalized_direct = [encode_pixels(tiny_models.vae, r.vae_pixels) for r in refs]
    normalized_parsed = [ci.raw_to_normalized(r, stats) for r in parsed.reference_latents]
    assert all(torch.equal(a, b) for a, b in zip(normalized_direct, normalized_parsed))
    engine = loaded_for(tiny_models.transformer).engine

    def run(prompt, references):
        request = SamplingRequest(positive=prompt, latent_height=4, latent_width=6, reference_latents=references,
                                  seed=3, steps=3, scheduler_config=tiny_models.scheduler_config)
        return sample(engine, request).latents

    assert torch.equal(run(embeds, normalized_direct), run(parsed.embeds, normalized_parsed))


def test_latent_stats_are_qwen_image_21s_and_match_the_vae(tiny_models):
    from diffusers import AutoencoderKLQwenImage21

    params = inspect.signature(AutoencoderKLQwenImage21.__init__).parameters
    stats = ci.latent_stats()
    assert stats.mean.shape == (1, C, 1, 1)
    assert stats.mean.flatten().tolist() == pytest.approx(params["latents_mean"].default)
    assert stats.std.flatten().tolist() == pytest.approx(params["latents_std"].default)
    assert torch.equal(ci.latent_stats(tiny_models.vae).mean, stats.mean)
    x = torch.randn(2, C, 3, 5)
    assert torch.allclose(ci.normalized_to_raw(ci.raw_to_normalized(x, stats), stats), x, atol=1e-5)


def test_latent_samples_validation():
    z = torch.zeros(2, C, 4, 6)
    assert ci.latent_samples({"samples": z}) is z
    assert ci.latent_samples({"samples": z.unsqueeze(2)}).shape == (2, C, 4, 6)
    for bad in ({"samples": torch.zeros(1, 16, 8, 8)}, {"x": z}, z):
        with pytest.raises(InputError, match="latent"):
            ci.latent_samples(bad, "latent")
    assert ci.empty_latent(128, 96)["samples"].shape == (1, C, 6, 8)


def test_pixel_conversions():
    rgb = torch.rand(2, 32, 48, 3)
    pixels = ci.comfy_image_to_vae_pixels(rgb)
    assert pixels.shape == (2, 4, 1, 32, 48) and bool((pixels[:, 3] == 1).all())
    assert torch.allclose((pixels[:, :3, 0] + 1) / 2, rgb.movedim(-1, 1), atol=1e-6)
    out = ci.vae_pixels_to_comfy_image(pixels[:, :, 0])
    assert out.shape == (2, 32, 48, 3) and torch.allclose(out, rgb, atol=1e-6)
    transparent = pixels[:, :, 0].clone()
    transparent[:, 3] = -1.0  # alpha 0: composited over white
    assert bool((ci.vae_pixels_to_comfy_image(transparent) == 1).all())
    # The alpha as core's Load Image gives a mask: 1 - alpha (1 where transparent); an RGB output is opaque.
    half = pixels[:, :, 0].clone()
    half[:, 3] = torch.linspace(-1, 1, 48)
    assert torch.allclose(ci.vae_pixels_to_comfy_mask(half), 1 - (half[:, 3] + 1) / 2, atol=1e-7)
    assert ci.vae_pixels_to_comfy_mask(transparent).eq(1).all()
    assert ci.vae_pixels_to_comfy_mask(pixels[:, :, 0]).eq(0).all()
    assert ci.vae_pixels_to_comfy_mask(pixels[:, :3, 0]).shape == (2, 32, 48)
    assert ci.crop_to_multiple(torch.rand(1, 40, 50, 3)).shape == (1, 32, 48, 3)
    with pytest.raises(InputError, match="image"):
        ci.comfy_image_to_vae_pixels(torch.rand(1, 8, 8, 2))


def test_preview_projection_is_fitted_to_the_vae(tiny_models):
    projection = ci.fit_preview_projection(tiny_models.vae, size=64)
    assert projection.factors.shape == (C, 3) and projection.bias.shape == (3,)
    # A solid colour, encoded and previewed, comes back closer to itself than gray does.
    colour = torch.tensor([0.8, -0.6, 0.2])
    pixels = torch.cat([colour.view(1, 3, 1, 1).expand(1, 3, 64, 64), torch.ones(1, 1, 64, 64)], 1).unsqueeze(2)
    latents = encode_pixels(tiny_models.vae, pixels)
    image = np.asarray(ci.preview_image(latents, projection), dtype=np.float32) / 127.5 - 1
    gray = np.asarray(ci.preview_image(latents, ci.gray_projection()), dtype=np.float32) / 127.5 - 1
    assert image.shape == (4, 4, 3)
    assert np.abs(image - colour.numpy()).mean() < np.abs(gray - colour.numpy()).mean()


def test_file_identity_follows_size_and_mtime(tmp_path):
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"1234")
    first = ci.file_identity(f)
    assert first == ci.file_identity(str(f))
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert ci.file_identity(f) != first
    folder = tmp_path / "pipe"
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "a.safetensors").write_bytes(b"x")
    before = ci.file_identity(folder)
    (folder / "transformer" / "a.safetensors").write_bytes(b"xy")
    assert ci.file_identity(folder) != before
