"""Prefix placements (graph_runtime/decode/prefix_store.py) on the tiny model in fp32 on CPU: `host` and `int8` prefix
K/V, `recompute` without a prefix cache, each against the `gpu` layout; graph keys and status carry the placement.

Replays run through the recording backend (tests/test_graph_manager.py): the captured body runs on the entry's
static buffers, so the entries' stores, refreshes and keys are the real ones; CUDA graphs are the GPU tests'.
"""

import gc
import logging

import pytest
import torch

from graph_runtime.decode import DecodeEngine
from graph_runtime.decode import eligibility as why
from graph_runtime.decode.prefix_store import PLACEMENTS, PrefixStore, check_placement, store_bytes
from graph_runtime.errors import InputError
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
