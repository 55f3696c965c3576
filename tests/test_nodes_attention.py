"""The transformer loaders' `attention` input (CPU, with the fake ComfyUI pieces of tests/comfy_fake): optional (old
workflows get `auto`), carried on the handle and the MODEL rather than in the model cache's key (one loaded model for
every choice), `fp8` falling back on the CPU with its reason logged and in the status, and a change of it rebuilding
the decode step without loading the weights again."""

import asyncio
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_core_model import core_sample, sigmas_node  # noqa: E402
from test_nodes_execute import OFFLOAD, Request, encode, response_json, run, sampler  # noqa: E402

T_FILE, TE_FILE = "qwen_image_2.1_bf16.safetensors", "qwen3vl_8b_bf16.safetensors"
FP8_FALLBACK = "FP8 attention runs in bf16"


def _module(env, name):
    return importlib.import_module(f"{env.pack.__name__}.{name}")


def _load(env, **inputs):
    return run(env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32", **inputs)


@pytest.fixture(scope="module")
def prompt(comfy_env):
    text_encoder, = run(comfy_env, "KVGraphLoadTextEncoder", text_encoder_name=TE_FILE, dtype="fp32",
                        text_encoder_placement=OFFLOAD)
    positive, _, latent = encode(comfy_env, text_encoder)
    return positive, latent


def _status(env):
    return response_json(asyncio.run(env.fake.routes[("GET", "/kvgraph/status")](Request())))


def test_one_loaded_model_for_every_attention(comfy_env):
    """Without the input the handle is `auto` and its MODEL carries nothing; `fp8` gives the same loaded model (loaded
    once) with the choice on the handle and on the MODEL; the fingerprint follows the input; a bad value names it."""
    core_model = _module(comfy_env, "nodes.comfyui.core_model")
    cache = _module(comfy_env, "nodes.comfyui.model_cache")
    plain, plain_model = _load(comfy_env)
    fp8, fp8_model = _load(comfy_env, attention="fp8")
    assert plain.attention == "auto" and core_model.ATTENTION not in plain_model.attachments
    assert fp8.attention == "fp8" and fp8_model.attachments[core_model.ATTENTION] == "fp8"
    assert fp8.module is plain.module and fp8.loaded is plain.loaded and fp8_model.model is plain_model.model
    assert cache.load_count(plain.key) == 1
    node = comfy_env.nodes["KVGraphLoadTransformer"]
    assert node.fingerprint_inputs(T_FILE, "fp32") != node.fingerprint_inputs(T_FILE, "fp32", attention="fp8")
    with pytest.raises(Exception, match=r"attention='fp4' is invalid: expected one of auto") as raised:
        _load(comfy_env, attention="fp4")
    assert type(raised.value).__name__ == "InputError"


def test_attention_other_than_auto_is_refused_with_several_gpus(comfy_env):
    """Sequence-parallel ranks choose their kernel as auto does, so a loader asked for another with gpus above 1 is
    refused naming the input, before anything loads."""
    loaders = _module(comfy_env, "nodes.loaders")
    with pytest.raises(Exception, match=r"attention='fp8' is invalid: expected auto with gpus above 1"):
        loaders.check_attention_input("fp8", 2)
    assert loaders.check_attention_input("auto", 2) == "auto" and loaders.check_attention_input("fp8", 1) == "fp8"


def test_fp8_on_the_cpu_runs_auto_logged_and_reported_then_auto_again_reloads_nothing(comfy_env, prompt,
                                                                                       monkeypatch, caplog):
    """The KV-Graph Sampler on an `fp8` handle runs on the CPU: the step runs SDPA (what auto picks there), so the
    latents equal an `auto` run's exactly (the same kernel on the same weights); the fallback is logged once as a
    warning and counted, and the status (route and node) names the attention asked for, what ran and why. Back to
    `auto`, the model's engine is auto's again, with the file loaded once."""
    monkeypatch.setattr(_module(comfy_env, "graph_runtime.decode.attention"), "_logged", set())
    positive, latent = prompt
    cache = _module(comfy_env, "nodes.comfyui.model_cache")
    auto, _ = _load(comfy_env)
    fp8, _ = _load(comfy_env, attention="fp8")
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        got = sampler(comfy_env, fp8, positive, latent)["samples"]
    warned = [r for r in caplog.records if FP8_FALLBACK in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert fp8.loaded.attention == "fp8" and fp8.engine.step.attention.requested == "fp8"

    payload = _status(comfy_env)
    record = next(m for m in payload["models"] if m["engine_id"] == f"{id(fp8.engine):x}")
    assert record["attention_requested"] == "fp8" and set(record["attention"].values()) == {"sdpa"}
    assert any(reason.startswith(FP8_FALLBACK) for reason in record["attention_fallbacks"]), record
    assert next(m for m in payload["loaded"] if m["kind"] == "transformer")["attention"] == "fp8"
    report, _ = run(comfy_env, "KVGraphCacheStatus")
    assert "attention: fp8, runs sdpa on cpu" in report and f"fallbacks: {FP8_FALLBACK}" in report

    want = sampler(comfy_env, auto, positive, latent)["samples"]
    assert torch.equal(got, want)
    assert auto.loaded.attention == "auto" and auto.engine.step.attention.requested == "auto"
    assert cache.load_count(auto.key) == 1


def test_core_samplers_on_the_fp8_model_decode_with_its_attention(comfy_env, prompt):
    """Core's sampling on the loader's MODEL with `attention` fp8 opens its run on the fp8 engine (its steps are
    counted there), and the plain MODEL's next run goes back to auto's engine."""
    positive, latent = prompt
    auto, auto_model = _load(comfy_env)
    fp8, fp8_model = _load(comfy_env, attention="fp8")
    sigmas = sigmas_node(comfy_env, fp8_model, latent)
    core_sample(comfy_env, fp8_model, positive, latent, sigmas, seed=3)
    engine = fp8.loaded.engine
    assert engine.step.attention.requested == "fp8" and engine.stats.eager_total >= len(sigmas) - 1
    core_sample(comfy_env, auto_model, positive, latent, sigmas, seed=3)
    assert auto.loaded.engine.step.attention.requested == "auto" and auto.loaded.engine is not engine
