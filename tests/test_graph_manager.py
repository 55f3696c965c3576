"""Graph manager semantics that do not depend on CUDA, driven through a recording capture backend.

The backend "captures" by keeping the decode body and "replays" by running it on the entry's static buffers, so
everything the manager owns (keys, static buffers, prefix refresh, ownership, LRU, failure markers, fallbacks,
statistics) runs for real on CPU; only `torch.cuda.CUDAGraph` itself is left to the GPU tests.
"""

import gc
import logging

import pytest
import torch

from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.decode import eligibility as why
from graph_runtime.decode.capture import DecodeGraphEntry, PrefixGraph
from graph_runtime.decode.graphs import FailedEntry, make_key
from graph_runtime.decode.prefill import run_prefill
from graph_runtime.sampling.sampler import initial_noise, pack


class RecordingBackend:
    name = "recording"

    def __init__(self, fail_capture=False):
        self.fail_capture = fail_capture
        self.capture_calls = 0

    def unavailable_reason(self, transformer, params=None):
        return None

    def capture(self, entry, body):
        self.capture_calls += 1
        if self.fail_capture:
            raise RuntimeError("injected capture failure")
        entry.graph = body
        entry.output = body(entry.inputs)
        entry.captures += 1

    def replay(self, entry):
        entry.replays += 1
        out = entry.graph(entry.inputs)
        return None if out is None else out.clone()  # a prefix pass returns nothing


@pytest.fixture()
def engine(tiny_models):
    return DecodeEngine(tiny_models.transformer, max_entries=2, backend=RecordingBackend())


def _request(generator, prompt, shapes=((1, 8, 8),), seed=0, engine=None, branch="cond"):
    embeds = generator.encoder.encode(prompt)
    layout = TokenLayout.build(embeds.image_mask, shapes, "cpu")
    h, w = shapes[-1][1:]
    latents = pack(initial_noise(seed, 1, 64, h, w, torch.float32))
    t = torch.full((1,), 0.8)
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds.embeds, t, branch=branch)
    return prefix, latents


def _eager(engine, prefix, latents, t):
    return engine.decode_step(prefix, latents, t, mode="eager").output


def test_replay_on_static_buffers_equals_eager_decode(engine, generator):
    """The static [prefix | target] K/V path gives the eager concatenating path's output exactly (CPU fp32)."""
    prefix, latents = _request(generator, "a red cube", engine=engine)
    t = torch.full((1,), 0.6)
    first = engine.decode_step(prefix, latents, t)
    second = engine.decode_step(prefix, latents * 0.5, t)
    assert (first.path, second.path) == ("capture", "replay")
    assert torch.equal(first.output, _eager(engine, prefix, latents, t))
    assert torch.equal(second.output, _eager(engine, prefix, latents * 0.5, t))
    assert engine.graphs.stats.captures == 1 and engine.graphs.stats.replays == 2


def test_claimed_prefill_writes_into_static_buffers(engine, generator):
    """A request that claims its entry at prefill keeps a single copy of its prefix: views of the static buffers."""
    prefix, latents = _request(generator, "a red cube", engine=engine)
    entry = next(iter(engine.graphs.entries.values()))
    assert prefix.k[0].data_ptr() == entry.inputs.k[0].data_ptr()
    assert prefix.k[0].shape[1] == prefix.layout.prefix_len < entry.inputs.k[0].shape[1]
    engine.decode_step(prefix, latents, torch.full((1,), 0.6))
    assert entry.refresh_prefix(prefix) is False


def test_unclaimed_prefix_is_copied_once_when_it_changes(engine, generator):
    """A prefix made without a claim (here: prefilled while the key was owned) is copied in at its first graph step
    after the owner is gone, consecutive steps copy nothing, and an in-place write to it (its version counter)
    makes the next step copy again."""
    owner, latents = _request(generator, "a red cube", engine=engine)
    other, _ = _request(generator, "a red cube", engine=engine, seed=1)
    entry = next(iter(engine.graphs.entries.values()))
    assert other.k[0].data_ptr() != entry.inputs.k[0].data_ptr()  # refused at prefill: its own tensors
    owner.release()
    gc.collect()
    assert entry.refresh_prefix(other) is True
    assert entry.refresh_prefix(other) is False
    with torch.no_grad():
        other.v[-1].mul_(0.5)
    assert entry.refresh_prefix(other) is True
    assert torch.equal(entry.inputs.v[-1][:, :other.layout.prefix_len], other.v[-1])
    assert entry.refresh_prefix(other) is False


def _key(engine, prefix, latents):
    return make_key(engine.step, prefix.branch, prefix.batch, prefix.layout, latents.dtype, latents.device)


def test_equal_token_counts_with_different_layouts_get_separate_entries(engine, generator):
    """8x8 and 4x16 targets have 64 tokens each but different RoPE positions: two keys, two captures."""
    a, la = _request(generator, "a red cube", shapes=((1, 8, 8),), engine=engine)
    b, lb = _request(generator, "a red cube", shapes=((1, 4, 16),), engine=engine)
    t = torch.full((1,), 0.6)
    out_a = engine.decode_step(a, la, t)
    out_b = engine.decode_step(b, lb, t)
    assert out_a.path == out_b.path == "capture"
    assert len(engine.graphs.entries) == 2
    assert torch.equal(out_b.output, _eager(engine, b, lb, t))


def test_lru_eviction_bounds_entries(engine, generator):
    """With max_entries=2 a third key evicts the least recently used one."""
    t = torch.full((1,), 0.6)
    keys = []
    for shape in ((1, 8, 8), (1, 4, 16), (1, 16, 4)):
        prefix, latents = _request(generator, "a cat", shapes=(shape,), engine=engine)
        engine.decode_step(prefix, latents, t)
        keys.append(_key(engine, prefix, latents))
    assert list(engine.graphs.entries) == keys[1:]
    assert engine.graphs.stats.evictions == 1


def test_idle_entries_make_room_when_the_card_is_short(tiny_models, generator):
    """A new entry that would leave less than MEMORY_HEADROOM free evicts idle entries (LRU first), never the
    entry of a request still generating; with room to spare nothing is evicted."""
    import graph_runtime.decode.graphs as gm

    backend = RecordingBackend()
    engine = DecodeEngine(tiny_models.transformer, max_entries=4, backend=backend)
    t = torch.full((1,), 0.6)
    backend.free_bytes = lambda device: gm.MEMORY_HEADROOM * 10
    live, live_latents = _request(generator, "a cat", shapes=((1, 8, 8),), engine=engine)
    idle, idle_latents = _request(generator, "a cat", shapes=((1, 4, 16),), engine=engine)
    for prefix, latents in ((live, live_latents), (idle, idle_latents)):
        engine.decode_step(prefix, latents, t)
    live_key, idle_key = _key(engine, live, live_latents), _key(engine, idle, idle_latents)
    idle.release()
    del idle
    gc.collect()
    third, third_latents = _request(generator, "a cat", shapes=((1, 16, 4),), engine=engine)
    assert len(engine.graphs.entries) == 3 and engine.graphs.stats.evictions == 0

    backend.free_bytes = lambda device: 0  # the card is full: only idle entries may go
    third.release()
    del third
    gc.collect()
    fourth, fourth_latents = _request(generator, "a dog", shapes=((1, 2, 32),), engine=engine)
    assert idle_key not in engine.graphs.entries and live_key in engine.graphs.entries
    assert engine.graphs.stats.evictions == 2  # the idle 4x16 and 16x4 entries, not the live 8x8 one
    assert torch.equal(engine.decode_step(live, live_latents, t).output, _eager(engine, live, live_latents, t))
    assert engine.decode_step(fourth, fourth_latents, t).path == "capture"


def test_second_live_request_is_refused_until_owner_released(engine, generator):
    """Two requests with one key: the second runs eager (correctly) while the first lives, then takes over."""
    t = torch.full((1,), 0.6)
    owner, latents = _request(generator, "a red cube", engine=engine)
    other, latents_b = _request(generator, "a red cube", engine=engine, seed=3)
    assert engine.decode_step(owner, latents, t).path == "capture"
    refused = engine.decode_step(other, latents_b, t)
    assert (refused.path, refused.reason) == ("eager", why.OWNED)
    assert torch.equal(refused.output, _eager(engine, other, latents_b, t))
    # The owner keeps replaying with its own prefix, untouched by the refused request.
    assert torch.equal(engine.decode_step(owner, latents, t).output, _eager(engine, owner, latents, t))
    owner.release()
    gc.collect()
    adopted = engine.decode_step(other, latents_b, t)
    assert adopted.path == "replay" and torch.equal(adopted.output, _eager(engine, other, latents_b, t))
    assert engine.graphs.stats.eager_steps[why.OWNED] == 1


def test_capture_failure_leaves_a_marker_and_stays_eager(tiny_models, generator, caplog):
    """A failing capture ends eager and correct, logs once, and the key is not retried."""
    backend = RecordingBackend(fail_capture=True)
    engine = DecodeEngine(tiny_models.transformer, backend=backend)
    prefix, latents = _request(generator, "a red cube", engine=engine)
    t = torch.full((1,), 0.6)
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        first = engine.decode_step(prefix, latents, t)
        second = engine.decode_step(prefix, latents, t)
    assert first.reason == second.reason == why.CAPTURE_FAILED
    assert torch.equal(first.output, _eager(engine, prefix, latents, t))
    assert backend.capture_calls == 1
    assert isinstance(next(iter(engine.graphs.entries.values())), FailedEntry)
    assert sum(why.CAPTURE_FAILED in r.message for r in caplog.records) == 2  # the failure + one fallback line
    assert engine.graphs.stats.eager_steps[why.CAPTURE_FAILED] == 2


def test_allocation_failure_leaves_a_marker(tiny_models, generator, monkeypatch):
    """Out of memory while allocating static buffers: marker, eager, correct."""
    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    monkeypatch.setattr(DecodeGraphEntry, "__init__", oom)
    prefix, latents = _request(generator, "a red cube", engine=engine)
    t = torch.full((1,), 0.6)
    out = engine.decode_step(prefix, latents, t)
    assert out.reason == why.ALLOCATION_FAILED
    assert torch.equal(out.output, _eager(engine, prefix, latents, t))
    assert engine.status()["entries"][0]["state"] == "failed"


def test_lora_wrappers_drop_entries_and_force_eager(tiny_models, generator):
    """When LoRA layers appear on the transformer the captured graphs are dropped and decode goes eager."""
    from diffusers import QwenImage21Transformer2DModel
    from graph_runtime.tiny import TINY_TRANSFORMER

    transformer = QwenImage21Transformer2DModel(**TINY_TRANSFORMER).eval()
    transformer.load_state_dict(tiny_models.transformer.state_dict())
    engine = DecodeEngine(transformer, backend=RecordingBackend())
    prefix, latents = _request(generator, "a red cube", engine=engine)
    t = torch.full((1,), 0.6)
    assert engine.decode_step(prefix, latents, t).path == "capture"
    transformer.transformer_blocks[0].attn.to_q.lora_A = torch.nn.ModuleDict()  # what a LoRA wrapper exposes
    out = engine.decode_step(prefix, latents, t)
    assert out.reason == why.LORA and not engine.graphs.entries


def test_padded_text_mask_stays_eager(engine, generator):
    """A padded text mask forces eager decode (with the mask applied), never a graph."""
    embeds = generator.encoder.encode("a red cube")
    mask = torch.ones_like(embeds.image_mask)
    mask[:, :2] = False  # two padded positions
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 8)], "cpu")
    latents = pack(initial_noise(0, 1, 64, 8, 8, torch.float32))
    t = torch.full((1,), 0.6)
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds.embeds, t, text_mask=mask)
    out = engine.decode_step(prefix, latents, t)
    assert out.reason == why.PADDED_TEXT and not engine.graphs.entries
    unmasked = generator.encoder.encode("a red cube")
    with torch.no_grad():
        _, plain = engine.prefill(layout, latents, unmasked.embeds, t)
    assert not torch.allclose(out.output, _eager(engine, plain, latents, t))


def test_statistics_and_status(engine, generator):
    """Statistics count captures, replays and eager steps by reason; status reports bytes and owners."""
    prefix, latents = _request(generator, "a red cube", engine=engine)
    t = torch.full((1,), 0.6)
    engine.decode_step(prefix, latents, t)
    engine.decode_step(prefix, latents, t)
    engine.decode_step(prefix, latents, t, mode="eager")
    status = engine.status()
    assert (status["captures"], status["replays"]) == (1, 2)
    assert status["eager_steps"] == {why.MODE_EAGER: 1}
    entry = status["entries"][0]
    assert entry["owner_alive"] is True and entry["bytes"] > 0 and entry["key"]["target_tokens"] == 64
    assert status["bytes_held"] == entry["bytes"]
    held = engine.release()
    assert held["entries"] == 1 and engine.status()["entries"] == []


def test_cpu_only_machine_reports_no_cuda(tiny_models, generator):
    """With the real CUDA backend on a machine without CUDA, every decode step is eager with reason 'no CUDA'."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the GPU tests cover the real backend")
    engine = DecodeEngine(tiny_models.transformer)
    prefix, latents = _request(generator, "a red cube", engine=engine)
    out = engine.decode_step(prefix, latents, torch.full((1,), 0.6))
    assert out.reason == why.NO_CUDA and engine.graphs.stats.eager_steps[why.NO_CUDA] == 1


def test_the_cuda_malloc_async_allocator_keeps_steps_eager_for_a_counted_reason(tiny_models, generator, monkeypatch,
                                                                               caplog):
    """Under cudaMallocAsync (ComfyUI's --cuda-malloc) a capture that runs Triton kernels fails and its aborted
    allocations fault the process when freed: the engine never tries one there. Each step is eager for that reason,
    counted, and said once in the log (the judgement comes before any device check, so CUDA is faked here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    engine = DecodeEngine(tiny_models.transformer)
    prefix, latents = _request(generator, "a red cube", engine=engine)
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        outs = [engine.decode_step(prefix, latents, torch.full((1,), t)) for t in (0.6, 0.3)]
    assert [o.reason for o in outs] == [why.ASYNC_ALLOCATOR] * 2
    assert engine.graphs.stats.eager_steps[why.ASYNC_ALLOCATOR] == 2 and engine.graphs.stats.captures == 0
    assert sum(why.ASYNC_ALLOCATOR in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    assert why.static_reason(tiny_models.transformer) == why.WEIGHTS_OFF_GPU  # the next check: CPU weights


def test_unknown_decode_mode_is_rejected(engine, generator):
    prefix, latents = _request(generator, "a red cube", engine=engine)
    with pytest.raises(ValueError, match="decode mode 'fast' is invalid"):
        engine.decode_step(prefix, latents, torch.full((1,), 0.6), mode="fast")



def _prefix_only(generator, engine, text_scale=1.0, shapes=((1, 8, 8),)):
    """A prefix-only prefill (what the sampler runs) of one prompt; `text_scale` makes another prompt of the same
    length, hence the same key."""
    embeds = generator.encoder.encode("a red cube")
    layout = TokenLayout.build(embeds.image_mask, shapes, "cpu")
    h, w = shapes[-1][1:]
    latents = pack(initial_noise(0, 1, 64, h, w, torch.float32))
    text = embeds.embeds if text_scale == 1.0 else embeds.embeds.flip(1) * text_scale
    t = torch.full((1,), 0.8)
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, text, t, with_target=False)
        _, eager = run_prefill(engine.transformer, layout, latents, text, t, with_target=False)
    return prefix, eager


def _same_kv(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v))


def test_prefix_pass_is_captured_once_and_replayed_by_the_next_prompt(engine, generator):
    """The first prefix-only prefill of a key captures its prefix pass into the entry; the next prompt with the key
    replays it with its own text. Both leave exactly an eager prefix pass's K/V (CPU fp32, the same code)."""
    first, eager_first = _prefix_only(generator, engine)
    stats = engine.graphs.stats
    assert (stats.prefill_captures, stats.prefill_replays) == (1, 1)
    assert _same_kv(first, eager_first)
    first.release()
    gc.collect()
    second, eager_second = _prefix_only(generator, engine, text_scale=0.5)
    assert (stats.prefill_captures, stats.prefill_replays, dict(stats.eager_prefills)) == (1, 2, {})
    assert _same_kv(second, eager_second) and not _same_kv(second, eager_first)
    entry = next(iter(engine.graphs.entries.values()))
    assert entry.prefix_graph.replays == 2 and entry.nbytes > entry.prefix_graph.nbytes > 0


def test_prefix_pass_capture_failure_runs_eagerly_and_decode_still_replays(tiny_models, generator, caplog):
    """A prefix pass that cannot be captured runs eagerly (same K/V), is logged once and counted per prefill, and
    is not retried; the entry's decode graph is unaffected."""

    class PrefixFailingBackend(RecordingBackend):
        def capture(self, entry, body):
            if isinstance(entry, PrefixGraph):
                self.capture_calls += 1
                raise RuntimeError("injected prefix capture failure")
            super().capture(entry, body)

    backend = PrefixFailingBackend()
    engine = DecodeEngine(tiny_models.transformer, backend=backend)
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        first, eager_first = _prefix_only(generator, engine)
        first.release()
        gc.collect()
        second, eager_second = _prefix_only(generator, engine, text_scale=0.5)
    assert _same_kv(first, eager_first) and _same_kv(second, eager_second)
    stats = engine.graphs.stats
    assert (stats.prefill_captures, stats.prefill_replays) == (0, 0)
    assert dict(stats.eager_prefills) == {why.CAPTURE_FAILED: 2}
    assert backend.capture_calls == 1
    assert sum("prefix pass" in r.message for r in caplog.records) == 2  # the failure + one fallback line
    latents = pack(initial_noise(0, 1, 64, 8, 8, torch.float32))
    assert engine.decode_step(second, latents, torch.full((1,), 0.6)).path == "capture"


def test_prefix_pass_is_recaptured_when_the_weights_move(engine, generator):
    """A captured prefix pass reads the weights where they were: once any weight's storage moves, the next prefill
    captures again instead of replaying stale addresses."""
    first, _ = _prefix_only(generator, engine)
    first.release()
    gc.collect()
    weight = engine.transformer.transformer_blocks[0].attn.to_q.weight
    weight.data = weight.data.clone()  # same values, new address (what an offload and reload does)
    second, eager_second = _prefix_only(generator, engine, text_scale=0.5)
    assert engine.graphs.stats.prefill_captures == 2 and _same_kv(second, eager_second)
    entry = next(iter(engine.graphs.entries.values()))
    assert entry.prefix_graph.weights_fingerprint == engine.guard.fingerprint()


def test_structure_watch_sees_a_linear_replaced_or_wrapped(tiny_models):
    """The per-step structure check notices a Linear swapped for another module (how PEFT wraps) and a Linear that
    grew submodules (how other LoRA loaders hang theirs), and is quiet again once the model is as it was."""
    import copy

    model = copy.deepcopy(tiny_models.transformer)
    watch = why.StructureWatch(model.modules())
    attn = model.transformer_blocks[1].attn
    original = attn.to_k
    assert not watch.changed()
    attn.to_k = torch.nn.Linear(original.in_features, original.out_features)
    assert watch.changed()
    attn.to_k = original
    assert not watch.changed()
    original.lora_down = torch.nn.Linear(original.in_features, 1)
    assert watch.changed()
    del original.lora_down
    assert not watch.changed()


def test_one_module_tree_scan_per_prompt(engine, generator, monkeypatch):
    """The whole-model checks of a request start read one scan of the module tree (each walk costs milliseconds
    of host time on the full model); its decode steps scan nothing, and weights moved mid-prompt cost one more."""
    scans = []
    real = why.ModelScan.__init__
    monkeypatch.setattr(why.ModelScan, "__init__", lambda self, model: scans.append(1) or real(self, model))
    prefix, latents = _request(generator, "a red cube", engine=engine)
    for step in range(3):
        assert engine.decode_step(prefix, latents, torch.full((1,), 0.6)).reason is None
    assert len(scans) == 1
    with torch.no_grad():
        block = engine.transformer.transformer_blocks[0]
        block.attn.to_q.weight = torch.nn.Parameter(block.attn.to_q.weight.clone(), requires_grad=False)
    assert engine.decode_step(prefix, latents, torch.full((1,), 0.6)).reason == why.WEIGHTS_MOVED
    assert engine.decode_step(prefix, latents, torch.full((1,), 0.6)).path == "capture"
    assert len(scans) == 2


def test_an_unchanged_model_is_not_walked_again_at_the_next_prompt(tiny_models, generator, monkeypatch):
    """The next prompt on an unchanged model reuses the module-tree scan and its LoRA verdict (the walk and the LoRA
    scan cost milliseconds of host time per prompt on the full model); the static checks (devices, hooks) still
    judge the model again at each prompt, so a hook added since the last one is seen."""

    class JudgingBackend(RecordingBackend):
        judged = 0

        def unavailable_reason(self, transformer, params=None):
            self.judged += 1
            hooked = any(b._forward_hooks for b in transformer.transformer_blocks)
            return why.BLOCK_HOOKS if hooked else None

    engine = DecodeEngine(tiny_models.transformer, backend=JudgingBackend())
    scans, lora_scans = [], []
    real_scan, real_lora = why.ModelScan.__init__, why.has_lora_wrappers
    monkeypatch.setattr(why.ModelScan, "__init__", lambda self, model: scans.append(1) or real_scan(self, model))
    monkeypatch.setattr(why, "has_lora_wrappers", lambda modules: lora_scans.append(1) or real_lora(modules))
    for prompt in ("a red cube", "a blue cube"):
        prefix, latents = _request(generator, prompt, engine=engine)
        assert engine.decode_step(prefix, latents, torch.full((1,), 0.6)).reason is None
        prefix.release()
        gc.collect()
    assert (len(scans), len(lora_scans), engine.graphs.backend.judged) == (1, 1, 2)
    handle = tiny_models.transformer.transformer_blocks[0].register_forward_hook(lambda *args: None)
    try:
        prefix, latents = _request(generator, "a green cube", engine=engine)
        assert engine.decode_step(prefix, latents, torch.full((1,), 0.6)).reason == why.BLOCK_HOOKS
    finally:
        handle.remove()
    assert (len(scans), len(lora_scans)) == (1, 1)  # a hook is judged without walking the tree again


def _changes():
    """Edits anywhere in the module tree that a request start must notice, each with its undo."""
    def add_attribute(m):
        m.transformer_blocks[0].attn.lora_A = torch.zeros(1)  # a plain attribute, not a module or parameter
        return lambda: delattr(m.transformer_blocks[0].attn, "lora_A")

    def add_submodule(m):
        m.transformer_blocks[1].lora_down = torch.nn.Identity()  # under a block, not a Linear
        return lambda: delattr(m.transformer_blocks[1], "lora_down")

    def replace_module(m):
        old = m.transformer_blocks[0].img_mlp
        m.transformer_blocks[0].img_mlp = torch.nn.Identity()
        return lambda: setattr(m.transformer_blocks[0], "img_mlp", old)

    def retype_module(m):
        norm = m.norm_out
        old = type(norm)
        norm.__class__ = type("Patched", (old,), {})
        return lambda: setattr(norm, "__class__", old)

    def add_buffer(m):
        m.transformer_blocks[0].register_buffer("lora_scale", torch.ones(1))
        return lambda: m.transformer_blocks[0]._buffers.pop("lora_scale")

    return [add_attribute, add_submodule, replace_module, retype_module, add_buffer]


@pytest.mark.parametrize("change", _changes(), ids=lambda f: f.__name__)
def test_tree_watch_sees_any_module_tree_change(tiny_models, change):
    """The request-start check notices a change anywhere in the tree (not only on the Linears the per-step check
    watches), in each place a LoRA loader or patcher leaves one, and is quiet again once it is undone."""
    import copy

    model = copy.deepcopy(tiny_models.transformer)
    scan = why.ModelScan(model)
    assert not scan.stale()
    undo = change(model)
    assert scan.stale()
    undo()
    assert not scan.stale()


def test_a_lora_attribute_added_between_prompts_is_judged(tiny_models, generator):
    """A LoRA marker that only the whole-model LoRA scan finds (an attribute on a non-Linear module) still makes the
    next prompt decode eagerly: the changed tree is walked and judged again."""
    from diffusers import QwenImage21Transformer2DModel
    from graph_runtime.tiny import TINY_TRANSFORMER

    transformer = QwenImage21Transformer2DModel(**TINY_TRANSFORMER).eval()
    transformer.load_state_dict(tiny_models.transformer.state_dict())
    engine = DecodeEngine(transformer, backend=RecordingBackend())
    prefix, latents = _request(generator, "a red cube", engine=engine)
    assert engine.decode_step(prefix, latents, torch.full((1,), 0.6)).path == "capture"
    prefix.release()
    gc.collect()
    transformer.transformer_blocks[0].attn.lora_A = torch.zeros(1)
    prefix, latents = _request(generator, "a red cube", engine=engine)
    assert engine.decode_step(prefix, latents, torch.full((1,), 0.6)).reason == why.LORA


def test_long_prefix_runs_its_pass_eagerly(engine, generator, monkeypatch):
    """A prefix longer than SHORT_PREFIX_TOKENS keeps the GPU busy by itself: its pass runs eagerly (same K/V),
    counted under its own reason, and nothing is captured for it."""
    from graph_runtime.decode import step as step_body

    monkeypatch.setattr(step_body, "SHORT_PREFIX_TOKENS", 4)
    prefix, eager = _prefix_only(generator, engine)
    stats = engine.graphs.stats
    assert _same_kv(prefix, eager)
    assert (stats.prefill_captures, stats.prefill_replays) == (0, 0)
    assert dict(stats.eager_prefills) == {why.LONG_PREFIX: 1}
    assert next(iter(engine.graphs.entries.values())).prefix_graph is None
