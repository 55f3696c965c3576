"""Merged LoRAs and the graphs: switching LoRA sets between prompts keeps every captured graph valid (nothing is
captured again) and each prompt's output equals a model merged by the reference math; the manager's guards accept
an in-place merge and still refuse weights that move or get wrapped; merges never change weights under a run.

Graphs are driven through the recording capture backend of tests/test_graph_manager.py: it keeps the captured body
and replays it on the entry's static buffers, reading the module weights at replay time as a CUDA graph reads them
at their captured addresses. The tiny model is fp32 on the CPU.
"""

import copy
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from lora_layouts import reference_weights, write_layout  # noqa: E402
from test_graph_manager import RecordingBackend, _eager, _request  # noqa: E402

from graph_runtime.decode import eligibility as why  # noqa: E402
from graph_runtime.decode import DecodeEngine  # noqa: E402
from graph_runtime.lora import LoraChoice, read_lora  # noqa: E402
from tests.owners import loaded_for  # noqa: E402
from graph_runtime.lora.file import WeightPatch  # noqa: E402
from graph_runtime.sampling.sampler import SamplingRequest, sample  # noqa: E402

# Two LoRAs on one weight are summed in the merge's order, the reference adds them one by one: fp32 round-off
# (~1e-7 relative) in the weights, which four steps through the tiny model carry to at most ~1e-6 in the latents.
TWO_LORA_ATOL = 1e-5


@pytest.fixture()
def model(tiny_models):
    return copy.deepcopy(tiny_models.transformer).requires_grad_(False)


@pytest.fixture()
def loras(model, tmp_path):
    """Two LoRA files in different layouts (both change to_v) and what each holds."""
    files = {}
    for name, layout, seed in (("a", "kohya", 1), ("b", "comfy_fused_mlp", 2)):
        path = tmp_path / f"{name}.safetensors"
        expected = write_layout(path, layout, model, seed=seed)
        files[name] = (read_lora(path, model), expected)
    return files


def _merged_copy(model, sets):
    """A separate model whose weights are merged by the reference math: the run each output must equal."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, weight in reference_weights(model, sets).items():
            reference.get_parameter(name).copy_(weight)
    return reference


def test_switching_lora_sets_between_prompts_captures_nothing(model, loras, generator):
    """One loaded model, two LoRA sets taking turns (as two workflows with different LoRA chains would): after the
    first prompt captured its graphs, no prompt captures again, none falls back to eager, and every output equals a
    model merged by the reference math; back to no LoRA gives the first output bit for bit."""
    (lora_a, a), (lora_b, b) = loras["a"], loras["b"]
    sets = {"none": ([], []), "A": ([LoraChoice(lora_a, 1.0)], [(1.0, a)]),
            "B": ([LoraChoice(lora_b, 0.8), LoraChoice(lora_a, -0.4)], [(0.8, b), (-0.4, a)])}
    request = SamplingRequest(positive=generator.encoder.encode("a red cube"), latent_height=8, latent_width=8,
                              steps=4, seed=3)
    references = {}
    for name, (_, reference) in sets.items():
        merged = _merged_copy(model, reference)  # held here: an engine holds its model weakly
        references[name] = sample(DecodeEngine(merged, backend=RecordingBackend()), request).latents
    assert (references["A"] - references["B"]).abs().max() > 100 * TWO_LORA_ATOL  # the sets differ visibly
    engine = DecodeEngine(model, backend=RecordingBackend())
    outputs = []
    for i, name in enumerate(["none", "A", "A", "B", "A", "B", "none"]):
        with loaded_for(model).loras_in_use(sets[name][0]):
            result = sample(engine, request)
        captures = (result.stats["captures"], result.stats["prefill_captures"])
        assert captures == ((1, 1) if i == 0 else (0, 0)), (name, result.stats)
        assert result.stats["eager_steps"] == {} and result.stats["eager_prefills"] == {}, (name, result.stats)
        # Exact with one LoRA per weight (the same fp32 operations as the reference); two: see TWO_LORA_ATOL.
        atol = TWO_LORA_ATOL if len(sets[name][1]) > 1 else 0.0
        torch.testing.assert_close(result.latents, references[name], rtol=0, atol=atol)
        outputs.append(result.latents)
    assert torch.equal(outputs[1], outputs[2]) and torch.equal(outputs[0], outputs[-1])
    assert loaded_for(model).lora_state().merges == 5  # none->A, A->B, B->A, A->B, B->none: the repeated A did nothing


def test_a_model_without_loras_gets_no_lora_state(model):
    with loaded_for(model).loras_in_use([]) as changed:
        assert changed is False
    assert loaded_for(model).lora_state(create=False) is None


def test_guards_accept_an_in_place_merge_and_refuse_moved_or_wrapped_weights(model, loras, generator):
    """A merge writes into the weights' storage: the manager's scan sees no change, the captured graph replays and
    computes with the merged weights. A merge that swapped in new tensors, or a LoRA wrapper, is refused."""
    engine = DecodeEngine(model, backend=RecordingBackend())
    prefix, latents = _request(generator, "a red cube", engine=engine)
    t = torch.full((1,), 0.6)
    assert engine.decode_step(prefix, latents, t).path == "capture"
    scan = engine.guard.scan
    fingerprint = scan.fingerprint()
    before = engine.decode_step(prefix, latents, t).output
    loaded_for(model).lora_state().apply([LoraChoice(loras["a"][0], 1.0)])
    assert not scan.changed() and scan.fingerprint() == fingerprint and not why.has_lora_wrappers(model.modules())
    merged = engine.decode_step(prefix, latents, t)
    assert merged.path == "replay" and not torch.equal(merged.output, before)
    assert torch.equal(merged.output, _eager(engine, prefix, latents, t))

    attn = model.transformer_blocks[0].attn
    attn.to_q.weight = torch.nn.Parameter(attn.to_q.weight.detach() + 0.01, requires_grad=False)  # a new tensor
    assert scan.changed()
    moved = engine.decode_step(prefix, latents, t)
    assert moved.reason == why.WEIGHTS_MOVED and torch.equal(moved.output, _eager(engine, prefix, latents, t))
    assert engine.decode_step(prefix, latents, t).path == "capture"  # captured again against the new addresses

    attn.to_k.lora_A = torch.nn.ModuleDict()  # what a dynamic LoRA wrapper hangs on a Linear
    wrapped = engine.decode_step(prefix, latents, t)
    assert wrapped.reason == why.LORA and not engine.graphs.entries


def test_a_run_never_sees_the_weights_change(model, loras):
    """While a run holds set A, a run wanting set B waits for it to end; a run wanting A again joins at once."""
    state = loaded_for(model).lora_state()
    a, b = [LoraChoice(loras["a"][0], 1.0)], [LoraChoice(loras["b"][0], 1.0)]
    weight = model.transformer_blocks[0].attn.to_v.weight
    events, order = {k: threading.Event() for k in ("a_in", "a_done", "b_in")}, []

    def run_a():
        with state.using(a):
            order.append("A")
            held = weight.clone()
            events["a_in"].set()
            events["a_done"].wait(10)
            order.append("A unchanged" if torch.equal(weight, held) else "A saw a change")

    def run_b():
        events["a_in"].wait(10)
        with state.using(b):
            order.append("B")
            events["b_in"].set()

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for thread in threads:
        thread.start()
    events["a_in"].wait(10)
    with state.using(a) as changed:  # the same set joins the running one
        assert changed is False and order == ["A"]
    assert not events["b_in"].wait(0.3)  # B is still waiting for A's run to end
    events["a_done"].set()
    for thread in threads:
        thread.join(10)
    assert order == ["A", "A unchanged", "B"]
    assert state.merged_key == tuple(c.key for c in b)


def test_a_merge_that_fails_halfway_restores_the_originals(model, loras, monkeypatch):
    before = {name: p.clone() for name, p in model.named_parameters()}
    real, calls = WeightPatch.delta, []

    def failing(self, device, strength):
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("injected: out of memory while merging")
        return real(self, device, strength)

    monkeypatch.setattr(WeightPatch, "delta", failing)
    state = loaded_for(model).lora_state()
    with pytest.raises(torch.OutOfMemoryError):
        state.apply([LoraChoice(loras["a"][0], 1.0)])
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert state.merged == () and state.originals_bytes() == 0
    monkeypatch.setattr(WeightPatch, "delta", real)
    assert state.apply([LoraChoice(loras["a"][0], 1.0)]) is True  # the next good run merges normally
    name = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(model.get_parameter(name), before[name])


def test_a_deep_copy_of_a_merged_model_has_no_lora_state(model, loras):
    loaded_for(model).lora_state().apply([LoraChoice(loras["a"][0], 1.0)])
    twin = copy.deepcopy(model)
    assert loaded_for(twin).lora_state(create=False) is None
    assert torch.equal(twin.transformer_blocks[0].attn.to_q.weight, model.transformer_blocks[0].attn.to_q.weight)


def test_merge_time_is_reported(model, loras):
    state = loaded_for(model).lora_state()
    started = time.perf_counter()
    state.apply([LoraChoice(loras["a"][0], 1.0)])
    described = state.describe()
    assert described["loras"] == [{"name": "a.safetensors", "path": loras["a"][0].path, "strength": 1.0}]
    assert 0 < described["last_merge_ms"] <= (time.perf_counter() - started) * 1e3 + 1
    assert described["weights"] == 14 and described["originals_bytes"] == sum(
        model.get_parameter(name).numel() * 4 for name in loras["a"][0].patches)
