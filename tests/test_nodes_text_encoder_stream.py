"""The loaders' text encoder placements `streamed by layer` and `auto` through the nodes (fake ComfyUI, CPU).

The fake's device is the CPU, where streaming moves nothing (`streams_here` is False: the encoder simply encodes
there); the tests that stream make the handle stream anyway, the CPU standing in for the GPU, so the node's whole
path runs: ComfyUI asked to free the streamed encode's bytes, the layers hooked for the encode and unhooked after,
the result the whole encoder's.
"""

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

from graph_runtime.text_encoder_layers import decoder_layers  # noqa: E402
from graph_runtime.memory import plan as plans  # noqa: E402

TE_FILE = "qwen3vl_8b_bf16.safetensors"
PROMPT, NEGATIVE = "a red cube on a blue sphere", "blurry"


def run(env, node_id, **inputs):
    return env.nodes[node_id].execute(**inputs).args


def load(env, placement):
    return run(env, "KVGraphLoadTextEncoder", text_encoder_name=TE_FILE, dtype="fp32",
               text_encoder_placement=placement)[0]


def encode(env, handle):
    return run(env, "KVGraphTextEncode", text_encoder=handle, prompt=PROMPT, negative_prompt=NEGATIVE, width=128,
               height=96, size_from_reference=True, reference_resolution=128)


def cond(outputs):
    return [c[0][0] for c in outputs[:2]]


def hooks(handle):
    return [(len(l._forward_pre_hooks), len(l._forward_hooks)) for l in decoder_layers(handle.module)]  # noqa: SLF001


@pytest.fixture
def whole(comfy_env):
    return cond(encode(comfy_env, load(comfy_env, "gpu while encoding, then offload")))


@pytest.fixture
def tokens(comfy_env):
    handle = load(comfy_env, "gpu while encoding, then offload")
    return max(handle.encoder.token_bound(p, []) for p in (PROMPT, NEGATIVE))


def test_streamed_by_layer_encodes_the_same_and_leaves_no_hook(comfy_env, monkeypatch, whole, tokens):
    """'streamed by layer': ComfyUI is asked for the streamed encode's bytes (outside part + two layers + activations,
    not the whole encoder), nothing loads the encoder whole, every layer is hooked during the encode, and the
    conditioning equals the whole encode's bit for bit (fp32, tolerance 0: only bytes move)."""
    handle = load(comfy_env, "streamed by layer")
    assert handle.placement == "streamed by layer"
    monkeypatch.setattr(handle, "streams_here", lambda: True)
    before = hooks(handle)
    during = []
    original = handle.encoder.encode

    def spy(*args, **kwargs):
        during.append(hooks(handle))
        return original(*args, **kwargs)

    monkeypatch.setattr(handle.encoder, "encode", spy)
    comfy_env.fake.free_calls.clear()
    comfy_env.fake.load_calls.clear()
    streamed = cond(encode(comfy_env, handle))
    for a, b in zip(whole, streamed):
        assert torch.equal(a, b)
    size = plans.TextEncoderSize.of(handle.module)
    assert comfy_env.fake.free_calls == [(size.gpu_bytes(plans.TE_STREAMED, tokens), handle.patcher.load_device)]
    assert not any(handle.patcher in c["models"] for c in comfy_env.fake.load_calls)
    assert during and all(h != before and all(pre >= 1 for pre, _ in h) for h in during)
    assert hooks(handle) == before and handle._stream is None  # noqa: SLF001


def test_streamed_by_layer_on_the_cpu_encodes_in_place(comfy_env, whole):
    """On a CPU device streaming would move nothing: the encoder encodes where it is, with no hook and no request
    to free memory, and the same result."""
    handle = load(comfy_env, "streamed by layer")
    comfy_env.fake.free_calls.clear()
    before = hooks(handle)
    out = cond(encode(comfy_env, handle))
    for a, b in zip(whole, out):
        assert torch.equal(a, b)
    assert comfy_env.fake.free_calls == [] and hooks(handle) == before


@pytest.mark.parametrize("room, expected", [("streamed", "streamed by layer"), ("whole", None), ("none", "cpu")])
def test_auto_follows_the_memory_plan(comfy_env, monkeypatch, caplog, tokens, room, expected):
    """'auto' (the default) runs the plan's placement for each encode: streamed by layer where ComfyUI can give the
    outside part + two layers + activations but not the whole encoder, offloaded after a whole load where the whole
    fits, the CPU where not even the streamed encode fits; the log says which."""
    handle = load(comfy_env, "auto")
    monkeypatch.setattr(handle, "streams_here", lambda: True)
    # The tiny encoder has two layers, so two in flight would be the whole of it: one in flight keeps the streamed
    # encode smaller than the whole one here.
    monkeypatch.setattr(plans, "TE_SLOTS", 1)
    # The fake's device is the CPU, where a whole encode leaves the encoder "loaded"; on a GPU it is offloaded after.
    monkeypatch.setattr(handle.patcher, "loaded_size", lambda: 0)
    size = plans.TextEncoderSize.of(handle.module)
    free = {"streamed": size.gpu_bytes(plans.TE_STREAMED, tokens), "whole": size.gpu_bytes(plans.TE_OFFLOAD, tokens),
            "none": size.gpu_bytes(plans.TE_STREAMED, tokens) - 1}[room]
    monkeypatch.setattr(comfy_env.fake, "free_memory", free)
    from importlib import import_module

    memory = import_module(f"{type(handle).__module__.rsplit('.', 1)[0]}.memory")
    memory._said.clear()  # noqa: SLF001
    placement, need = memory.encode_placement(handle, tokens)
    assert placement == (expected or "gpu while encoding, then offload")
    assert need == size.gpu_bytes(plans.TE_STREAMED, tokens)
    memory._said.clear()  # noqa: SLF001
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        comfy_env.fake.free_calls.clear()
        encode(comfy_env, handle)
    assert any(f"auto runs '{placement}'" in r.getMessage() for r in caplog.records)
    assert len(comfy_env.fake.free_calls) == (1 if room == "streamed" else 0)


def test_a_forced_placement_wins_and_the_log_says_what_the_plan_would_do(comfy_env, monkeypatch, caplog, tokens):
    """A placement chosen on the loader runs as set even where the plan would stream the encoder; the log says so
    once."""
    handle = load(comfy_env, "gpu while encoding, then offload")
    monkeypatch.setattr(handle, "streams_here", lambda: True)
    monkeypatch.setattr(plans, "TE_SLOTS", 1)  # as in test_auto_follows_the_memory_plan
    monkeypatch.setattr(handle.patcher, "loaded_size", lambda: 0)
    size = plans.TextEncoderSize.of(handle.module)
    monkeypatch.setattr(comfy_env.fake, "free_memory", size.gpu_bytes(plans.TE_STREAMED, tokens))
    from importlib import import_module

    memory = import_module(f"{type(handle).__module__.rsplit('.', 1)[0]}.memory")
    memory._said.clear()  # noqa: SLF001
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        assert memory.encode_placement(handle, tokens)[0] == "gpu while encoding, then offload"
        memory.encode_placement(handle, tokens)
    said = [r.getMessage() for r in caplog.records if "as set" in r.getMessage()]
    assert len(said) == 1 and "would run it 'streamed by layer'" in said[0]


def test_an_unknown_placement_is_refused_naming_the_choices(comfy_env):
    with pytest.raises(Exception, match="text_encoder_placement.*auto.*streamed by layer"):
        load(comfy_env, "streamed")


def test_an_encode_out_of_memory_names_the_placement_and_what_uses_less(comfy_env, monkeypatch):
    """An encode that runs out of device memory fails with an error naming the placement it ran and the placements
    that need less; the stream is stopped and the next encode runs."""
    handle = load(comfy_env, "streamed by layer")
    monkeypatch.setattr(handle, "streams_here", lambda: True)
    original = handle.encoder.encode

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(handle.encoder, "encode", oom)
    with pytest.raises(RuntimeError, match="placement 'streamed by layer'.*'cpu'"):
        encode(comfy_env, handle)
    assert handle._stream is None and handle.running is None  # noqa: SLF001
    monkeypatch.setattr(handle.encoder, "encode", original)
    assert cond(encode(comfy_env, handle))[0].shape[0] == 1
