"""The model function core samplers call (graph_runtime/core_model), driven the way ComfyUI's samplers drive it, with
no ComfyUI needed.

`core_euler` below is ComfyUI's `sample_euler` over a flow-matching (CONST) model, written out: the model returns the
velocity, core turns it into `denoised = x - sigma * v`, takes `d = (x - denoised) / sigma` and steps
`x += d * (sigma_next - sigma)`; CFG combines the denoised predictions (`cfg_function`); a noise mask re-noises the
unmasked region to the input latent at every call and takes the input latent as its prediction there
(`KSamplerX0Inpaint`). The KV-Graph Sampler steps the velocity directly in the pipeline's order (fp32 update, cast
back), so the two differ by float32 round-off only.

Tolerance: the tiny model runs in fp32; core's path computes the velocity back out of `denoised` (two more
roundings per step, each ~1e-7 relative on latents of magnitude ~5) over 3-5 steps, so the two agree to a few
float32 ulps of those latents (CFG, which scales the difference of two predictions by 4, a few more). 2e-5 absolute
leaves room for that and for a reordered reduction, while any real difference (a wrong timestep rounding, a prefix
from the wrong prompt, a sigma off by one step) moves the latents by 1e-2 or more (`test_a_wrong_sigma_is_caught`
checks the scale).
"""

import logging

import pytest
import torch

from graph_runtime.comfy_interop.conditioning import prompt_to_conditioning
from graph_runtime.comfy_interop.latents import latent_stats, raw_to_normalized
from graph_runtime.core_model import ModelFunction, PrefixSource, SamplingRun
from graph_runtime.decode import DecodeEngine
from graph_runtime.encoding.images import encode_pixels, prepare_references
from graph_runtime.sampling.sampler import SamplingRequest, sample
from graph_runtime.sampling.schedule import build_schedule
from tests.test_graph_manager import RecordingBackend

ATOL = 2e-5
H = W = 8  # latent tokens (128 px)


def comfy_noise(seed, shape):
    """ComfyUI's `prepare_noise`: randn of the latent's shape from the seeded default CPU generator."""
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)


def core_euler(fn, noise, sigmas, positive, negative=None, cfg=1.0, latent=None, mask=None, run=None):
    """ComfyUI's Euler over a CONST model: returns the final latents (normalized space) and the model calls made."""
    calls = []
    latent = torch.zeros_like(noise) if latent is None else latent

    def model(x, sigma):
        if mask is not None:  # KSamplerX0Inpaint: the unmasked region follows the input latent's noising path
            x = x * mask + (sigma * noise + (1 - sigma) * latent) * (1 - mask)
        s = torch.full((x.shape[0],), float(sigma))
        conds = [(positive, 0)] + ([(negative, 1)] if cfg != 1.0 else [])
        out = {}
        for source, role in conds:
            calls.append(role)
            velocity = fn(x, s, source, run=run, roles=[role]).float()
            out[role] = x - velocity * sigma  # CONST.calculate_denoised
        denoised = out[0] if cfg == 1.0 else out[1] + (out[0] - out[1]) * cfg
        if mask is not None:
            denoised = denoised * mask + latent * (1 - mask)
        return denoised

    x = sigmas[0] * noise + (1 - sigmas[0]) * latent  # CONST.noise_scaling
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i]
        denoised = model(x, sigma)
        d = (x - denoised) / sigma
        x = x + d * (sigmas[i + 1] - sigma)
    return x, calls


@pytest.fixture(scope="module")
def encoded(generator):
    enc = generator.encoder
    return {
        "positive": enc.encode("a red cube on a blue sphere"),
        "negative": enc.encode("blurry, low quality"),
    }


def source(embeds, references=()):
    """A conditioning entry as core hands it to the model: the pack's CONDITIONING format, read back."""
    (cond, extras), = prompt_to_conditioning(embeds, references)
    return PrefixSource.from_conditioning(cond, extras)


def schedule(tiny_models, steps):
    _, sigmas = build_schedule(tiny_models.scheduler_config, steps, H * W)
    return sigmas


def kvgraph_sampler(generator, tiny_models, embeds, steps, seed, **extra):
    request = SamplingRequest(positive=embeds, latent_height=H, latent_width=W, steps=steps, seed=seed,
                              decode_mode="eager", scheduler_config=tiny_models.scheduler_config, **extra)
    return sample(generator.engine, request).latents


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def test_core_euler_equals_the_kvgraph_sampler(generator, tiny_models, encoded):
    """From the same starting noise and sigmas, core's Euler on the model function gives the KV-Graph Sampler's
    latents (and so diffusers' pipeline's, tests/test_equivalence.py); one prefill serves every step."""
    fn = ModelFunction(generator.engine)
    sigmas = schedule(tiny_models, 5)
    with SamplingRun(generator.engine, "eager") as run:
        ours, calls = core_euler(fn, comfy_noise(7, (1, 64, H, W)), sigmas, source(encoded["positive"]), run=run)
        assert run.counts.prefills == 1 and run.counts.calls == 5 == len(calls)
        assert run.counts.distinct_sigmas() == 5
    expected = kvgraph_sampler(generator, tiny_models, encoded["positive"], 5, 7)
    assert max_diff(ours, expected) <= ATOL


def test_core_cfg_with_a_negative_equals_the_kvgraph_sampler(generator, tiny_models, encoded):
    """CFG as core computes it (on the denoised predictions) equals the sampler's true CFG (on velocities); the
    positive and the negative are two prefixes, each prefilled once."""
    fn = ModelFunction(generator.engine)
    sigmas = schedule(tiny_models, 4)
    with SamplingRun(generator.engine, "eager") as run:
        ours, calls = core_euler(fn, comfy_noise(5, (1, 64, H, W)), sigmas, source(encoded["positive"]),
                                 source(encoded["negative"]), cfg=4.0, run=run)
        assert run.counts.prefills == 2 and calls == [0, 1] * 4
    expected = kvgraph_sampler(generator, tiny_models, encoded["positive"], 4, 5, negative=encoded["negative"],
                               cfg=4.0)
    assert max_diff(ours, expected) <= ATOL


def test_core_euler_on_a_reference_edit_equals_the_kvgraph_sampler(generator, tiny_models, reference_image):
    """An edit: the reference latents ride in the conditioning (raw VAE space, as core carries them) and enter the
    prefix normalized, as the sampler's do."""
    ref = prepare_references([reference_image], 128)[0]
    embeds = generator.encoder.encode("make the sky purple", [ref.vision_image])
    normalized = encode_pixels(tiny_models.vae, ref.vae_pixels)
    stats = latent_stats(tiny_models.vae)
    raw = normalized * stats.std + stats.mean
    fn = ModelFunction(generator.engine)
    sigmas = schedule(tiny_models, 3)
    with SamplingRun(generator.engine, "eager") as run:
        ours, _ = core_euler(fn, comfy_noise(2, (1, 64, H, W)), sigmas, source(embeds, [raw]), run=run)
    expected = kvgraph_sampler(generator, tiny_models, embeds, 3, 2,
                               reference_latents=[raw_to_normalized(raw, stats)])
    assert max_diff(ours, expected) <= ATOL


def test_a_wrong_sigma_is_caught(generator, tiny_models, encoded):
    """The scale the tolerance guards: the same run with one sigma changed by a step's worth differs by far more."""
    fn = ModelFunction(generator.engine)
    sigmas = schedule(tiny_models, 5)
    shifted = sigmas.clone()
    shifted[2] = sigmas[3]
    noise = comfy_noise(7, (1, 64, H, W))
    a, _ = core_euler(fn, noise, sigmas, source(encoded["positive"]))
    b, _ = core_euler(fn, noise, torch.cat([shifted[:3], sigmas[3:]]), source(encoded["positive"]))
    assert max_diff(a, b) > 100 * ATOL


def test_a_masked_run_keeps_the_unmasked_region(generator, tiny_models, encoded):
    """Inpainting as KSampler does it: where the noise mask is 0 the result is the input latent (float32 round-off:
    the region follows `sigma * noise + (1 - sigma) * latent` to sigma 0), where it is 1 it is sampled anew."""
    fn = ModelFunction(generator.engine)
    latent = comfy_noise(100, (1, 64, H, W))  # a stand-in for an encoded image
    mask = torch.zeros(1, 1, H, W)
    mask[..., 2:6, 2:6] = 1.0
    out, _ = core_euler(fn, comfy_noise(3, (1, 64, H, W)), schedule(tiny_models, 4), source(encoded["positive"]),
                        latent=latent, mask=mask)
    keep = mask.expand_as(out) == 0
    assert max_diff(out[keep], latent[keep]) <= 1e-5
    assert max_diff(out[~keep], latent[~keep]) > 1e-1


def test_equal_conditioning_shares_one_prefix_and_different_conditioning_does_not(generator, encoded):
    """Prefixes are found by content: the same prompt as new tensors (core moves and repeats them every step) is one
    prefix; another prompt, or the same prompt with another reference, is another."""
    a1, a2 = source(encoded["positive"]), source(encoded["positive"])
    b = source(encoded["negative"])
    assert a1 == a2 and hash(a1) == hash(a2) and a1 != b
    fn = ModelFunction(generator.engine)
    x, s = comfy_noise(1, (1, 64, H, W)), torch.full((1,), 0.9)
    with SamplingRun(generator.engine, "eager") as run:
        fn(x, s, a1, run=run, roles=[0])
        fn(x, s * 0.5, a2, run=run, roles=[0])
        assert run.counts.prefills == 1
        fn(x, s, b, run=run, roles=[1])
        assert run.counts.prefills == 2 and run.counts.calls == 3


def test_a_batched_call_of_cond_and_uncond_equals_two_calls(generator, encoded):
    """Core batches equal conditionings into one call (here the positive twice, as cond and uncond): the call's
    prediction equals the per-chunk ones."""
    fn = ModelFunction(generator.engine)
    x, s = comfy_noise(4, (2, 64, H, W)), torch.full((2,), 0.7)
    positive = source(encoded["positive"])
    with SamplingRun(generator.engine, "eager") as run:
        both = fn(x, s, positive, run=run, roles=[0, 1])
        first = fn(x[:1], s[:1], positive, run=run, roles=[0])
        second = fn(x[1:], s[1:], positive, run=run, roles=[1])
    assert max_diff(both, torch.cat([first, second])) <= 1e-5


def test_the_run_releases_its_prefixes_and_frees_their_graph_entries(tiny_models, generator, encoded):
    """Ownership holds for core sampling: while a run is alive its prefix owns the graph entry of its shape, so a
    second run in flight decodes that shape eagerly (never sharing the buffers); once the first run ends, the next
    run replays the same entry (no new capture)."""
    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    fn = ModelFunction(engine)
    x, s = comfy_noise(1, (1, 64, H, W)), torch.full((1,), 0.8)
    positive = source(encoded["positive"])
    first = SamplingRun(engine)
    fn(x, s, positive, run=first, roles=[0])
    assert first.counts.paths == {"capture": 1}
    with SamplingRun(engine) as second:
        fn(x, s, positive, run=second, roles=[0])
        assert second.counts.eager == {"graph entry owned by another live request": 1}
    first.release()
    assert first.released and engine.graphs.owners.alive(next(iter(engine.graphs.entries))) is False
    with SamplingRun(engine) as third:
        fn(x, s, positive, run=third, roles=[0])
        assert third.counts.paths == {"replay": 1}
    assert engine.stats.captures == 1


def test_a_call_after_its_run_ended_is_refused(generator, encoded):
    fn = ModelFunction(generator.engine)
    run = SamplingRun(generator.engine, "eager")
    run.release()
    with pytest.raises(RuntimeError, match="after its sampling run ended"):
        fn(comfy_noise(1, (1, 64, H, W)), torch.ones(1), source(encoded["positive"]), run=run)


def test_a_call_without_a_run_is_correct_and_logged_once(generator, encoded, caplog):
    """Called outside a sampling run (a custom sampler that sets none up), each call prefills its own prefix and
    releases it: the same prediction as inside a run, one warning for all such calls."""
    fn = ModelFunction(generator.engine)
    x, s = comfy_noise(6, (1, 64, H, W)), torch.full((1,), 0.5)
    positive = source(encoded["positive"])
    with SamplingRun(generator.engine, "eager") as run:
        inside = fn(x, s, positive, run=run)
    with caplog.at_level(logging.WARNING, logger="kvgraph"):
        alone = fn(x, s, positive)
        fn(x, s, positive)
    assert max_diff(inside, alone) <= 1e-6
    assert sum("outside a sampling run" in r.getMessage() for r in caplog.records) == 1


def test_the_first_call_enters_the_runs_hold_and_release_leaves_it(generator, encoded):
    """A run holds what its caller asked (the LoRA set) from its first model call to its end, once."""
    events = []

    class Hold:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    fn = ModelFunction(generator.engine)
    run = SamplingRun(generator.engine, "eager", on_first_call=Hold)
    assert events == []
    for _ in range(3):
        fn(comfy_noise(1, (1, 64, H, W)), torch.full((1,), 0.5), source(encoded["positive"]), run=run)
    assert events == ["enter"]
    run.release()
    run.release()
    assert events == ["enter", "exit"]


def test_the_kvgraph_sampler_inpaints_as_ksampler_does(generator, tiny_models, encoded):
    """The KV-Graph Sampler with a noise mask takes KSampler's steps: the same latents as core's Euler with the
    mask, from the same noise and input latent (float32 round-off), and the unmasked region is the input latent."""
    latent = comfy_noise(100, (1, 64, H, W))
    mask = torch.zeros(1, 1, H, W)
    mask[..., :, 4:] = 1.0
    mask[..., 3, 3] = 0.5  # a soft edge blends the two
    sigmas = schedule(tiny_models, 4)
    core, _ = core_euler(ModelFunction(generator.engine), comfy_noise(9, (1, 64, H, W)), sigmas,
                         source(encoded["positive"]), latent=latent, mask=mask)
    ours = kvgraph_sampler(generator, tiny_models, encoded["positive"], 4, 9, init_latents=latent, noise_mask=mask)
    assert max_diff(ours, core) <= ATOL
    keep = mask.expand_as(ours) == 0
    assert max_diff(ours[keep], latent[keep]) <= 1e-5
    assert max_diff(ours[~keep], latent[~keep]) > 1e-1


def test_a_noise_mask_without_an_input_latent_is_refused(generator, tiny_models, encoded):
    from graph_runtime.errors import InputError

    with pytest.raises(InputError, match="noise mask"):
        kvgraph_sampler(generator, tiny_models, encoded["positive"], 2, 1, noise_mask=torch.ones(1, 1, H, W))


def test_a_zeroed_out_negative_works_as_in_core(generator, tiny_models, encoded):
    """Core's ConditioningZeroOut (the positive's conditioning with its values zeroed) as the negative: its own
    prefix, and CFG through core's Euler equals the KV-Graph Sampler's true CFG with that negative."""
    from graph_runtime.encoding.prompt import PromptEmbeds

    positive = encoded["positive"]
    zeroed = PromptEmbeds(torch.zeros_like(positive.embeds), positive.image_mask.clone(), positive.text_mask)
    sigmas = schedule(tiny_models, 3)
    with SamplingRun(generator.engine, "eager") as run:
        ours, _ = core_euler(ModelFunction(generator.engine), comfy_noise(8, (1, 64, H, W)), sigmas, source(positive),
                             source(zeroed), cfg=3.0, run=run)
        assert run.counts.prefills == 2
    expected = kvgraph_sampler(generator, tiny_models, positive, 3, 8, negative=zeroed, cfg=3.0)
    assert max_diff(ours, expected) <= ATOL
