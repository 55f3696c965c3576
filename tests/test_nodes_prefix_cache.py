"""The KV-Graph Prefix Cache node with the KV-Graph Sampler (CPU, the fake ComfyUI; no ComfyUI needed): the placement
rides on the transformer handle, the sampler's prefill uses it, and the status route and the `done` event say which
was used; a bad choice is refused by name."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_execute import encode, load_all, run, sampler  # noqa: E402


@pytest.fixture(scope="module")
def models(comfy_env):
    return load_all(comfy_env)


def test_the_sampler_keeps_the_prefix_where_the_node_says(comfy_env, models):
    """A host prefix gives the default (gpu) prefix's latents exactly (CPU fp32: the same values, moved), and the
    `done` event and the status route count the prefill under its placement; the input handle is left as it was."""
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder, width=256, height=256)
    placed, = run(comfy_env, "KVGraphPrefixCache", model=transformer, placement="host")
    assert placed is not transformer and transformer.prefix_placement == "auto"
    assert placed.loaded is transformer.loaded and placed.prefix_placement == "host"
    fake = comfy_env.fake
    fake.set_context("prompt-P", "3")
    fake.sent.clear()
    before = dict(transformer.engine.stats.prefix_placements)
    out = sampler(comfy_env, placed, positive, latent, steps=3)
    assert fake.events("done")[0]["prefix_placements"] == {"host": 1}
    plain = sampler(comfy_env, transformer, positive, latent, steps=3)
    assert (out["samples"] == plain["samples"]).all()
    counts = transformer.engine.stats.prefix_placements
    assert counts["host"] - before.get("host", 0) == 1
    status = comfy_env.pack.nodes.comfyui.model_cache.status_payload()
    assert any(m.get("prefix_placements", {}).get("host", 0) >= 1 for m in status["models"])


def test_recompute_is_said_and_counted(comfy_env, models):
    """No prefix cache: every step is eager under its own reason, which the `done` event carries."""
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder, width=256, height=256)
    placed, = run(comfy_env, "KVGraphPrefixCache", model=transformer, placement="recompute")
    fake = comfy_env.fake
    fake.set_context("prompt-R", "3")
    fake.sent.clear()
    sampler(comfy_env, placed, positive, latent, steps=2)
    done = fake.events("done")[0]
    assert done["prefix_placements"] == {"recompute": 1}
    assert sum(n for reason, n in done["eager_steps"].items() if "recompute" in reason) == 2


def test_a_bad_placement_is_refused_by_name(comfy_env, models):
    with pytest.raises(Exception, match="placement.*auto, gpu, int8, host, recompute"):
        run(comfy_env, "KVGraphPrefixCache", model=models[0], placement="cpu")
    with pytest.raises(Exception, match="model"):
        run(comfy_env, "KVGraphPrefixCache", model="not a model", placement="gpu")
