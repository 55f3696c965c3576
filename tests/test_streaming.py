"""The block streamer of a partial load (graph_runtime/streaming.py), on CPU: its plan, its bookkeeping, and that every
way the blocks run (the decode step, the prefix pass, diffusers' own block forward) sees each streamed block's
weights on the "device" while it runs and only then.

On CPU the "device" is the CPU too: a streamed block's weights are copied into a fresh buffer before it runs and the
tensors point back at the host copy after, which the tests observe through the weights' addresses. The same values go
through the same CPU kernels, so the outputs equal the unstreamed model's up to the vectorized reductions' order on
differently aligned buffers: 1e-6 on values of magnitude ~1 (fp32 round-off), far below what one block computing with
wrong or stale weights changes (tens of percent).
"""

import copy

import pytest
import torch

from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.decode.prefill import run_prefill
from graph_runtime.loaded import LoadedTransformer
from graph_runtime.memory import module_bytes
from graph_runtime.placement import block_on_device
from graph_runtime.streaming import BlockStreamer, plan_stream, plan_with, streamed_indices
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer

ATOL = 1e-6
LAYERS = 5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_tiny_transformer({**TINY_TRANSFORMER, "num_layers": LAYERS}).requires_grad_(False)


def _sizes(model):
    blocks = [module_bytes(b) for b in model.transformer_blocks]
    return module_bytes(model) - sum(blocks), blocks


def test_plan_keeps_what_fits_and_always_the_rest_of_the_model(model):
    """The plan keeps everything outside the blocks plus as many leading blocks as the budget holds beside the
    slots the streamed blocks take turns in (two by default; the eager way: one block's copy); a budget of the whole
    model (or more) is no plan (a whole load); a budget below even the non-block part keeps that part anyway and
    says so in `resident`."""
    outside, blocks = _sizes(model)
    total = module_bytes(model)
    assert plan_stream(model, total) is None and plan_stream(model, 1e32) is None
    budget = outside + 4 * blocks[0] + blocks[0] // 2
    plan = plan_stream(model, budget)
    assert (plan.resident_blocks, plan.streamed_blocks, plan.blocks, plan.slots) == (2, LAYERS - 2, LAYERS, 2)
    assert plan.resident == outside + 2 * blocks[0] and plan.total == total and plan.largest_block == blocks[0]
    assert plan.device_bytes == outside + 4 * blocks[0] <= plan.budget
    eager = plan_stream(model, budget, slots=0)
    assert (eager.resident_blocks, eager.buffer_bytes) == (3, blocks[0])
    assert plan_stream(model, budget, slots=3).resident_blocks == 1
    tiny = plan_stream(model, 0.1)
    assert tiny.resident_blocks == 0 and tiny.resident == outside > tiny.budget
    text = plan.describe()
    assert f"{LAYERS - 2} of {LAYERS} blocks stream from the host every step through 2 device slots" in text
    assert "eagerly" in eager.describe()
    with pytest.raises(ValueError, match="stream slots 5 is invalid"):
        plan_stream(model, budget, slots=5)


def test_a_plan_for_a_given_number_of_resident_blocks(model):
    """`plan_with` takes the resident-block count a planner decided: every block resident is no plan, a count out of
    range is refused naming it, and one streamed block needs one slot only."""
    outside, blocks = _sizes(model)
    assert plan_with(model, LAYERS) is None
    plan = plan_with(model, LAYERS - 1, slots=3)
    assert plan.streamed_blocks == 1 and plan.buffer_bytes == blocks[-1]
    assert plan.budget == plan.device_bytes == outside + LAYERS * blocks[0]
    with pytest.raises(ValueError, match="resident_blocks 7 is out of range"):
        plan_with(model, 7)


def _layout_and_inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    text_tokens, h, w = 6, 4, 4
    embeds = torch.randn(1, text_tokens, model.config.context_in_dim, generator=g)
    image_mask = torch.zeros(1, text_tokens, dtype=torch.bool)
    layout = TokenLayout.build(image_mask, [(1, h, w)], "cpu")
    latents = torch.randn(1, h * w, model.config.in_channels, generator=g)
    return layout, embeds, latents


def _generate(engine, layout, embeds, latents, with_target=False):
    """Step 1 (the prefill, as the sampler runs it or as diffusers' joint forward) and two decode steps."""
    t = torch.tensor([0.9])
    with torch.no_grad():
        first, prefix = engine.prefill(layout, latents, embeds, t, with_target=with_target)
        outs = [] if first is None else [first]
        for step_t in (0.9, 0.6):
            outs.append(engine.decode_step(prefix, latents, torch.tensor([step_t])).output)
    return outs


@pytest.mark.parametrize("with_target", [False, True], ids=["prefix-pass", "joint-pass"])
def test_streamed_steps_equal_the_whole_models(model, with_target):
    """With two of five blocks resident, the prefill (the prefix pass over the decode step's wrappers, or diffusers'
    joint forward over the blocks themselves) and the decode steps give the unstreamed model's outputs; after `stop`
    the model is as before: no hooks, every weight on the host, at the address the streamer left it."""
    whole = copy.deepcopy(model)
    streamed = copy.deepcopy(model)
    inputs = _layout_and_inputs(model)
    expected = _generate(DecodeEngine(whole), *inputs, with_target=with_target)
    outside, blocks = _sizes(streamed)
    plan = plan_with(streamed, 2, slots=0)
    streamer = BlockStreamer(streamed, "cpu", plan).start()
    assert streamer.active and not streamer.pinned  # CPU: an ordinary host copy
    # Every streamed block's first Linear, each time it runs: True when it reads the device copy, not the host's.
    visits = {i: [] for i in plan.streamed}
    for i in visits:
        to_q = streamed.transformer_blocks[i].attn.to_q
        host = to_q.weight.data_ptr()
        to_q.register_forward_pre_hook(
            lambda mod, args, i=i, host=host: visits[i].append(mod.weight.data_ptr() != host))
    got = _generate(DecodeEngine(streamed), *inputs, with_target=with_target)
    assert all(v == [True] * 3 for v in visits.values()), visits  # the prefill and two decode steps, each streamed
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    streamer.stop()
    assert not streamer.active
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in streamed.transformer_blocks)


def test_a_streamed_block_has_its_weights_on_the_device_only_while_it_runs(model):
    """Inside a streamed block (its own forward, or `block_on_device` around a wrapper) the weights sit in a device
    copy; after it, again exactly at their host copy, also when the block raised. A resident block is never moved."""
    m = copy.deepcopy(model)
    outside, blocks = _sizes(m)
    plan = plan_with(m, 1, slots=0)
    streamer = BlockStreamer(m, "cpu", plan).start()
    kept = next(i for i in range(LAYERS) if i not in plan.streamed)
    resident, streamed = m.transformer_blocks[kept], m.transformer_blocks[plan.streamed[0]]
    host = streamed.attn.to_q.weight.data_ptr()
    seen = []
    streamed.attn.to_q.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.data_ptr()))
    with block_on_device(streamed):
        inside = streamed.attn.to_q.weight.data_ptr()
        with block_on_device(streamed):  # entered again inside its own run: nothing moves
            assert streamed.attn.to_q.weight.data_ptr() == inside
        assert streamed.attn.to_q.weight.data_ptr() == inside
    assert inside != host and streamed.attn.to_q.weight.data_ptr() == host
    resident_ptr = resident.attn.to_q.weight.data_ptr()
    with block_on_device(resident):
        assert resident.attn.to_q.weight.data_ptr() == resident_ptr
    with pytest.raises(ZeroDivisionError):
        with block_on_device(streamed):
            1 / 0
    assert streamed.attn.to_q.weight.data_ptr() == host
    with pytest.raises(TypeError):
        streamed()  # diffusers' forward, missing its arguments: the post-hook still drops the device copy
    assert streamed.attn.to_q.weight.data_ptr() == host
    streamer.stop()


def test_the_owner_keeps_one_streamer_per_plan_and_says_when_a_plan_is_new(model):
    """`LoadedTransformer.load_streamed` keeps a streamer whose resident blocks match (a figure a few bytes off from
    the last prompt's moves nothing), reports each resident-block count the first time only, drops captured graphs
    when it (re)streams, and `stop_streaming` ends it."""
    m = copy.deepcopy(model)
    loaded = LoadedTransformer(m)
    outside, blocks = _sizes(m)
    plan = loaded.plan_within(outside + 4 * blocks[0])
    assert plan.resident_blocks == 2
    assert loaded.load_streamed("cpu", plan) is True
    streamer = loaded.streamer
    assert loaded.load_streamed("cpu", loaded.plan_within(outside + 4 * blocks[0] + 100)) is False
    assert loaded.streamer is streamer and loaded.streaming == plan
    assert loaded.load_streamed("cpu", loaded.plan_within(outside + 3 * blocks[0])) is True
    assert loaded.streamer is not streamer and not streamer.active
    assert loaded.load_streamed("cpu", plan) is False  # a plan seen before: already said once
    loaded.stop_streaming()
    assert loaded.streaming is None and loaded.streamer is None
    assert all(not b._forward_pre_hooks for b in m.transformer_blocks)


def test_streamed_blocks_are_spread_over_the_step_and_end_with_the_last():
    """`streamed_indices` picks as many blocks as asked, distinct and in order, spread evenly (no two streamed blocks
    in a row while a resident one could sit between them) with the last block among them; a plan's streamed blocks
    are those, and the others stay on the device."""
    assert streamed_indices(32, 0) == ()
    assert streamed_indices(32, 32) == tuple(range(32))
    for blocks in (5, 32, 60):
        for count in range(1, blocks + 1):
            chosen = streamed_indices(blocks, count)
            assert len(set(chosen)) == count and list(chosen) == sorted(chosen) and chosen[-1] == blocks - 1
            if 2 * count <= blocks:
                assert all(b - a >= 2 for a, b in zip(chosen, chosen[1:]))
    with pytest.raises(ValueError, match="out of range"):
        streamed_indices(4, 5)
    torch.manual_seed(0)
    model = random_tiny_transformer({**TINY_TRANSFORMER, "num_layers": LAYERS}).requires_grad_(False)
    plan = plan_with(model, 2, slots=2)
    assert plan.streamed == streamed_indices(LAYERS, LAYERS - 2)
    streamer = BlockStreamer(model, "cpu", plan).start()
    try:
        assert sorted(streamer.slots.order) == list(plan.streamed)
    finally:
        streamer.stop()
