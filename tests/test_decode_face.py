"""The decode package's seams on CPU: entry ownership, the model guard's verdict (acted on by the engine, never by
eligibility itself), and the sampler's reporter. The recording capture backend of tests/test_graph_manager.py runs
the graph policy for real without CUDA."""

import ast
import gc
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

import graph_runtime.decode as decode
from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.decode import eligibility as why
from graph_runtime.decode.graphs import EntryOwners
from graph_runtime.decode.prefill import OwnerToken
from graph_runtime.sampling.reporter import SampleReporter
from graph_runtime.sampling.sampler import SamplingRequest, initial_noise, pack, sample
from tests.test_graph_manager import RecordingBackend

T = torch.full((1,), 0.6)


def _fresh_transformer(tiny_models):
    """A private copy of the tiny transformer, free to be wrapped or edited."""
    from diffusers import QwenImage21Transformer2DModel
    from graph_runtime.tiny import TINY_TRANSFORMER

    transformer = QwenImage21Transformer2DModel(**TINY_TRANSFORMER).eval()
    transformer.load_state_dict(tiny_models.transformer.state_dict())
    return transformer


def _captured_prefix(engine, generator):
    embeds = generator.encoder.encode("a red cube")
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 8)], "cpu")
    latents = pack(initial_noise(0, 1, 64, 8, 8, torch.float32))
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds.embeds, torch.full((1,), 0.8), with_target=False)
    assert engine.decode_step(prefix, latents, T).path == "capture"
    return prefix, latents


# -- the face ----------------------------------------------------------------------------------------------------


def test_the_package_exports_the_engine_face():
    """Callers outside the package import these names from `graph_runtime.decode`; all of them resolve."""
    assert set(decode.__all__) >= {"DecodeEngine", "DecodeOutcome", "PrefixCache", "TokenLayout", "DECODE_MODES"}
    assert all(hasattr(decode, name) for name in decode.__all__)
    assert decode.DECODE_MODES == ("auto", "graph", "eager")


def _decode_imports() -> dict[str, set[str]]:
    """Each module of graph_runtime/decode and the modules of the package it imports (at the top or in a function)."""
    folder = Path(decode.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        graph[path.stem] = found - {path.stem}
    return graph


def test_the_decode_package_has_no_import_cycle_and_nothing_imports_the_face():
    """Inside graph_runtime/decode every import runs one way (no cycle, at the top or inside a function), and only
    the package's `__init__` imports `engine`: the face sits on top of the mechanics, never below them."""
    graph = _decode_imports()
    assert {name for name, imports in graph.items() if "engine" in imports} == {"__init__"}
    done, on_path = set(), []

    def visit(name):
        assert name not in on_path, f"import cycle in graph_runtime/decode: {' -> '.join(on_path + [name])}"
        if name in done:
            return
        on_path.append(name)
        for imported in sorted(graph.get(name, ())):
            visit(imported)
        on_path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


class _WatchedLock:
    """The graphs' lock, counting how deep the current thread holds it."""

    def __init__(self):
        self._lock, self.depth = threading.RLock(), 0

    def __enter__(self):
        self._lock.__enter__()
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1
        return self._lock.__exit__(*exc)


def test_every_capture_and_replay_runs_under_the_graphs_lock_taken_by_the_graphs(tiny_models, generator):
    """Replays of one memory pool must be serialized: every capture and replay (decode step and prefix pass) runs
    under `DecodeGraphs.lock`, and the engine's face takes it for its callers (no caller holds it here)."""
    lock = _WatchedLock()
    seen = []

    class LockCheckingBackend(RecordingBackend):
        def capture(self, entry, body):
            seen.append(("capture", lock.depth))
            super().capture(entry, body)

        def replay(self, entry):
            seen.append(("replay", lock.depth))
            return super().replay(entry)

    engine = DecodeEngine(tiny_models.transformer, backend=LockCheckingBackend())
    engine.graphs.lock = lock
    prefix, latents = _captured_prefix(engine, generator)
    assert engine.decode_step(prefix, latents, T).path == "replay"
    assert engine.stats.prefill_captures == 1 and engine.stats.replays == 2
    assert len(seen) == 5 and all(depth >= 1 for _, depth in seen)  # prefix capture + replay, step capture + 2
    assert lock.depth == 0


# -- ownership ---------------------------------------------------------------------------------------------------


def test_an_entry_is_claimed_by_one_token_refused_to_another_while_alive_and_free_after_release():
    """Two prompts never share an entry's buffers: the owner may use it, any other token is refused while the owner
    lives, and once the owner's token dies the key is free for the next request to claim."""
    owners, key = EntryOwners(), "key"
    first, second = OwnerToken(), OwnerToken()
    assert not owners.alive(key) and not owners.owned_by_other(key, first)
    owners.claim(key, first)
    assert owners.alive(key)
    assert not owners.owned_by_other(key, first)  # its own owner may use it
    assert owners.owned_by_other(key, second)
    assert owners.claim_if_free(key, second) is False and owners.owned_by_other(key, second)
    del first  # the owner's request released its cache: its token dies
    gc.collect()
    assert not owners.alive(key) and not owners.owned_by_other(key, second)
    assert owners.claim_if_free(key, second) is True and owners.owned_by_other(key, OwnerToken())


def test_forgetting_a_key_frees_it_even_while_its_owner_lives():
    """An entry that is evicted or dropped takes its owner record with it."""
    owners, token = EntryOwners(), OwnerToken()
    owners.claim("key", token)
    owners.forget("key")
    assert not owners.alive("key") and not owners.owned_by_other("key", OwnerToken())


# -- the model guard's verdict -----------------------------------------------------------------------------------


def test_a_plain_model_gets_an_ok_verdict_with_its_fingerprint(tiny_models):
    """An unwrapped model on a backend with no objection may replay and keeps its graphs; the request's own checks
    (here a padded text mask) refuse replay without asking for the graphs to go."""
    guard = why.ModelGuard(tiny_models.transformer, RecordingBackend())
    verdict = guard.check(torch.float32, None)
    assert verdict.ok and verdict.reason is None and not verdict.drop_graphs
    assert verdict.fingerprint == guard.fingerprint()
    padded = guard.check(torch.float32, torch.ones(1, 4, dtype=torch.bool))
    assert (padded.ok, padded.reason, padded.drop_graphs) == (False, why.PADDED_TEXT, False)


def test_a_lora_wrapped_model_gets_a_drop_verdict_and_the_engine_not_the_guard_drops_the_entries(tiny_models,
                                                                                              generator):
    """LoRA wrappers appearing after a capture give a verdict that asks for the graphs to be dropped; judging alone
    leaves the manager's entries in place, and the engine's decode is what removes them and runs eagerly."""
    transformer = _fresh_transformer(tiny_models)
    engine = DecodeEngine(transformer, backend=RecordingBackend())
    prefix, latents = _captured_prefix(engine, generator)
    transformer.transformer_blocks[0].attn.to_q.lora_A = torch.nn.ModuleDict()  # what a LoRA wrapper exposes
    verdict = engine.guard.check(prefix.k[0].dtype, prefix.key_valid)
    assert (verdict.reason, verdict.drop_graphs) == (why.LORA, True)
    assert len(engine.graphs.entries) == 1  # judging changed nothing in the manager
    outcome = engine.decode_step(prefix, latents, T)
    assert (outcome.path, outcome.reason) == ("eager", why.LORA)
    assert not engine.graphs.entries and engine.stats.eager_steps[why.LORA] == 1


def test_moved_weights_are_not_a_drop_verdict_the_replay_drops_the_stale_graph(tiny_models, generator):
    """Weights at new addresses leave the model fit to replay (the verdict carries the new fingerprint); the
    entry whose graph was captured against the old one is what falls back and is dropped, then recaptured."""
    transformer = _fresh_transformer(tiny_models)
    engine = DecodeEngine(transformer, backend=RecordingBackend())
    prefix, latents = _captured_prefix(engine, generator)
    before = engine.guard.fingerprint()
    weight = transformer.transformer_blocks[0].attn.to_q.weight
    weight.data = weight.data.clone()
    verdict = engine.guard.check(prefix.k[0].dtype, prefix.key_valid)
    assert verdict.ok and not verdict.drop_graphs and verdict.fingerprint != before
    assert len(engine.graphs.entries) == 1
    assert engine.decode_step(prefix, latents, T).reason == why.WEIGHTS_MOVED and not engine.graphs.entries
    assert engine.decode_step(prefix, latents, T).path == "capture"


# -- the sampler's reporter --------------------------------------------------------------------------------------


def _outcome(path, reason=None):
    return SimpleNamespace(path=path, reason=reason)


def test_reporter_reports_the_first_replay_once_and_fallbacks_of_step_one_only():
    """Captures are reported where they happen, fallbacks only for step 1 (they say why the run is eager), and
    `replay` once per run, at the first step any branch replays."""
    events = []
    reporter = SampleReporter(on_event=lambda name, data: events.append((name, data)))
    reporter.decoded(1, "cond", _outcome("capture"))
    reporter.decoded(1, "uncond", _outcome("eager", why.OWNED))
    reporter.step_done(1, ["capture", "eager"])
    for step in (2, 3):
        reporter.decoded(step, "cond", _outcome("replay"))
        reporter.decoded(step, "uncond", _outcome("eager", why.OWNED))
        reporter.step_done(step, ["replay", "eager"])
    assert events == [("capture", {"branch": "cond", "step": 1}),
                      ("fallback", {"branch": "uncond", "reason": why.OWNED}),
                      ("replay", {"step": 2})]


def test_reporter_progress_unpacks_only_for_a_listener():
    """Unpacking the latents for progress costs a copy per step: it happens only when a progress callback is set."""
    made = []
    SampleReporter().progress(1, 2, lambda: made.append(1))
    assert made == []
    seen = []
    SampleReporter(on_step=lambda step, total, latents: seen.append((step, total, latents))).progress(
        1, 2, lambda: "latents")
    assert seen == [(1, 2, "latents")]


def test_sample_reports_prefill_capture_first_replay_and_done_once_each(tiny_models, generator):
    """A graph run of four steps: the prefill, step 1's capture, the first replay (step 2) and the final
    statistics, each reported once, in that order; progress for every step."""
    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    request = SamplingRequest(positive=generator.encoder.encode("a red cube"), latent_height=8, latent_width=8,
                              steps=4)
    events, steps = [], []
    result = sample(engine, request, on_step=lambda step, total, latents: steps.append(step),
                    on_event=lambda name, data: events.append((name, data)))
    assert [name for name, _ in events] == ["prefill", "capture", "replay", "done"]
    assert events[1][1] == {"branch": "cond", "step": 1} and events[2][1] == {"step": 2}
    assert events[3][1]["captures"] == 1 and events[3][1]["replays"] == 4 and events[3][1]["prefill_replays"] == 1
    assert steps == [1, 2, 3, 4] and result.paths == ["capture", "replay", "replay", "replay"]
