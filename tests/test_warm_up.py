"""`DecodeEngine.warm_up` on the CPU: the uncaptured warm-up keeps nothing and counts nothing; the capturing one
leaves the graphs of exactly the layout a prompt of that length has, so that prompt's prefill and steps replay.

tests/test_graph_manager.py's recording backend ("captures" by keeping the body, "replays" it on the entry's
buffers) runs the manager for real; CUDA graphs themselves are tests/gpu/test_gpu_first_prompt.py's.
"""

import torch

from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.sampling.sampler import initial_noise, pack
from tests.test_graph_manager import RecordingBackend


def _prompt(generator, engine, prompt):
    embeds = generator.encoder.encode(prompt)
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 8)], "cpu")
    latents = pack(initial_noise(0, 1, 64, 8, 8, torch.float32))
    t = torch.full((1,), 0.8)
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds.embeds, t, with_target=False)
        outcome = engine.decode_step(prefix, latents, t)
    prefix.release()
    return embeds.embeds.shape[1], outcome


def test_uncaptured_warm_up_keeps_no_entry_and_counts_nothing(tiny_models):
    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    done = engine.warm_up([(8, 8), (4, 16)], prompt_tokens=20)
    assert [(d["latent"], d["path"]) for d in done["sizes"]] == [([8, 8], "uncaptured"), ([4, 16], "uncaptured")]
    stats = engine.graphs.stats.snapshot()
    assert not engine.graphs.entries
    assert (stats["captures"], stats["replays"], stats["prefill_captures"], stats["eager_total"]) == (0, 0, 0, 0)


def test_capturing_warm_up_makes_a_prompt_of_that_length_replay_only(tiny_models, generator):
    engine = DecodeEngine(tiny_models.transformer, backend=RecordingBackend())
    tokens, _ = _prompt(generator, DecodeEngine(tiny_models.transformer, backend=RecordingBackend()), "a red cube")
    done = engine.warm_up([(8, 8)], prompt_tokens=tokens, capture=True)
    assert done["sizes"][0]["path"] == "capture"
    before = engine.graphs.stats.snapshot()
    assert (before["captures"], before["prefill_captures"]) == (1, 1)
    _, outcome = _prompt(generator, engine, "a red cube")
    after = engine.graphs.stats.delta(before)
    assert outcome.path == "replay" and after["captures"] == 0 and after["prefill_captures"] == 0
    assert after["prefill_replays"] == 1 and len(engine.graphs.entries) == 1
    _, other = _prompt(generator, engine, "a red cube on a table, photo")  # another length: its own capture
    assert other.path == "capture"


def test_warm_up_needs_cuda_for_cuda_graphs(tiny_models):
    """With the real graph backend and the model on the CPU there is nothing to set up."""
    assert "skipped" in DecodeEngine(tiny_models.transformer).warm_up([(8, 8)])
