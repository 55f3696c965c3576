"""Streamed blocks in fixed device slots (graph_runtime/stream_slots.py), on CPU.

On CPU the "device" is the CPU too and there is no copy stream: a pass copies each streamed block into its slot on
the compute stream at the same points of the schedule a CUDA pass queues them (the first block of each slot before
the step, the next one after its slot's previous block ran), so a block that found another block's weights in its
slot would compute a visibly different step. The slot buffers are packed byte for byte from the same values and the
same CPU kernels run on them, so the streamed outputs must equal the whole model's exactly (no tolerance). Slot views are checked by address.
"""

import copy
import gc
import weakref

import pytest
import torch

from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.decode import eligibility as why
from graph_runtime.loaded import LoadedTransformer
from graph_runtime.lora.file import read_lora
from graph_runtime.lora.merge import LoraChoice, LoraMerge
from graph_runtime.lora.tiny import write_tiny_lora
from graph_runtime.placement import ALIGNMENT, block_on_device
from graph_runtime.stream_slots import streamer_of
from graph_runtime.streaming import BlockStreamer, plan_with, streamed_indices
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer

LAYERS = 5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_tiny_transformer({**TINY_TRANSFORMER, "num_layers": LAYERS}).requires_grad_(False)


def _inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, 6, model.config.context_in_dim, generator=g)
    layout = TokenLayout.build(torch.zeros(1, 6, dtype=torch.bool), [(1, 4, 4)], "cpu")
    latents = torch.randn(1, 16, model.config.in_channels, generator=g)
    return layout, embeds, latents


def _generate(engine, layout, embeds, latents, with_target=False):
    """Step 1 (the prefix pass, or diffusers' joint forward) and two decode steps, with their paths."""
    with torch.no_grad():
        first, prefix = engine.prefill(layout, latents, embeds, torch.tensor([0.9]), with_target=with_target)
        outs, paths = ([] if first is None else [first]), []
        for t in (0.9, 0.6):
            outcome = engine.decode_step(prefix, latents, torch.tensor([t]))
            outs.append(outcome.output)
            paths.append(outcome.path)
    return outs, paths


class _Recording:
    """Captures by keeping the step body and replays by running it on the entry's static inputs (the policy runs
    on CPU); judges the model by its blocks' hooks and streamer as the CUDA backend does after its device checks."""

    name = "recording"

    def unavailable_reason(self, transformer, params=None):
        return why.block_hooks_reason(transformer)

    def capture(self, entry, body):
        entry.graph, entry.output = body, body(entry.inputs)
        entry.captures += 1

    def replay(self, entry):
        out = entry.graph(entry.inputs)
        return None if out is None else out.clone()


def _capturable(streamer: BlockStreamer) -> BlockStreamer:
    # On CPU a slot streamer cannot be captured (no copy stream); the recording backend judges the rest.
    streamer.slots.graph_reason = None
    return streamer


@pytest.mark.parametrize("resident,slots", [(1, 2), (2, 2), (1, 3), (2, 3)])
@pytest.mark.parametrize("with_target", [False, True], ids=["prefix-pass", "joint-pass"])
def test_a_streamed_step_equals_the_whole_models_bit_for_bit(model, resident, slots, with_target):
    """With 1 or 2 of 5 blocks resident and 2 or 3 slots, the prefill (the prefix pass, or diffusers' own forward
    through the blocks' pre-hooks) and the decode steps, captured and replayed, equal the whole model's exactly."""
    inputs = _inputs(model)
    whole = copy.deepcopy(model)  # engines hold their model weakly
    expected, _ = _generate(DecodeEngine(whole), *inputs, with_target=with_target)
    streamed = copy.deepcopy(model)
    _capturable(BlockStreamer(streamed, "cpu", plan_with(streamed, resident, slots)).start())
    engine = DecodeEngine(streamed, backend=_Recording())
    got, paths = _generate(engine, *inputs, with_target=with_target)
    assert paths == ["capture", "replay"]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    key = next(iter(engine.graphs.entries))
    assert key.streaming == (streamed_indices(LAYERS, LAYERS - resident), slots)


def test_streamed_blocks_parameters_are_views_of_their_slot(model):
    """Every tensor of a streamed block lies inside slot `position % slots`; blocks `slots` apart share addresses,
    resident blocks keep their own storage, and the slots hold exactly the largest streamed block's bytes."""
    m = copy.deepcopy(model)
    plan = plan_with(m, 1, 2)
    streamer = BlockStreamer(m, "cpu", plan).start()
    slots = streamer.slots.slots
    streamed = [m.transformer_blocks[i] for i in plan.streamed]
    # Each tensor starts at an aligned offset: a slot is the block's bytes plus under one alignment unit per tensor.
    tensors = len(list(streamed[0].parameters()))
    largest = streamer.plan.largest_block
    assert len(slots) == 2 and all(largest <= s.numel() < largest + ALIGNMENT * tensors for s in slots)
    assert streamer.buffer_bytes == 2 * slots[0].numel()
    for position, block in enumerate(streamed):
        slot = slots[position % 2]
        lo, hi = slot.data_ptr(), slot.data_ptr() + slot.numel()
        for t in (*block.parameters(), *block.buffers()):
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
    first, third = streamed[0], streamed[2]
    assert first.attn.to_q.weight.data_ptr() == third.attn.to_q.weight.data_ptr()
    resident = next(b for i, b in enumerate(m.transformer_blocks) if i not in plan.streamed).attn.to_q.weight
    assert not any(s.data_ptr() <= resident.data_ptr() < s.data_ptr() + s.numel() for s in slots)


def test_a_block_run_outside_a_pass_reads_its_own_weights(model):
    """Diffusers' forward (the pre-hook) and `block_on_device` copy the block into its slot each time, so two blocks
    sharing a slot, run alternately, each compute with their own weights."""
    m = copy.deepcopy(model)
    BlockStreamer(m, "cpu", plan_with(m, 1, 2)).start()
    a, b = m.transformer_blocks[1], m.transformer_blocks[3]  # same slot
    x = torch.randn(1, 4, m.transformer_blocks[0].attn.to_q.in_features)
    with block_on_device(a):
        qa = a.attn.to_q(x)
    with block_on_device(b):
        qb = b.attn.to_q(x)
    with block_on_device(a):
        assert torch.equal(a.attn.to_q(x), qa)
    ref = model.transformer_blocks
    assert torch.equal(qa, ref[1].attn.to_q(x)) and torch.equal(qb, ref[3].attn.to_q(x))


def _lora(tmp_path, model):
    path = write_tiny_lora(tmp_path / "lora.safetensors", dtype=torch.float32)
    return read_lora(path, model)


@pytest.mark.parametrize("resident", [0, 1])
def test_a_lora_merged_into_a_streamed_model_is_kept_and_restored(model, tmp_path, resident):
    """A LoRA merged while blocks stream lands in their host copies: the steps after it equal the whole model's with
    the same LoRA merged (two slots rewrite the streamed blocks every step, so a merge into a slot would be lost),
    and merging none restores the original steps exactly."""
    base = random_tiny_transformer(TINY_TRANSFORMER).requires_grad_(False)  # the LoRA's layer count
    inputs = _inputs(base)
    lora = _lora(tmp_path, base)
    whole = copy.deepcopy(base)
    LoraMerge(whole).apply([LoraChoice(lora, 0.8)])
    expected, _ = _generate(DecodeEngine(whole), *inputs)
    original, _ = _generate(DecodeEngine(base), *inputs)
    streamed = copy.deepcopy(base)
    BlockStreamer(streamed, "cpu", plan_with(streamed, resident, 2)).start()
    merge = LoraMerge(streamed)
    merge.apply([LoraChoice(lora, 0.8)])
    streamer = streamer_of(streamed.transformer_blocks)
    slot = streamer.slots[streamer.slot_of(1)]
    assert streamed.transformer_blocks[1].attn.to_q.weight.data_ptr() >= slot.data_ptr()  # back in its slot
    got, _ = _generate(DecodeEngine(streamed), *inputs)
    assert not torch.equal(expected[-1], original[-1])  # the LoRA changes the step
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    merge.apply([])
    restored, _ = _generate(DecodeEngine(streamed), *inputs)
    for a, b in zip(original, restored):
        assert torch.equal(a, b)


def test_stopping_gives_every_block_its_own_tensors_and_frees_the_slots(model):
    """`stop_streaming(device)` releases the graphs captured over the slots, removes the hooks, frees the slot
    buffers and leaves every block with tensors of its own (no two blocks share an address), computing as before."""
    m = copy.deepcopy(model)
    inputs = _inputs(m)
    loaded = LoadedTransformer(m, backend=_Recording())
    loaded.load_streamed("cpu", plan_with(m, 1, 2))
    _capturable(loaded.streamer)
    before, paths = _generate(loaded.engine, *inputs)
    assert paths == ["capture", "replay"] and loaded.engine.graphs.entries
    slot_refs = [weakref.ref(s) for s in loaded.streamer.slots.slots]
    loaded.stop_streaming("cpu")
    gc.collect()
    assert loaded.streaming is None and not loaded.engine.graphs.entries
    assert all(ref() is None for ref in slot_refs)
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in m.transformer_blocks)
    addresses = [b.attn.to_q.weight.data_ptr() for b in m.transformer_blocks]
    assert len(set(addresses)) == LAYERS
    after, paths = _generate(loaded.engine, *inputs)
    assert paths == ["capture", "replay"]  # a whole model's graph, captured anew
    assert next(iter(loaded.engine.graphs.entries)).streaming == ()
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_the_eager_way_is_judged_unfit_for_graphs_and_the_slot_way_is_not(model):
    """Blocks streamed the eager way (slots 0) keep per-call hooks, which may not be captured; blocks in slots are,
    unless their uploads cannot be (no CUDA, or pinning refused: the reason names it)."""
    eager = copy.deepcopy(model)
    BlockStreamer(eager, "cpu", plan_with(eager, 1, 0)).start()
    assert why.block_hooks_reason(eager) == why.BLOCK_HOOKS
    slotted = copy.deepcopy(model)
    streamer = BlockStreamer(slotted, "cpu", plan_with(slotted, 1, 2)).start()
    assert why.block_hooks_reason(slotted) == streamer.graph_reason == "streamed blocks are not on a CUDA device"
    _capturable(streamer)
    assert why.block_hooks_reason(slotted) is None
    slotted.transformer_blocks[0].register_forward_pre_hook(lambda mod, args: None)
    assert why.block_hooks_reason(slotted) == why.BLOCK_HOOKS  # anyone else's hook still counts


def test_an_int8_lora_merge_requantizes_into_the_host_copy(tiny_parts, tmp_path):
    """INT8 ConvRot blocks streamed through slots: a LoRA merge re-quantizes (`requantize_`) into each streamed
    block's host copy, so the int8 weights and fp32 scales the next upload brings are exactly the whole model's
    after the same merge, and the steps equal the whole model's."""
    from graph_runtime.loading import load_transformer
    from graph_runtime.quantized.int8_convrot import ConvRotInt8Linear
    from graph_runtime.tiny import write_comfyui_int8_files

    path = write_comfyui_int8_files(tmp_path / "int8", parts=tiny_parts)["transformer"]
    whole = load_transformer(path, dtype=torch.float32, quantized="int8").requires_grad_(False)
    streamed = load_transformer(path, dtype=torch.float32, quantized="int8").requires_grad_(False)
    lora = _lora(tmp_path, whole)
    LoraMerge(whole).apply([LoraChoice(lora, 0.8)])
    BlockStreamer(streamed, "cpu", plan_with(streamed, 0, 2)).start()
    LoraMerge(streamed).apply([LoraChoice(lora, 0.8)])
    streamer = streamer_of(streamed.transformer_blocks)
    for index in streamer.order:
        streamer.fill(index)  # what the next upload brings into the slot
        mine = dict(streamed.transformer_blocks[index].named_modules())
        for name, module in whole.transformer_blocks[index].named_modules():
            if isinstance(module, ConvRotInt8Linear):
                assert torch.equal(mine[name].weight, module.weight), (index, name)
                assert torch.equal(mine[name].weight_scale, module.weight_scale), (index, name)
    inputs = _inputs(whole)
    expected, _ = _generate(DecodeEngine(whole), *inputs)
    got, _ = _generate(DecodeEngine(streamed), *inputs)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_a_pass_holds_the_slots_until_it_ends_even_on_an_exception(model):
    """While a pass runs, no other thread may start one (nor replay over the slots, nor move the weights for a
    merge): the streamer's lock is held from `start` to the pass's end, and a step that raises midway releases it, so
    the model stays usable."""
    import threading

    from graph_runtime.stream_slots import stream_pass

    m = copy.deepcopy(model)
    BlockStreamer(m, "cpu", plan_with(m, 1, 2)).start()
    streamer = streamer_of(m.transformer_blocks)

    def free_elsewhere() -> bool:
        got = []

        def attempt():
            got.append(streamer.lock.acquire(blocking=False))
            if got[0]:
                streamer.lock.release()

        thread = threading.Thread(target=attempt)
        thread.start()
        thread.join()
        return got[0]

    with stream_pass(m.transformer_blocks):
        assert not free_elsewhere()
    assert free_elsewhere()
    inputs = _inputs(m)
    handle = m.transformer_blocks[3].attn.to_q.register_forward_pre_hook(lambda mod, args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _generate(DecodeEngine(m), *inputs)
    assert free_elsewhere()
    handle.remove()
    expected, _ = _generate(DecodeEngine(model), *inputs)
    got, _ = _generate(DecodeEngine(m), *inputs)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("placement", ["int8", "host"])
def test_a_streamed_step_with_a_stored_prefix_equals_the_whole_models(model, placement):
    """The stream slots' uploads and the prefix store's per-block hooks run in one step: with 2 of 5 blocks resident
    through 2 slots, an int8 or host prefix's prefill and its captured and replayed steps equal the whole model's
    with the same placement exactly (CPU fp32: the same ops on the same values), and the graph key carries the
    streaming and the placement."""
    inputs = _inputs(model)

    def run(engine):
        layout, embeds, latents = inputs
        with torch.no_grad():
            _, prefix = engine.prefill(layout, latents, embeds, torch.tensor([0.9]), with_target=False,
                                       placement=placement)
            outcomes = [engine.decode_step(prefix, latents, torch.tensor([t])) for t in (0.9, 0.6)]
        return [o.output for o in outcomes], [o.path for o in outcomes]

    whole = copy.deepcopy(model)  # engines hold their model weakly
    expected, _ = run(DecodeEngine(whole, backend=_Recording()))
    streamed = copy.deepcopy(model)
    _capturable(BlockStreamer(streamed, "cpu", plan_with(streamed, 2, 2)).start())
    engine = DecodeEngine(streamed, backend=_Recording())
    got, paths = run(engine)
    assert paths == ["capture", "replay"]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    key = next(iter(engine.graphs.entries))
    assert key.streaming == (streamed_indices(LAYERS, LAYERS - 2), 2) and key.placement == placement and key.kv_format == "native"


def test_a_streamer_started_under_inference_mode_runs_steps_outside_it(model):
    """ComfyUI loads models under `torch.inference_mode()` and the sampler steps outside it: a streamer started in
    the loader's mode must still let every step copy blocks into their slots (an inference tensor refuses in-place
    writes outside inference mode), and compute what the whole model computes."""
    inputs = _inputs(model)
    whole = copy.deepcopy(model)  # engines hold their model weakly
    expected, _ = _generate(DecodeEngine(whole), *inputs)
    streamed = copy.deepcopy(model)
    with torch.inference_mode():
        BlockStreamer(streamed, "cpu", plan_with(streamed, 1, 2)).start()
    with torch.inference_mode(False):
        got, _ = _generate(DecodeEngine(streamed), *inputs)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
