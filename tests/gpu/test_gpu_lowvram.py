"""Partial (lowvram) loads of the transformer on a real GPU: blocks streamed from pinned host memory through fixed
device slots, the uploads captured with each decode step, which then replays like a whole model's.

Run on the H100/H200: `python -m pytest -m gpu tests/gpu/test_gpu_lowvram.py`.

Models: the tiny architecture with six blocks in fp32 (the equality of the math), the same at widths where a block
is tens of MB in bf16 and with its blocks' Linears INT8 ConvRot (comfy-kitchen, group 256), so device memory can be
measured against a block's size; and the tiny model files through the nodes and the fake ComfyUI's lowvram figure.

Tolerances. A streamed step runs the same kernels on the same values at equally aligned addresses (a slot comes from
the caching allocator and every tensor in it sits at a 512-byte offset, as separate allocations do), so the fp32
replayed step must equal the whole model's replayed step bit for bit; the bf16 and INT8 models are allowed 2% of the
largest latent (a few bf16 ulps compounded over six steps, should a kernel pick another algorithm), while one block
computing with wrong or stale weights moves the random model's latents by tens of percent. Where core's Euler
compares runs through the nodes, 5e-5 (tests/gpu/test_gpu_core_sampling.py). Device memory: allocations are exact
byte counts rounded to 512 bytes per tensor, so 2 MiB of slack, far below one block (13 MiB in INT8, 26 MiB in bf16
at these widths).
"""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_runtime.decode.eligibility import static_reason  # noqa: E402
from graph_runtime.encoding.prompt import PromptEmbeds  # noqa: E402
from graph_runtime.loaded import LoadedTransformer  # noqa: E402
from graph_runtime.memory import module_bytes  # noqa: E402
from graph_runtime.sampling.sampler import SamplingRequest, sample  # noqa: E402
from graph_runtime.streaming import plan_with, streamed_indices  # noqa: E402
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS = 6
RESIDENT = 2  # blocks the plan keeps: the other four stream
LATENT = (8, 8)
PROMPT_TOKENS = 24
STEPS = 6
CORE_ATOL = 5e-5  # core's Euler, graphs against graphs through the nodes (tests/gpu/test_gpu_core_sampling.py)
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


def _assert_replayed(result, captures: int):
    """Every decode step of `result` replayed (its first one captured when `captures`), none eager."""
    assert result.stats["eager_steps"] == {}, result.stats["eager_steps"]
    assert result.stats["captures"] == captures, result.stats
    assert result.paths[0] == ("capture" if captures else "replay") and set(result.paths[1:]) == {"replay"}


def _assert_slots_hold_the_streamed_blocks(loaded, model, resident=RESIDENT):
    streamer = loaded.streamer
    slots = streamer.slots
    assert streamer.pinned and slots is not None and slots.graph_reason is None
    blocks = list(model.transformer_blocks)
    streamed = streamed_indices(len(blocks), len(blocks) - resident)
    for position, block in enumerate(blocks[i] for i in streamed):
        slot = slots.slots[position % slots.slot_count]
        for t in (*block.parameters(), *block.buffers()):
            assert t.is_cuda and slot.data_ptr() <= t.data_ptr() < slot.data_ptr() + slot.numel()
    assert model.img_in.weight.is_cuda and model.proj_out.weight.is_cuda




def _close(a, b) -> tuple[bool, float]:
    diff = float((a.float() - b.float()).abs().max())
    return diff <= REL_8BIT * float(a.float().abs().max()), diff


@pytest.mark.parametrize("slots", [2, 3])
def test_streamed_fp32_steps_replay_and_equal_the_whole_models(caplog, slots):
    """Tiny fp32 model, two of six blocks resident, 2 or 3 slots: graphs captured while whole are dropped when it
    streams; the streamed model passes the graph checks, its first prompt captures the streamed step once (keyed
    apart from the whole one) and replays it, a second queued prompt with the same shapes captures nothing, and the
    latents equal the whole model's replayed ones bit for bit. Loaded whole again, it captures anew."""
    torch.manual_seed(0)
    model = random_tiny_transformer({**TINY_TRANSFORMER, "num_layers": LAYERS}).to("cuda").requires_grad_(False)
    loaded = LoadedTransformer(model)
    engine = loaded.engine
    embeds = _embeds(TINY_TRANSFORMER["context_in_dim"], torch.float32)
    whole = sample(engine, _request(embeds, 1))
    _assert_replayed(whole, captures=1)
    whole_key = next(iter(engine.graphs.entries))

    plan = plan_with(model, RESIDENT, slots)
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        assert loaded.load_streamed("cuda", plan) is True
    assert not engine.graphs.entries  # nothing captured over the whole model's addresses is left to replay
    assert static_reason(model) is None
    _assert_slots_hold_the_streamed_blocks(loaded, model)
    first = sample(engine, _request(embeds, 1))
    second = sample(engine, _request(embeds, 2))
    _assert_replayed(first, captures=1)
    _assert_replayed(second, captures=0)
    key = next(iter(engine.graphs.entries))
    assert key.streaming == (streamed_indices(LAYERS, LAYERS - RESIDENT), slots) and key != whole_key
    diff = float((whole.latents - first.latents).abs().max())
    print(f"fp32 streamed replay ({slots} slots) vs whole replay: max diff {diff:.3g}")
    assert diff == 0

    loaded.stop_streaming("cuda")
    assert all(p.is_cuda for p in model.parameters()) and static_reason(model) is None
    again = sample(engine, _request(embeds, 1))
    _assert_replayed(again, captures=1)
    assert next(iter(engine.graphs.entries)).streaming == ()
    assert torch.equal(again.latents, whole.latents)
    engine.release()


def test_unpinned_host_copies_stream_eagerly_with_the_reason_counted(caplog):
    """Where the host copies are not page-locked (pinning refused; here not asked for), the slots are filled
    synchronously and every step decodes eagerly, counted under the unpinned reason and logged once; the latents
    equal the whole model's eager ones (same kernels on equally aligned weights: fp32 round-off at most, 1e-5 on
    values of magnitude ~1-5, as tests/gpu/test_gpu_decode.py)."""
    from graph_runtime.decode import DecodeEngine
    from graph_runtime.stream_slots import UNPINNED
    from graph_runtime.streaming import BlockStreamer

    torch.manual_seed(0)
    model = random_tiny_transformer({**TINY_TRANSFORMER, "num_layers": LAYERS}).to("cuda").requires_grad_(False)
    embeds = _embeds(TINY_TRANSFORMER["context_in_dim"], torch.float32)
    whole = sample(DecodeEngine(model), _request(embeds, 1, "eager"))
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        streamer = BlockStreamer(model, "cuda", plan_with(model, RESIDENT, 2), pin=False).start()
        assert not streamer.pinned and streamer.graph_reason == UNPINNED
        engine = DecodeEngine(model)
        results = [sample(engine, _request(embeds, seed)) for seed in (1, 2)]
    for result in results:
        assert set(result.paths) == {"eager"} and result.stats["eager_steps"] == {UNPINNED: len(result.paths)}
    said = [r for r in caplog.records if r.getMessage() == f"KV-Graph: decoding eagerly: {UNPINNED}."]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert float((results[0].latents - whole.latents).abs().max()) <= 1e-5
    streamer.stop()


def test_a_lora_merged_after_capture_is_what_the_streamed_replays_compute(tmp_path):
    """Tiny fp32 model, both blocks streamed through two slots: a prompt captures the streamed step; a LoRA merged
    afterwards goes into the host copies (computed on the GPU, copied back), and the next prompt replays the same
    graph (no capture) with latents bit-equal to the whole model's with the same LoRA (the same fp32 sums on the
    same device); merging none restores the first latents exactly."""
    from graph_runtime.lora.file import read_lora
    from graph_runtime.lora.merge import LoraChoice
    from graph_runtime.lora.tiny import write_tiny_lora

    torch.manual_seed(0)
    whole_model = random_tiny_transformer(TINY_TRANSFORMER).to("cuda").requires_grad_(False)
    streamed_model = random_tiny_transformer(TINY_TRANSFORMER).to("cuda").requires_grad_(False)
    streamed_model.load_state_dict(whole_model.state_dict())
    lora = read_lora(write_tiny_lora(tmp_path / "lora.safetensors", dtype=torch.float32), whole_model)
    embeds = _embeds(TINY_TRANSFORMER["context_in_dim"], torch.float32)
    whole = LoadedTransformer(whole_model)
    whole.lora_state().apply([LoraChoice(lora, 0.8)])
    expected = sample(whole.engine, _request(embeds, 1))

    loaded = LoadedTransformer(streamed_model)
    loaded.load_streamed("cuda", plan_with(streamed_model, 0, 2))
    plain = sample(loaded.engine, _request(embeds, 1))
    _assert_replayed(plain, captures=1)
    assert loaded.lora_state().apply([LoraChoice(lora, 0.8)]) is True
    merged = sample(loaded.engine, _request(embeds, 1))
    _assert_replayed(merged, captures=0)
    assert not torch.equal(merged.latents, plain.latents)
    assert torch.equal(merged.latents, expected.latents)
    loaded.lora_state().apply([])
    restored = sample(loaded.engine, _request(embeds, 1))
    _assert_replayed(restored, captures=0)
    assert torch.equal(restored.latents, plain.latents)
    loaded.stop_streaming()


def _wide(kind):
    from graph_runtime.quantized import int8_modules, quantize_linears_

    torch.manual_seed(0)
    model = random_tiny_transformer(WIDE).to("cuda", torch.bfloat16).requires_grad_(False)
    if kind == "int8":
        quantize_linears_(model, 256, lambda name, _: name.startswith("transformer_blocks."))
        assert len(int8_modules(model)) == 7 * LAYERS
    return model


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_device_memory_stays_within_the_plan(kind):
    """bf16 and INT8 ConvRot blocks: under a two-resident-block plan the device holds the resident part and the two
    slots; sampling with graphs adds at most what a whole-model graph run adds (static buffers, pool,
    activations); every step replays and the latents match the whole model's replayed ones; the int8 weights and
    their fp32 scales sit in the slots."""
    model = _wide(kind)
    loaded = LoadedTransformer(model)
    engine = loaded.engine
    embeds = _embeds(WIDE["context_in_dim"], torch.bfloat16)

    torch.cuda.synchronize()
    weights_on_device = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    whole = sample(engine, _request(embeds, 3))
    run_bytes = torch.cuda.max_memory_allocated() - weights_on_device
    engine.release()

    plan = plan_with(model, RESIDENT, 2)
    model.to("cpu")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    loaded.load_streamed("cuda", plan)
    held = torch.cuda.memory_allocated() - base
    # Each slot is a separate allocation, rounded up by the allocator: one SLACK per slot beyond the plan's bytes.
    assert plan.device_bytes <= held <= plan.device_bytes + 2 * SLACK, (held, plan)
    assert plan.largest_block > 4 * SLACK  # the bounds below tell a block apart from the slack

    torch.cuda.reset_peak_memory_stats()
    streamed = sample(engine, _request(embeds, 3))
    peak = torch.cuda.max_memory_allocated() - base
    print(f"{kind}: resident {plan.resident >> 20} MiB, slots {plan.buffer_bytes >> 20} MiB, whole-run additions "
          f"{run_bytes >> 20} MiB, peak while streaming {peak >> 20} MiB")
    assert peak <= plan.device_bytes + run_bytes + SLACK
    _assert_replayed(streamed, captures=1)
    _assert_slots_hold_the_streamed_blocks(loaded, model)
    ok, diff = _close(whole.latents, streamed.latents)
    print(f"{kind} streamed replay vs whole replay: max diff {diff:.3g} (bit-equal: {diff == 0})")
    assert ok, diff
    loaded.stop_streaming()
    engine.release()


def test_switching_plans_leaks_no_device_memory():
    """A bigger budget re-plans (four resident blocks instead of two) and a freed card loads whole: each switch
    releases the graphs captured over the old slots, and once whole with its graphs released the device holds what
    the whole model held before it ever streamed (torch.cuda.memory_allocated back to that baseline)."""
    model = _wide("bf16")
    loaded = LoadedTransformer(model)
    engine = loaded.engine
    embeds = _embeds(WIDE["context_in_dim"], torch.bfloat16)
    # A whole run first: what every run of the model keeps (its RoPE tables and layouts, cached per model) exists
    # before the baseline, so the baseline measures what streaming leaves behind.
    _assert_replayed(sample(engine, _request(embeds, 4)), captures=1)
    engine.release()
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for resident in (RESIDENT, 4):
        plan = plan_with(model, resident, 2)
        loaded.load_streamed("cuda", plan)
        _assert_slots_hold_the_streamed_blocks(loaded, model, resident)
        _assert_replayed(sample(engine, _request(embeds, 4)), captures=1)
        assert len(engine.graphs.entries) == 1
    loaded.stop_streaming("cuda")
    assert not engine.graphs.entries
    whole = sample(engine, _request(embeds, 4))
    _assert_replayed(whole, captures=1)
    engine.release()
    gc.collect()
    torch.cuda.synchronize()
    leaked = torch.cuda.memory_allocated() - baseline
    print(f"after streaming with two plans and loading whole: {leaked} bytes beyond the baseline")
    assert abs(leaked) <= SLACK


def test_core_sampling_through_comfyuis_partial_load():
    """The nodes' MODEL (tiny files, fp32) on CUDA with the fake ComfyUI: a figure short of its two blocks makes the
    patcher stream both through two slots; core's Euler then gives the whole load's latents with every step replayed,
    ComfyUI is told the resident bytes and the slots, and a whole load after an unload captures anew."""
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
        assert plan is not None and plan.streamed_blocks == 2 and plan.slots == 2
        assert model.loaded_size() == plan.resident and model.model.model_lowvram
        assert model.model.model_offload_buffer_memory >= plan.buffer_bytes
        before = engine.stats.snapshot()
        partial = core_sample(env, model, positive, latent, sigmas, seed=5)
        stats = engine.stats.delta(before)
        assert stats["eager_steps"] == {} and stats["captures"] == 1 and stats["replays"] == len(sigmas) - 1
        assert (partial - whole).abs().max() <= CORE_ATOL
        assert all(p.is_cuda for p in handle.module.transformer_blocks[1].parameters())

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
