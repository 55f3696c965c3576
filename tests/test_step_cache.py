"""The step cache (graph_runtime/sampling/step_cache.py) on its own and in the sampling loop, on CPU.

The decision rule is checked on hand-computed sequences; the loop with the tiny model and the recording graph backend
(tests/test_graph_manager.py), which runs the whole capture/replay/ownership policy on CPU: a skipped step makes no
decode step at all, computed steps replay the graph, and a skip leaves the prefix and its graph entry as they were.
"""

import logging

import pytest
import torch

from graph_runtime.core_model.run import SamplingRun
from graph_runtime.core_model.step_cache import StepsWithoutCalls
from graph_runtime.decode import DecodeEngine
from graph_runtime.decode.stats import DecodeStats
from graph_runtime.errors import InputError
from graph_runtime.report import run_summary
from graph_runtime.sampling.sampler import Cancelled, SamplingRequest, sample
from graph_runtime.sampling.schedule import flow_percent_to_sigma as percent_to_sigma
from graph_runtime.sampling.step_cache import StepCache, StepCacheSettings
from tests.test_graph_manager import RecordingBackend

H = W = 16  # latent tokens: a 2 x 2 subsampled grid


@pytest.mark.parametrize("field,value", [("reuse_threshold", -0.1), ("reuse_threshold", 3.5),
                                         ("reuse_threshold", float("nan")), ("start_percent", 1.5),
                                         ("end_percent", -1.0), ("reuse_threshold", True)])
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(InputError, match=field):
        StepCacheSettings(**{field: value})


def test_an_empty_range_is_refused():
    """end_percent at or before start_percent could never skip: refused, not a silent no-op."""
    with pytest.raises(InputError, match="end_percent.*start_percent"):
        StepCacheSettings(start_percent=0.5, end_percent=0.5)


def test_percent_to_sigma_follows_the_time_shift():
    """Without a shift (mu 0) a percent p is sigma 1 - p; a positive shift keeps sigmas higher (more of the schedule
    at high noise), and the ends are 1 and 0 as core's ModelSamplingFlux has them."""
    assert percent_to_sigma(0.25, 0.0) == pytest.approx(0.75)
    assert percent_to_sigma(0.25, 0.7) > 0.75
    assert percent_to_sigma(0.0, 0.7) == 1.0 and percent_to_sigma(1.0, 0.7) == 0.0


def constant(value, channels=4):
    return torch.full((1, H * W, channels), float(value))


def test_the_rule_on_a_hand_computed_sequence():
    """Active range (0.1, 0.9]. Step at sigma 1.0: outside, computed, not remembered. 0.8: first in range, computed.
    0.6: input change 1, no ratio yet: computed; ratio k = |12 - 10| / |2 - 1| = 2. 0.4: estimate 2 * 1 / 12 = 0.167
    < 0.2: skipped, the output is the input plus the last (output - input). 0.3: the input moved 2 from the last
    computed one, estimate 0.167 + 2 * 2 / 12 = 0.5: computed, the estimate starts again."""
    cache = StepCache(StepCacheSettings(0.2, 0.1, 0.9), start_sigma=0.9, end_sigma=0.1, height=H, width=W)
    steps = [(1.0, 0.0, 5.0), (0.8, 1.0, 10.0), (0.6, 2.0, 12.0)]
    for sigma, x, out in steps:
        assert not cache.skip(constant(x), sigma, ["cond"])
        cache.computed(constant(x), {"cond": constant(out)}, sigma)
    assert cache.skip(constant(3.0), 0.4, ["cond"])
    assert torch.equal(cache.cached(constant(3.0), "cond"), constant(3.0 + (12.0 - 2.0)))
    assert not cache.skip(constant(4.0), 0.3, ["cond"])
    assert (cache.steps, cache.skipped) == (5, 1)
    assert "skipped 1/5 steps" in cache.summary()


def test_a_lower_threshold_computes_that_step():
    """The same sequence with threshold 0.1: 0.167 is not below it, so the step at 0.4 is computed."""
    cache = StepCache(StepCacheSettings(0.1, 0.1, 0.9), start_sigma=0.9, end_sigma=0.1, height=H, width=W)
    for sigma, x, out in [(0.8, 1.0, 10.0), (0.6, 2.0, 12.0)]:
        cache.skip(constant(x), sigma, ["cond"])
        cache.computed(constant(x), {"cond": constant(out)}, sigma)
    assert not cache.skip(constant(3.0), 0.4, ["cond"])


def test_past_the_range_nothing_is_skipped_and_a_branch_without_output_is_never_skipped():
    cache = StepCache(StepCacheSettings(3.0, 0.1, 0.9), start_sigma=0.9, end_sigma=0.5, height=H, width=W)
    for sigma, x, out in [(0.8, 1.0, 10.0), (0.7, 1.1, 10.1)]:
        cache.skip(constant(x), sigma, ["cond"])
        cache.computed(constant(x), {"cond": constant(out)}, sigma)
    assert not cache.skip(constant(1.2), 0.6, ["cond", "uncond"])  # no uncond output remembered
    assert cache.skip(constant(1.2), 0.6, ["cond"])
    assert not cache.skip(constant(1.2), 0.5, ["cond"])  # sigma <= end: computed


# -- in the sampling loop ------------------------------------------------------------------------------------------


@pytest.fixture()
def engine(tiny_models):
    return DecodeEngine(tiny_models.transformer, max_entries=4, backend=RecordingBackend())


def request(generator, tiny_models, cache=None, **extra):
    return SamplingRequest(positive=generator.encoder.encode("a red cube on a blue sphere"), latent_height=H,
                           latent_width=W, steps=12, seed=3, scheduler_config=tiny_models.scheduler_config,
                           step_cache=cache, **extra)


def test_skipped_steps_make_no_decode_step_and_computed_ones_replay(engine, generator, tiny_models):
    """With a high threshold the cache skips steps: each is a "skipped" path with no decode step (the graph
    statistics count exactly the computed ones), the computed steps replay the one captured graph, and a second run
    with the same shapes replays from its first step (0 captures): the skips left the graph entry and its ownership as
    they were."""
    settings = StepCacheSettings(reuse_threshold=1.0)
    first = sample(engine, request(generator, tiny_models, settings))
    skipped = first.paths.count("skipped")
    assert 0 < skipped < 12 and first.stats["skipped_steps"] == skipped
    decoded = first.stats["replays"] + sum(first.stats["eager_steps"].values())  # a capture also replays
    assert decoded == 12 - skipped and first.stats["captures"] == 1 and not first.stats["eager_steps"]
    second = sample(engine, request(generator, tiny_models, settings))
    assert second.stats["captures"] == 0 and second.stats["replays"] == 12 - skipped
    assert torch.equal(second.latents, first.latents)  # no state carried from one run to the next
    assert not any(engine.graphs.owners.alive(k) for k in engine.graphs.entries)


def test_cfg_skips_both_branches_together(engine, generator, tiny_models):
    req = request(generator, tiny_models, StepCacheSettings(reuse_threshold=1.0),
                  negative=generator.encoder.encode("blurry"), cfg=4.0)
    result = sample(engine, req)
    steps = [result.paths[i:i + 2] for i in range(0, len(result.paths), 2)]
    assert ["skipped", "skipped"] in steps and all(len(set(s)) == 1 or "skipped" not in s for s in steps)
    assert result.stats["skipped_steps"] == sum(s == ["skipped", "skipped"] for s in steps) > 0


def test_threshold_zero_changes_nothing(engine, generator, tiny_models):
    """A threshold of 0 never skips: the latents are bit-identical to a run without the cache."""
    plain = sample(engine, request(generator, tiny_models))
    cached = sample(engine, request(generator, tiny_models, StepCacheSettings(reuse_threshold=0.0)))
    assert cached.stats["skipped_steps"] == 0 and torch.equal(cached.latents, plain.latents)


def test_a_cached_run_differs_from_the_plain_run_and_logs_one_summary(engine, generator, tiny_models, caplog):
    plain = sample(engine, request(generator, tiny_models))
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        cached = sample(engine, request(generator, tiny_models, StepCacheSettings(reuse_threshold=1.0)))
    assert (cached.latents - plain.latents).abs().max() > 1e-3
    lines = [r.getMessage() for r in caplog.records if "Step Cache" in r.getMessage()]
    assert lines == [f"KV-Graph Step Cache: skipped {cached.stats['skipped_steps']}/12 steps "
                     f"({12 / (12 - cached.stats['skipped_steps']):.2f}x fewer transformer steps; threshold 1, from "
                     "0.15 to 0.95 of the schedule)"]


def test_a_stopped_run_releases_its_prefix(engine, generator, tiny_models, caplog):
    """Stopped between steps: the prefixes are released (no entry owned) and the cache's summary still logged."""
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 6

    with caplog.at_level(logging.INFO, logger="kvgraph"), pytest.raises(Cancelled):
        sample(engine, request(generator, tiny_models, StepCacheSettings(reuse_threshold=1.0)), should_stop=stop)
    assert not any(engine.graphs.owners.alive(k) for k in engine.graphs.entries)
    assert any("Step Cache: skipped" in r.getMessage() for r in caplog.records)


def test_the_summary_line_names_skipped_steps():
    class Result:
        stats = {"captures": 0, "replays": 6, "eager_steps": {}, "skipped_steps": 4}
        timings = {"steps": 10, "prefill_ms": 1.0, "decode_ms_per_step": 2.0}

    assert run_summary(1024, 1024, 1, Result(), "dynamic", 1.0).endswith(", skipped steps 4 (step cache)")
    Result.stats = {**Result.stats, "skipped_steps": 0}
    assert "skipped" not in run_summary(1024, 1024, 1, Result(), "dynamic", 1.0)


def test_steps_without_calls_are_counted(engine):
    """A core sampler's step with no model call (a step cache answered it) counts as skipped, in the engine's stats."""
    stats = DecodeStats()
    run = SamplingRun(engine, "eager")
    steps = StepsWithoutCalls(run, stats)
    for calls in (1, 2, 2, 3, 3, 3):  # the run's call count at each step's end
        run.counts.calls = calls
        steps.step_done()
    assert steps.skipped == 3 == stats.skipped_steps
    run.release()


def test_several_gpus_with_the_cache_are_refused_before_any_work(generator, tiny_models):
    """Every rank would decide on its own whether to skip a step, and a rank that decided otherwise would wait forever
    in the step's collectives: refused by name, before any worker starts."""
    from graph_runtime.parallel import sample_on_devices

    class Loaded:
        def parallel_runtime(self, gpus):
            raise AssertionError("no worker may start")

    with pytest.raises(InputError, match="step cache"):
        sample_on_devices(Loaded(), request(generator, tiny_models, StepCacheSettings()), gpus=2)
