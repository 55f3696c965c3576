"""The KV-Graph Step Cache node with the KV-Graph Sampler (CPU, the fake ComfyUI; no ComfyUI needed): the setting rides
on the transformer handle, the sampler skips steps with it and says so in its summary line, its `done` event and the
status route's statistics; bad settings and wrong inputs are refused by name."""

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_execute import encode, load_all, run, sampler  # noqa: E402


@pytest.fixture(scope="module")
def models(comfy_env):
    return load_all(comfy_env)


def test_the_sampler_skips_steps_and_reports_them(comfy_env, models, caplog):
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder, width=256, height=256)
    cached, = run(comfy_env, "KVGraphStepCache", model=transformer, reuse_threshold=1.0, start_percent=0.15,
                  end_percent=0.95)
    assert cached is not transformer and transformer.step_cache is None  # the input handle is left as it was
    assert cached.loaded is transformer.loaded  # the same loaded model: its graphs and engine are shared
    fake = comfy_env.fake
    fake.set_context("prompt-S", "7")
    fake.sent.clear()
    caplog.set_level(logging.INFO, logger="kvgraph")
    before = transformer.engine.stats.skipped_steps
    out = sampler(comfy_env, cached, positive, latent, steps=12)
    plain = sampler(comfy_env, transformer, positive, latent, steps=12)
    done = fake.events("done")[0]
    skipped = done["skipped_steps"]
    assert 0 < skipped < 12 and sum(done["eager_steps"].values()) == 12 - skipped
    assert transformer.engine.stats.skipped_steps - before == skipped
    summaries = [r.getMessage() for r in caplog.records if "ms/step" in r.getMessage()]
    assert summaries[0].endswith(f", skipped steps {skipped} (step cache)") and "skipped" not in summaries[1]
    assert (out["samples"] - plain["samples"]).abs().max() > 1e-3
    status = comfy_env.pack.nodes.comfyui.model_cache.status_payload()
    assert any(m.get("skipped_steps", 0) >= skipped for m in status["models"])


def test_a_lora_chained_after_the_cache_keeps_it(comfy_env, models):
    transformer, _, _ = models
    cached, = run(comfy_env, "KVGraphStepCache", model=transformer, reuse_threshold=0.3, start_percent=0.2,
                  end_percent=0.9)
    assert cached.with_lora(object()).step_cache == cached.step_cache


@pytest.mark.parametrize("inputs,name", [({"reuse_threshold": -1.0}, "reuse_threshold"),
                                         ({"start_percent": 0.9, "end_percent": 0.5}, "end_percent")])
def test_bad_settings_are_refused_by_name(comfy_env, models, inputs, name):
    settings = {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, **inputs}
    with pytest.raises(Exception, match=name) as caught:  # the pack's own InputError class (loaded under its name)
        run(comfy_env, "KVGraphStepCache", model=models[0], **settings)
    assert type(caught.value).__name__ == "InputError"


def test_a_transformer_on_several_gpus_is_refused_at_the_node(comfy_env, models):
    with pytest.raises(Exception, match="1 GPU") as caught:
        run(comfy_env, "KVGraphStepCache", model=models[0].with_gpus(2), reuse_threshold=0.2, start_percent=0.15,
            end_percent=0.95)
    assert type(caught.value).__name__ == "InputError"


def test_a_core_model_is_refused_with_what_to_use(comfy_env, models):
    _, core_model = run(comfy_env, "KVGraphLoadTransformer", transformer_name="qwen_image_2.1_bf16.safetensors",
                        dtype="fp32")
    with pytest.raises(Exception, match="EasyCache") as caught:
        run(comfy_env, "KVGraphStepCache", model=core_model, reuse_threshold=0.2, start_percent=0.15,
            end_percent=0.95)
    assert type(caught.value).__name__ == "InputError"


# -- core's DIFFUSION_MODEL wrappers on the MODEL (what core's EasyCache hooks), with the fake of core's stack -----------


def test_a_diffusion_model_wrapper_sees_the_input_and_a_skip_runs_no_transformer(comfy_env, models):
    """The MODEL's call goes through the DIFFUSION_MODEL wrappers as core's models do: a wrapper gets the model input
    (the latents in the model's dtype, [B, 64, h, w]) first and the transformer options last, and the prediction back
    from the executor. A call the wrapper answers itself (as EasyCache does for a skipped step) runs no transformer
    step, and the sampler's step without a model call counts as skipped."""
    import comfy.patcher_extension as ext
    from test_nodes_core_model import core_sample, sigmas_node

    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder)
    seen, last = [], {}

    def wrapper(executor, *args, **kwargs):
        x, options = args[0], args[-1]
        seen.append((tuple(x.shape), x.dtype, isinstance(options, dict) and "kvgraph_run" in options))
        if len(seen) % 2 == 0:  # every second call answered from the last one, as a step cache would
            return x + last["diff"]
        out = executor(*args, **kwargs)
        last["diff"] = out - x
        return out

    patched = transformer.model.clone()
    patched.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, "test", wrapper)
    engine = transformer.engine
    before = engine.stats.snapshot()
    sigmas = sigmas_node(comfy_env, transformer.model, latent, steps=4)
    core_sample(comfy_env, patched, positive, latent, sigmas, seed=3)
    delta = engine.stats.delta(before)
    assert seen == [((1, 64, 6, 8), torch.float32, True)] * 4
    assert delta["replays"] + sum(delta["eager_steps"].values()) == 2  # two of four calls reached the transformer
    assert delta["skipped_steps"] == 2
