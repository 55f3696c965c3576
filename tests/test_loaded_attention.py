"""A loaded transformer's attention setting (`LoadedTransformer.use_attention`): one engine per kernel over the same
weights; changing the kernel releases the graphs captured with the old one (deferred while a run uses them) and
never touches the weights. CPU, with the recording capture backend that runs the graph policy without CUDA."""

import pytest
import torch

from graph_runtime.decode import attention
from graph_runtime.decode.attention import Fa3Attention, Fa3Fp8Attention
from graph_runtime.errors import InputError
from graph_runtime.loaded import LoadedTransformer
from tests.test_fp8_attention import _fa3_on_cpu
from tests.test_graph_manager import RecordingBackend, _request


@pytest.fixture
def fa3_everywhere(monkeypatch):
    """FlashAttention-3 (bf16 and FP8) emulated on the CPU, so the `fp8` engine really keeps e4m3 entries."""
    monkeypatch.setattr(attention, "choose", lambda device, dtype, requested, loader: (
        (Fa3Fp8Attention(_fa3_on_cpu) if requested == "fp8" else Fa3Attention(_fa3_on_cpu)), None))


def _capture(engine, generator):
    """One request's prefill and first step on `engine` (captured): returns its prefix, still alive."""
    prefix, latents = _request(generator, "a red cube", engine=engine)
    assert engine.decode_step(prefix, latents, torch.full((1,), 0.6)).path == "capture"
    return prefix


def test_changing_the_attention_rebuilds_the_step_over_the_same_weights(tiny_models, generator, fa3_everywhere):
    """`engine` follows the attention last asked for; each kernel gets its own engine (kept for when it is asked for
    again), the weights are the same tensors throughout, and the old kernel's graph entries are released on the
    change so only one kernel's entries hold memory."""
    transformer = tiny_models.transformer
    weights = [p.data_ptr() for p in transformer.parameters()]
    loaded = LoadedTransformer(transformer, backend=RecordingBackend())
    auto = loaded.engine
    assert loaded.attention == "auto" and auto.step.attention.requested == "auto"
    _capture(auto, generator).release()
    assert len(auto.graphs.entries) == 1

    fp8 = loaded.use_attention("fp8")
    assert fp8 is loaded.engine and fp8 is not auto and loaded.attention == "fp8"
    assert fp8.transformer is transformer and [p.data_ptr() for p in transformer.parameters()] == weights
    assert len(auto.graphs.entries) == 0, "the old kernel's graphs stay after the change"
    prefix = _capture(fp8, generator)
    entry = fp8.graphs.entries[prefix.graph_key]
    assert entry.inputs.kv_format == "fp8" and "fa3-fp8" in str(prefix.graph_key)
    prefix.release()
    assert loaded.engines() == [auto, fp8]

    assert loaded.use_attention("fp8") is fp8 and len(fp8.graphs.entries) == 1  # the same choice keeps its graphs
    assert loaded.use_attention("auto") is auto and len(fp8.graphs.entries) == 0


def test_a_change_during_a_run_releases_the_old_graphs_when_the_run_ends(tiny_models, generator, fa3_everywhere):
    """A run in flight keeps the entries it replays: the release the change asks for waits for its end."""
    loaded = LoadedTransformer(tiny_models.transformer, backend=RecordingBackend())
    auto = loaded.engine
    with loaded.running():
        prefix = _capture(auto, generator)
        loaded.use_attention("sdpa")
        assert len(auto.graphs.entries) == 1
        prefix.release()
    assert len(auto.graphs.entries) == 0


def test_an_unknown_attention_is_refused_naming_the_input(tiny_models):
    """A bad value names `attention` and the choices; the engine in use stays as it was."""
    loaded = LoadedTransformer(tiny_models.transformer, backend=RecordingBackend())
    engine = loaded.engine
    with pytest.raises(InputError, match=r"attention='fp4' is invalid: expected one of auto .*sdpa, fa3, fp8"):
        loaded.use_attention("fp4")
    assert loaded.engine is engine and loaded.attention == "auto"
    with pytest.raises(InputError, match="attention='flash'"):
        LoadedTransformer(tiny_models.transformer, attention="flash")
