"""Partial (lowvram) loads of the transformer on a real GPU: blocks streamed from pinned host memory, steps eager.

Run on the H100/H200: `python -m pytest -m gpu tests/gpu/test_gpu_lowvram.py`.

Models: the tiny architecture with six blocks in fp32 (the equality of the math), the same at widths where a block
is tens of MB in bf16 and with its blocks' Linears INT8 ConvRot (comfy-kitchen, group 256), so device memory can be
measured against a block's size; and the tiny model files through the nodes and the fake ComfyUI's lowvram figure.

Tolerances. A streamed step runs the same eager code on the same values at equally aligned addresses (the
streamer's device copies are 512-byte aligned, as the caching allocator's are), so it is expected to be bit-equal to
the whole model's eager step; the tests allow fp32 round-off on the fp32 model (1e-5 on values of magnitude ~1-5,
tests/gpu/test_gpu_decode.py; 5e-5 where core's Euler compares replayed steps with eager ones, as
tests/gpu/test_gpu_core_sampling.py does) and 2% of the largest latent on the bf16 and INT8 models (a few bf16 ulps
compounded over six steps), while one block computing with wrong or stale weights moves the random model's latents by tens of
percent. Device memory: allocations are exact byte counts rounded to 512 bytes per tensor, so 2 MiB of slack, far
below one block (13 MiB in INT8, 26 MiB in bf16 at these widths).
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_runtime.decode.eligibility import WEIGHTS_OFF_GPU, static_reason  # noqa: E402
from graph_runtime.encoding.prompt import PromptEmbeds  # noqa: E402
from graph_runtime.loaded import LoadedTransformer  # noqa: E402
from graph_runtime.memory import module_bytes  # noqa: E402
from graph_runtime.sampling.sampler import SamplingRequest, sample  # noqa: E402
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS = 6
RESIDENT = 2  # blocks the budget holds: the other four stream
LATENT = (8, 8)
PROMPT_TOKENS = 24
STEPS = 6
FP32_ATOL = 1e-5
CORE_ATOL = 5e-5  # core's Euler, graphs against eager steps (tests/gpu/test_gpu_core_sampling.py)
REL_8BIT = 2e-2
SLACK = 2 << 20
WIDE = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=LAYERS, attention_head_dim=128,
            num_attention_heads=8, context_in_dim=256, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
            causal_condition=True)


def _embeds(dim, dtype):
    g = torch.Generator("cuda").manual_seed(1)
    return PromptEmbeds(embeds=torch.randn(1, PROMPT_TOKENS, dim, device="cuda", generator=g, dtype=dtype),
                        image_mask=torch.zeros(1, PROMPT_TOKENS, dtype=torch.bool, device="cuda"))


def _request(embeds, seed, mode="auto"):
    return SamplingRequest(positive=embeds, latent_height=LATENT[0], latent_width=LATENT[1], seed=seed, steps=STEPS,
                           decode_mode=mode)


def _budget(model, blocks=RESIDENT):
    """Everything outside the blocks plus `blocks` blocks."""
    sizes = [module_bytes(b) for b in model.transformer_blocks]
    return module_bytes(model) - sum(sizes) + sum(sizes[:blocks])


def _assert_all_eager_for_weights_off_gpu(result):
    assert set(result.paths) == {"eager"}, result.paths
    assert result.stats["eager_steps"] == {WEIGHTS_OFF_GPU: len(result.paths)}
    assert result.stats["captures"] == 0 and result.stats["replays"] == 0
    assert result.stats.get("prefill_captures", 0) == 0 and result.stats.get("prefill_replays", 0) == 0


def _assert_host_holds_the_streamed_blocks(loaded, model):
    streamer = loaded.streamer
    streamed = list(model.transformer_blocks)[RESIDENT:]
    assert streamer.pinned and streamer.host_bytes >= sum(module_bytes(b) for b in streamed)
    for block in streamed:
        assert all(t.device.type == "cpu" and t.is_pinned() for t in (*block.parameters(), *block.buffers()))
    for block in list(model.transformer_blocks)[:RESIDENT]:
        assert all(t.is_cuda for t in block.parameters())
    assert model.img_in.weight.is_cuda and model.proj_out.weight.is_cuda


def _close(a, b, fp32: bool) -> tuple[bool, float]:
    diff = float((a.float() - b.float()).abs().max())
    limit = FP32_ATOL if fp32 else REL_8BIT * float(a.float().abs().max())
    return diff <= limit, diff


def test_streamed_fp32_steps_equal_the_whole_models_and_a_whole_load_replays_again(caplog):
    """Tiny fp32 model, two of six blocks resident: graphs captured while whole are dropped when it streams; every
    streamed step (two prompts) decodes eagerly, counted under WEIGHTS_OFF_GPU and logged once, with latents equal to
    the whole model's eager ones; the streamed blocks sit in pinned host memory. Loaded whole again, the next prompt
    captures and replays, with the latents of the first graph run."""
    torch.manual_seed(0)
    model = random_tiny_transformer({**TINY_TRANSFORMER, "num_layers": LAYERS}).to("cuda").requires_grad_(False)
    loaded = LoadedTransformer(model)
    engine = loaded.engine
    embeds = _embeds(TINY_TRANSFORMER["context_in_dim"], torch.float32)
    whole_eager = sample(engine, _request(embeds, 1, "eager"))
    graphs = sample(engine, _request(embeds, 1))
    assert graphs.paths[0] == "capture" and set(graphs.paths[1:]) == {"replay"}

    plan = loaded.plan_within(_budget(model))
    assert (plan.resident_blocks, plan.streamed_blocks) == (RESIDENT, LAYERS - RESIDENT)
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        assert loaded.load_streamed("cuda", plan) is True
        assert not engine.graphs.entries  # nothing captured over the whole model's addresses is left to replay
        assert static_reason(model) == WEIGHTS_OFF_GPU
        first = sample(engine, _request(embeds, 1))
        second = sample(engine, _request(embeds, 2))
    for result in (first, second):
        _assert_all_eager_for_weights_off_gpu(result)
    said = [r for r in caplog.records if WEIGHTS_OFF_GPU in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    ok, diff = _close(whole_eager.latents, first.latents, fp32=True)
    print(f"fp32 streamed vs whole eager: max diff {diff:.3g} (bit-equal: {diff == 0})")
    assert ok, diff
    _assert_host_holds_the_streamed_blocks(loaded, model)

    loaded.stop_streaming()
    model.to("cuda")
    assert static_reason(model) is None
    again = sample(engine, _request(embeds, 1))
    assert again.paths[0] == "capture" and set(again.paths[1:]) == {"replay"}, again.paths
    assert not again.stats["eager_steps"]
    assert (again.latents - graphs.latents).abs().max() <= FP32_ATOL
    engine.release()


def _wide(kind):
    from graph_runtime.quantized import int8_modules, quantize_linears_

    torch.manual_seed(0)
    model = random_tiny_transformer(WIDE).to("cuda", torch.bfloat16).requires_grad_(False)
    if kind == "int8":
        quantize_linears_(model, 256, lambda name, _: name.startswith("transformer_blocks."))
        assert len(int8_modules(model)) == 7 * LAYERS
    return model


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_device_memory_stays_within_the_budget_plus_one_block(kind):
    """bf16 and INT8 ConvRot blocks: loaded within a two-block budget, the device holds exactly the resident part;
    sampling adds at most one streamed block's copy and the activations a whole-model eager run needs; the latents
    equal the whole model's eager ones and every step is eager for WEIGHTS_OFF_GPU; the streamed blocks (int8
    weights and their fp32 scales too) sit in pinned host memory."""
    model = _wide(kind)
    loaded = LoadedTransformer(model)
    engine = loaded.engine
    embeds = _embeds(WIDE["context_in_dim"], torch.bfloat16)

    torch.cuda.synchronize()
    weights_on_device = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    whole = sample(engine, _request(embeds, 3, "eager"))
    activations = torch.cuda.max_memory_allocated() - weights_on_device

    plan = loaded.plan_within(_budget(model))
    model.to("cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    loaded.load_streamed("cuda", plan)
    held = torch.cuda.memory_allocated() - base
    assert plan.resident <= held <= plan.resident + SLACK, (held, plan)
    assert plan.largest_block > 4 * SLACK  # the bounds below tell a block apart from the slack

    torch.cuda.reset_peak_memory_stats()
    streamed = sample(engine, _request(embeds, 3))
    peak = torch.cuda.max_memory_allocated() - base
    print(f"{kind}: resident {plan.resident >> 20} MiB, block {plan.largest_block >> 20} MiB, activations "
          f"{activations >> 20} MiB, peak while streaming {peak >> 20} MiB")
    assert peak <= plan.resident + plan.largest_block + activations + SLACK
    _assert_all_eager_for_weights_off_gpu(streamed)
    ok, diff = _close(whole.latents, streamed.latents, fp32=False)
    print(f"{kind} streamed vs whole eager: max diff {diff:.3g} (bit-equal: {diff == 0})")
    assert ok, diff
    _assert_host_holds_the_streamed_blocks(loaded, model)
    loaded.stop_streaming()
    engine.release()


def test_core_sampling_through_comfyuis_partial_load():
    """The nodes' MODEL (tiny files, fp32) on CUDA with the fake ComfyUI: a figure of one of its two blocks makes the
    patcher stream the other; core's Euler then gives the whole load's latents with every step eager for
    WEIGHTS_OFF_GPU, ComfyUI is told the resident bytes, and a whole load after an unload replays graphs again."""
    from comfy_fake.env import close_env, make_env
    from test_nodes_core_model import core_sample, sigmas_node
    from test_nodes_execute import encode, load_all

    env = make_env(device="cuda")
    try:
        import comfy.model_management as mm

        handle, text_encoder, _ = load_all(env)
        positive, _, latent = encode(env, text_encoder)
        model = handle.model
        sigmas = sigmas_node(env, model, latent)
        mm.load_models_gpu([model])
        engine = handle.engine
        before = engine.stats.snapshot()
        whole = core_sample(env, model, positive, latent, sigmas, seed=5)
        assert engine.stats.delta(before)["replays"] == len(sigmas) - 1

        model.detach(unpatch_all=True)
        env.fake.weight_budget = _budget(handle.module, blocks=1)
        mm.load_models_gpu([model])
        plan = model.stream_plan()
        assert plan is not None and plan.streamed_blocks == 1
        assert model.loaded_size() == plan.resident <= env.fake.weight_budget and model.model.model_lowvram
        before = engine.stats.snapshot()
        partial = core_sample(env, model, positive, latent, sigmas, seed=5)
        stats = engine.stats.delta(before)
        assert stats["eager_steps"] == {WEIGHTS_OFF_GPU: len(sigmas) - 1} and stats["replays"] == 0
        assert (partial - whole).abs().max() <= CORE_ATOL
        assert all(p.is_pinned() for p in handle.module.transformer_blocks[1].parameters())

        model.detach(unpatch_all=True)
        env.fake.weight_budget = None
        mm.load_models_gpu([model])
        assert model.stream_plan() is None and all(p.is_cuda for p in handle.module.parameters())
        before = engine.stats.snapshot()
        core_sample(env, model, positive, latent, sigmas, seed=5)
        stats = engine.stats.delta(before)
        assert stats["eager_steps"] == {} and stats["replays"] == len(sigmas) - 1
    finally:
        env.fake.weight_budget = None
        close_env(env)
