"""Sampling-loop behaviour beyond numerics: callbacks, cancellation, input checks."""

import gc
import weakref

import pytest
from graph_runtime.decode import DecodeEngine
from graph_runtime.errors import InputError
from graph_runtime.sampling.sampler import Cancelled, SamplingRequest, sample


def _request(generator, **kw):
    kw.setdefault("steps", 5)
    return SamplingRequest(positive=generator.encoder.encode("a red cube"), latent_height=8, latent_width=8,
                           decode_mode="eager", **kw)


def test_per_step_callback_sees_every_step(tiny_models, generator):
    seen = []
    result = sample(DecodeEngine(tiny_models.transformer), _request(generator),
                    on_step=lambda step, total, latents: seen.append((step, total, tuple(latents.shape))))
    assert seen == [(i, 5, (1, 64, 8, 8)) for i in range(1, 6)]
    assert result.latents.shape == (1, 64, 8, 8)  # the final latents come back unpacked


def test_cancellation_between_steps_releases_the_request_caches(tiny_models, generator):
    """should_stop() is checked before every step; stopping raises Cancelled and frees the prefix K/V."""
    engine = DecodeEngine(tiny_models.transformer)
    prefixes = []
    original = engine.prefill

    def spy(*args, **kwargs):
        out, prefix = original(*args, **kwargs)
        prefixes.append(weakref.ref(prefix.k[0]))
        return out, prefix

    engine.prefill = spy
    steps = []
    with pytest.raises(Cancelled, match="stopped before step 3 of 5"):
        sample(engine, _request(generator), on_step=lambda s, t, l: steps.append(s),
               should_stop=lambda: len(steps) == 2)
    gc.collect()
    assert steps == [1, 2] and prefixes and prefixes[0]() is None


@pytest.mark.parametrize("field,value,message", [
    ("steps", 0, "steps=0 is invalid"),
    ("batch_size", 0, "batch_size=0 is invalid"),
    ("denoise", 0.5, "denoise=0.5 is invalid: expected 1.0 unless an input latent"),
    ("sigma_preset", "karras", "sigma preset='karras' is invalid"),
])
def test_bad_sampling_inputs_name_the_input(tiny_models, generator, field, value, message):
    with pytest.raises(InputError, match=message):
        sample(DecodeEngine(tiny_models.transformer), _request(generator, **{field: value}))
