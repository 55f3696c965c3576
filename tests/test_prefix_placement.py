"""Prefix placements (graph_runtime/decode/prefix_store.py) on the tiny model in fp32 on CPU: `host` and `int8` prefix
K/V, `recompute` without a prefix cache, each against the `gpu` layout; graph keys and status carry the placement.

Replays run through the recording backend (tests/test_graph_manager.py): the captured body runs on the entry's
static buffers, so the entries' stores, refreshes and keys are the real ones; CUDA graphs are the GPU tests'.
"""

import dataclasses
import gc
import logging

import pytest
import torch

from graph_runtime import memory
from graph_runtime.decode import DecodeEngine
from graph_runtime.decode import eligibility as why
from graph_runtime.decode.prefix_store import PLACEMENTS, PrefixStore, check_placement, store_bytes
from graph_runtime.errors import InputError
from graph_runtime.memory import budget as budgets
from graph_runtime.memory import plan as plans
from graph_runtime.kernels.kv_int8 import QMAX, dequantize_rows, quantize_rows
from tests.test_cached_decode import lamp_request
from tests.test_graph_manager import RecordingBackend


def _prefill(engine, request, placement, mode="auto"):
    layout, hidden, embeds, _ = request
    with torch.no_grad():
        return engine.prefill(layout, hidden, embeds.embeds, torch.full((1,), 0.9), with_target=False,
                              placement=placement, mode=mode)[1]


def _step(engine, prefix, latents, t=0.7, mode="auto"):
    with torch.no_grad():
        return engine.decode_step(prefix, latents, torch.full((1,), t), mode)


@pytest.fixture()
def request_with_reference(tiny_models, generator, reference_image):
    return lamp_request(tiny_models, generator, [reference_image])


def test_host_prefix_equals_gpu_prefix_bit_for_bit(tiny_models, request_with_reference):
    """A host prefix only moves the same values: its eager steps, its captured step and its replays give the gpu
    layout's output exactly (CPU fp32, torch.equal)."""
    latents = request_with_reference[3]
    gpu_engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    host_engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    gpu = _prefill(gpu_engine, request_with_reference, "gpu")
    host = _prefill(host_engine, request_with_reference, "host")
    assert host.placement == "host" and host.k[0].device.type == "cpu" and host.store is not None
    for a, b in zip(gpu.k + gpu.v, host.k + host.v):
        assert torch.equal(a, b)
    for t in (0.7, 0.4):
        expected = _step(gpu_engine, gpu, latents, t, "eager").output
        assert torch.equal(_step(host_engine, host, latents, t, "eager").output, expected)
        graphed = _step(host_engine, host, latents, t)
        assert graphed.path in ("capture", "replay") and torch.equal(graphed.output, expected)


def test_int8_rows_round_within_half_a_step():
    """Per-token-per-head int8: every value comes back within half its row's step (amax / 127 / 2), the row's largest
    value exactly, and an all-zero row as zeros; CPU and the kernel's fallback share this math."""
    x = torch.randn(2, 7, 3, 16) * torch.logspace(-3, 2, 7)[None, :, None, None]
    x[0, 0, 0] = 0
    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(*x.shape[:-1], 1)
    quantize_rows(x, q, scale)
    back = torch.empty_like(x)
    dequantize_rows(q, scale, back)
    step = x.abs().amax(-1, keepdim=True) / QMAX
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert q.abs().max() == QMAX and torch.equal(back[0, 0, 0], torch.zeros(16))


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_int8_prefix_is_within_its_rounding_of_the_gpu_prefix(tiny_models, request_with_reference):
    """An int8 prefix differs from the gpu one only by the int8 rounding of its K/V. Per block: each dequantized
    row within half a step of the fp32 K/V (amax / 254, the rounding itself). Over the step (eager and replayed): the
    output's relative error stays below the largest relative K/V rounding error of any block (attention averages
    the perturbed rows, so it passes on at most their relative error, and only the attention part of each block's
    update sees it), and is not zero (the int8 values are really read)."""
    latents = request_with_reference[3]
    gpu_engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    int8_engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    gpu = _prefill(gpu_engine, request_with_reference, "gpu")
    int8 = _prefill(int8_engine, request_with_reference, "int8")
    store = int8.store
    assert int8.k[0].dtype == torch.int8 and int8.kv_dtype == torch.float32
    kv_errors = []
    for i in range(len(gpu.k)):
        for exact, q, scale in ((gpu.k[i], store.k[i], store.k_scale[i]), (gpu.v[i], store.v[i], store.v_scale[i])):
            back = torch.empty_like(exact)
            dequantize_rows(q, scale, back)
            half_step = exact.abs().amax(-1, keepdim=True) / (2 * QMAX)
            assert ((back - exact).abs() <= half_step * (1 + 1e-5)).all()
            kv_errors.append(_relative(back, exact))
    expected = _step(gpu_engine, gpu, latents, mode="eager").output
    for mode in ("eager", "auto"):
        out = _step(int8_engine, int8, latents, mode=mode).output
        error = _relative(out, expected)
        assert 0 < error <= max(kv_errors), (error, max(kv_errors))


def test_recompute_equals_gpu_prefix_within_fp32_rounding(tiny_models, request_with_reference, caplog):
    """No prefix cache: every step runs the whole joint sequence, and gives the cached decode's output to fp32
    rounding (1e-4 absolute, as tests/test_cached_decode.py: the two split attention into different calls). The
    steps are eager, counted under their reason, and said in the log once."""
    latents = request_with_reference[3]
    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    gpu = _prefill(engine, request_with_reference, "gpu", mode="eager")
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        none = _prefill(engine, request_with_reference, "recompute")
        outcomes = [_step(engine, none, latents, t) for t in (0.7, 0.4)]
    assert none.k == [] and none.rows is not None
    for outcome, t in zip(outcomes, (0.7, 0.4)):
        assert outcome.path == "eager" and outcome.reason == why.RECOMPUTE
        expected = _step(engine, gpu, latents, t, "eager").output
        assert (outcome.output - expected).abs().max().item() <= 1e-4
    assert engine.stats.eager_steps[why.RECOMPUTE] == 2
    assert engine.stats.prefix_placements == {"gpu": 1, "recompute": 1}
    assert sum(why.RECOMPUTE in r.getMessage() for r in caplog.records) == 1
    assert not engine.graphs.entries  # nothing registered for a prefix that is never cached


def test_graph_keys_and_status_carry_the_placement(tiny_models, request_with_reference):
    """Each placement gets its own entry (a step over int8 or host rows is other work than over gpu rows), and the
    status names it with the bytes it holds on the device and on the host."""
    latents = request_with_reference[3]
    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend(), max_entries=4)
    prefixes = {p: _prefill(engine, request_with_reference, p) for p in ("gpu", "int8", "host")}
    for prefix in prefixes.values():
        assert _step(engine, prefix, latents).path == "capture"
    keys = {key.placement: key for key in engine.graphs.entries}
    assert set(keys) == {"gpu", "int8", "host"} and len(engine.graphs.entries) == 3
    status = engine.status()
    described = {e["key"]["prefix_placement"]: e for e in status["entries"]}
    assert set(described) == {"gpu", "int8", "host"}
    assert described["host"]["host_bytes"] > 0 and described["gpu"]["host_bytes"] == 0
    assert described["int8"]["bytes"] < described["gpu"]["bytes"]
    assert status["prefix_placements"] == {"gpu": 1, "int8": 1, "host": 1}
    assert status["host_bytes_held"] == described["host"]["host_bytes"]


def test_unclaimed_stored_prefix_is_copied_into_the_entry_once(tiny_models, request_with_reference):
    """A second request with the same key, prefilled while the first owned the entry, keeps its own store and decodes
    eagerly; once the owner is gone its store is copied into the entry's at its first graph step, and replays equal
    its eager steps (the entry never reads the other request's rows)."""
    latents = request_with_reference[3]
    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    owner = _prefill(engine, request_with_reference, "int8")
    layout, hidden, embeds, _ = request_with_reference
    with torch.no_grad():
        other = engine.prefill(layout, hidden * 0.5, embeds.embeds, torch.full((1,), 0.9), with_target=False,
                               placement="int8")[1]
    entry = next(iter(engine.graphs.entries.values()))
    assert other.store is not entry.store
    assert _step(engine, other, latents).reason == why.OWNED
    owner.release()
    gc.collect()
    graphed = _step(engine, other, latents)
    assert graphed.path == "capture" and entry.refresh_prefix(other) is False
    assert torch.equal(graphed.output, _step(engine, other, latents, mode="eager").output)


def test_placement_input_is_checked():
    """A placement that is not one of the choices is refused, naming the input and the choices."""
    assert check_placement("auto") == "auto"
    with pytest.raises(InputError, match="prefix_placement.*auto, gpu, int8, host, recompute"):
        check_placement("cpu")


def test_store_bytes_match_the_buffers_a_store_allocates():
    """`store_bytes` (what the budget counts) is what a store really allocates, on the device and on the host."""
    for placement in ("int8", "host"):
        store = PrefixStore(placement, 2, 40, 24, 2, 16, 3, torch.float32, "cpu")
        device, host = store_bytes(placement, 2, 40, 24, 2, 16, 3, 4)
        assert (store.device_bytes, store.host_bytes) == (device, host)
    assert store_bytes("gpu", 1, 40, 24, 2, 16, 3, 2) == (2 * 3 * 64 * 32 * 2, 0)
    assert store_bytes("recompute", 1, 40, 24, 2, 16, 3, 2) == (0, 0)
    assert PLACEMENTS == ("gpu", "int8", "host", "recompute")


# -- the memory budget ---------------------------------------------------------------------------------------------

GiB = 1 << 30


def test_each_placement_is_sized_by_hand_at_full_size():
    """Ten 1024x1024 references (40960 prefix tokens + 128 text) at full size in bf16, one branch: gpu holds every
    block's K/V rows (0.5 MiB a token), int8 one byte a value plus an fp32 scale per token and head, and one working
    K/V buffer; host two working buffers on the device and the bf16 rows on the host; recompute nothing."""
    from tests.test_memory import FULL

    prefix, target, row = 40960 + 128, 4096, 32 * 128
    working = 2 * (prefix + target) * row * 2
    assert store_bytes("gpu", 1, prefix, target, 32, 128, 32, 2) == (32 * working, 0)
    assert store_bytes("int8", 1, prefix, target, 32, 128, 32, 2) == (
        working + 2 * 32 * prefix * (row + 4 * 32), 0)
    assert store_bytes("host", 1, prefix, target, 32, 128, 32, 2) == (2 * working, 2 * 32 * prefix * row * 2)
    # With the entry's other buffers (hidden, timestep, RoPE), as the budget counts them.
    other = memory.entry_buffer_bytes(FULL, 1, prefix, target) - target * memory.kv_bytes_per_token(FULL)
    assert memory.placement_bytes(FULL, 1, prefix, target, "int8") == (
        working + 2 * 32 * prefix * (row + 4 * 32) + other, 0)
    assert memory.placement_bytes(FULL, 1, prefix, target, "recompute") == (0, 0)
    gpu, _ = memory.placement_bytes(FULL, 1, prefix, target, "gpu")
    int8, _ = memory.placement_bytes(FULL, 1, prefix, target, "int8")
    assert 22 * GiB < gpu < 23 * GiB and int8 < 0.6 * gpu  # 0.5 MiB a token, prefix and target rows


def _ten_reference_plan(**changes):
    from tests.test_memory import plan_1024

    return plan_1024(prefix_tokens=(40960 + 128,), **changes)


def test_auto_keeps_the_prefix_on_the_gpu_where_it_fits_then_int8_then_host_then_recompute():
    """`auto` is the first placement whose whole budget fits, in the order gpu, int8, host, recompute, so each
    smaller card gets the next one; a host prefix also needs its rows to fit the host's memory. At ten references a
    whole-sequence step (its mask over 45 k rows) needs more than the host prefix, so where neither fits the request
    is left to the refusal (auto answers gpu, whose budget the refusal prices)."""
    plan = _ten_reference_plan()
    totals = {p: budgets.fitting_estimate(plan.dims, dataclasses.replace(plan.shape, prefix_placement=p),
                                          plan.weights, plan.vae, 10**15).total for p in PLACEMENTS}
    assert totals["gpu"] > totals["int8"] > totals["recompute"] > totals["host"]

    def choose(available, host_free=None):
        """What `auto` resolves to with every block resident: the planner's choice, gpu where none fits."""
        sizes = plans.ModelSizes(plan.dims, (0,) * plan.dims.blocks, plan.weights.get("transformer", 0), plan.vae,
                                 tuple((k, v) for k, v in plan.weights.items() if k not in ("transformer", "VAE")))
        chosen = plans.plan_memory(sizes, plan.shape, available, host_free, stream=False)
        return chosen.prefix_placement if chosen.fits else "gpu"

    assert choose(totals["gpu"]) == "gpu"
    assert choose(totals["gpu"] - 1) == "int8"
    assert choose(totals["int8"] - 1) == "host"
    assert choose(totals["int8"] - 1, host_free=10 * GiB) == "recompute"  # the pinned rows need ~20 GiB
    assert choose(totals["host"] - 1) == "gpu"  # nothing fits
    host = budgets.fitting_estimate(plan.dims, dataclasses.replace(plan.shape, prefix_placement="host"),
                                    plan.weights, plan.vae, totals["host"])
    assert host.host_total == 2 * 32 * 40 * 1024 * 4096 * 2 + 2 * 32 * 128 * 4096 * 2
    assert "on the host" in host.describe()


def test_a_refusal_offers_the_placements_with_what_they_need():
    """A 10-reference request (bf16 weights) on a 28 GiB card with the prefix forced onto the GPU is refused, and the
    refusal names each placement with what it needs, those that fit (host, recompute; int8's 11 GiB of prefix does
    not beside the bf16 weights) first."""
    plan = _ten_reference_plan()
    with pytest.raises(budgets.MemoryBudgetError) as info:
        plan.check(28 * GiB, "cuda:0", "test")
    options = str(info.value).split("Change one of: ")[1].rstrip(".").split("; ")
    placed = {o.split(" ")[1]: o for o in options if o.startswith("prefix_placement ")}
    assert set(placed) == {"int8", "host", "recompute"}
    assert placed["host"].endswith("(fits)") and placed["recompute"].endswith("(fits)")
    assert not placed["int8"].endswith("(fits)")
    fitting = [o.endswith("(fits)") for o in options]
    assert fitting == sorted(fitting, reverse=True)


def test_the_sampling_check_resolves_auto_onto_the_request(tiny_models, generator):
    """`check_sampling_request` resolves `auto` by the budget and the run reads it from the request: with room for
    the gpu layout it stays gpu; with less, int8 (and the note says why); a forced placement is kept as asked."""
    from graph_runtime.sampling.sampler import SamplingRequest

    positive = generator.encoder.encode("a red cube")

    def request(placement="auto"):
        return SamplingRequest(positive=positive, latent_height=8, latent_width=8, steps=2,
                               prefix_placement=placement, scheduler_config=tiny_models.scheduler_config)

    plan = budgets.RequestPlan.for_request(tiny_models.transformer, request(), None, graphs=True)
    gpu = plan.budget().total
    int8 = budgets.fitting_estimate(plan.dims, dataclasses.replace(plan.shape, prefix_placement="int8"),
                                    plan.weights, None, gpu).total
    assert int8 < gpu
    roomy, tight = request(), request()
    budgets.check_sampling_request(tiny_models.transformer, roomy, budgets.Available(gpu), "cuda:0")
    budget = budgets.check_sampling_request(tiny_models.transformer, tight, budgets.Available(gpu - 1), "cuda:0")
    assert (roomy.placement(), tight.placement()) == ("gpu", "int8")
    assert budget.prefix_placement == "int8" and "placement int8 (auto" in " ".join(budget.notes)
    forced = request("host")
    budgets.check_sampling_request(tiny_models.transformer, forced, budgets.Available(gpu), "cuda:0")
    assert forced.placement() == "host" and forced.planned_placement is None
    assert request().placement() == "gpu"  # no budget made (nothing reports free memory): the gpu layout


def test_the_sampler_runs_the_placement_it_was_given(tiny_models, generator):
    """A sampling run prefills with the request's placement (counted per placement), and a host prefix gives the
    gpu prefix's latents exactly (CPU fp32)."""
    from graph_runtime.sampling.sampler import SamplingRequest, sample

    positive = generator.encoder.encode("a red cube")
    results = {}
    for placement in ("gpu", "host"):
        engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
        request = SamplingRequest(positive=positive, latent_height=8, latent_width=8, steps=3,
                                  prefix_placement=placement, scheduler_config=tiny_models.scheduler_config)
        results[placement] = sample(engine, request)
        assert engine.stats.prefix_placements == {placement: 1}
    assert torch.equal(results["gpu"].latents, results["host"].latents)
    assert results["host"].stats["prefix_placements"] == {"host": 1}


# -- core samplers on the MODEL ------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting,placement,noted", [
    (None, "gpu", False), ({"device": "auto", "dtype": "default"}, "gpu", False),
    ({"device": "gpu", "dtype": "int8"}, "int8", False), ({"device": "auto", "dtype": "int4"}, "int8", True),
    ({"device": "cpu", "dtype": "default"}, "host", False), ({"device": "cpu", "dtype": "int8"}, "host", True),
    ({"device": "off", "dtype": "default"}, "recompute", False)])
def test_core_cache_node_setting_maps_onto_a_placement(setting, placement, noted):
    """ComfyUI's Qwen Image 2.1 Cache node's setting on the MODEL picks the run's placement; what cannot be followed
    as set (int4, a quantized host prefix) is said, and a bad value is refused naming it."""
    from graph_runtime.core_model import placement_from_options

    options = {} if setting is None else {"qwen_image21_cache": setting}
    got, note = placement_from_options(options)
    assert got == placement and (note is not None) == noted
    with pytest.raises(InputError, match="device"):
        placement_from_options({"qwen_image21_cache": {"device": "disk", "dtype": "default"}})


def test_a_core_run_keeps_its_prefixes_where_it_was_told(tiny_models, generator):
    """A core sampling run with a host placement prefills under it and its model calls give the gpu run's
    predictions exactly (CPU fp32)."""
    from graph_runtime.core_model import ModelFunction, SamplingRun
    from tests.test_core_model import source

    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    function = ModelFunction(engine)
    prompt = source(generator.encoder.encode("a red cube"))
    x = torch.randn(1, 64, 8, 8, generator=torch.Generator("cpu").manual_seed(0))
    sigma = torch.full((1,), 0.8)
    outputs = {}
    for placement in ("gpu", "host"):
        with torch.no_grad(), SamplingRun(engine, placement=placement) as run:
            outputs[placement] = function(x, sigma, prompt, run=run, roles=[0])
    assert torch.equal(outputs["gpu"], outputs["host"])
    assert engine.stats.prefix_placements == {"gpu": 1, "host": 1}


def test_refused_pinning_falls_back_to_pageable_memory_said_once(monkeypatch, caplog):
    """Where the system refuses page-locked memory, a host prefix gets pageable memory (copied synchronously), and
    the refusal is logged once, not once per tensor."""
    from graph_runtime.decode import prefix_store

    real_empty = torch.empty

    def refusing_empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(prefix_store.torch, "empty", refusing_empty)
    monkeypatch.setattr(prefix_store, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="kvgraph"):
        made = [prefix_store._pinned_empty((2, 3), torch.float32) for _ in range(3)]
    assert all(not pinned and tensor.shape == (2, 3) for tensor, pinned in made)
    assert sum("pinned host memory refused" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("placement", ["int8", "host", "recompute"])
def test_the_budget_covers_a_traced_sampling_run_of_each_placement(tiny_models, placement):
    """A whole sampling run of the tiny model with the prefix under `placement` (eager, fp32, CPU: on the CPU the
    host placement's rows are on the same device, so they count), traced: its peak of live tensors is within the
    estimate (device and host parts, without the margin and the weights)."""
    from tests.owners import generator_for
    from tests.test_memory import PeakTrace
    from graph_runtime.sampling.sampler import SamplingRequest, sample

    generator = generator_for(tiny_models)
    positive = generator.encoder.encode("a red cube")
    request = SamplingRequest(positive=positive, latent_height=32, latent_width=32, steps=3, decode_mode="eager",
                              prefix_placement=placement, scheduler_config=tiny_models.scheduler_config)
    plan = budgets.RequestPlan.for_request(tiny_models.transformer, request, None, graphs=False)
    budget = plan.budget()
    assert budget.prefix_placement == placement
    need = budget.need - budget.part("transformer weights") + budget.host_total
    existing = [*tiny_models.transformer.parameters(), *tiny_models.transformer.buffers(), positive.embeds]
    with torch.no_grad(), PeakTrace(existing) as trace:
        sample(generator.engine, request)
    print(f"{placement}: traced {trace.peak} B, estimate {need} B")
    assert trace.peak <= need


def test_a_host_prefix_the_host_cannot_hold_is_refused_before_anything_is_allocated(tiny_models, generator):
    """Forced `host` with less host memory than its pinned rows: refused naming the host memory and the other
    placements, nothing run."""
    from graph_runtime.sampling.sampler import SamplingRequest

    positive = generator.encoder.encode("a red cube")
    request = SamplingRequest(positive=positive, latent_height=8, latent_width=8, steps=2, prefix_placement="host",
                              scheduler_config=tiny_models.scheduler_config)
    with pytest.raises(budgets.MemoryBudgetError, match="host memory, for the pinned prefix") as info:
        budgets.check_sampling_request(tiny_models.transformer, request, budgets.Available(1 << 40), "cuda:0",
                                       host_free=16)
    assert "prefix_placement int8" in str(info.value) and "prefix_placement host" not in str(info.value)


def test_dropped_host_entries_are_gone_before_the_pinned_cache_is_emptied(monkeypatch):
    """PyTorch's pinned-memory allocator hands back only blocks no tensor uses: when the graph manager drops host
    entries, no reference to any of them may be left (not even the loop's last one) by the time it empties that
    cache, or their pinned rows stay locked in the process after the release."""
    import weakref

    from graph_runtime.decode import graphs as graphs_module
    from graph_runtime.decode.stats import DecodeStats

    class HostEntry:
        host_bytes = 1 << 20

    manager = graphs_module.DecodeGraphs("test", backend=None, stats=DecodeStats())
    dropped = [HostEntry(), HostEntry()]
    alive = [weakref.ref(e) for e in dropped]
    for i, entry in enumerate(dropped):
        manager.entries[("key", i)] = entry
    del dropped, entry
    seen = []
    monkeypatch.setattr(graphs_module, "release_host_cache", lambda: seen.append([ref() is None for ref in alive]))
    manager.release()
    assert seen == [[True, True]]
