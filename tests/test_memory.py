"""The memory budget (graph_runtime/memory/) and the lean VAE decode (graph_runtime/vae_decode.py), on the CPU.

The formulas are checked three ways: against hand-computed numbers for the tiny and the full-size configs; against
a trace of what the real code allocates (the full-size models built under FakeTensorMode, so nothing is allocated:
a dispatch mode records every storage the ops create and the peak of those alive); and, on a GPU, against the
allocated peak of a first prompt (tests/gpu/test_gpu_memory.py).
"""

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from graph_runtime.memory import budget as budgets
from graph_runtime import memory
from graph_runtime.tiny import TINY_TRANSFORMER, TINY_VAE

sys.path.insert(0, str(Path(__file__).parent))

MiB, GiB = 2**20, 2**30
FULL = memory.TransformerDims.from_config({"num_layers": 32, "num_attention_heads": 32, "attention_head_dim": 128,
                                           "mlp_ratio": 3, "in_channels": 64, "out_channels": 64})


class PeakTrace(TorchDispatchMode):
    """Peak bytes of storages created by the ops run under it and still alive (inputs and weights excluded)."""

    def __init__(self, existing):
        super().__init__()
        self.skip = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}
        self.live, self.current, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.live and ref.cdata not in self.skip:
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
                    self.current += self.live[ref.cdata][1]
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        self.peak = max(self.peak, self.current)
        return out


def fake_module(build, dtype):
    """`build()` under FakeTensorMode with `dtype` as the default: a full-size model that allocates nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    saved = torch.get_default_dtype()
    with mode:
        torch.set_default_dtype(dtype)
        try:
            module = build().eval().requires_grad_(False)
        finally:
            torch.set_default_dtype(saved)
    return mode, module


# -- hand-computed numbers -----------------------------------------------------------------------------------------


def test_full_size_pieces_by_hand():
    assert FULL.hidden == 4096 and FULL.mlp_hidden == 12288 and FULL.activation_bytes == 2
    # K and V, 32 blocks, 32 heads x 128, bf16: the 0.5 MiB per prefix token per branch of the design notes.
    assert memory.kv_bytes_per_token(FULL) == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    # One 1024x1024 step: 4096 tokens x (8 x 4096 + 3 x 12288) x 2 bytes = 544 MiB, plus the 64-channel output.
    assert memory.step_activation_bytes(FULL, 4096) == 4096 * 69632 * 2 + 4096 * 64 * 2 == 545 * MiB - 512 * 1024
    # A 1024x1024 entry past its 128 prefix rows: 4096 target rows of K/V (2 GiB), hidden (0.5 MiB), timestep,
    # and the fp32 cos/sin tables (2 x 4096 x 64 x 4 = 2 MiB).
    assert memory.entry_buffer_bytes(FULL, 1, 128, 4096) == 2 * GiB + 512 * 1024 + 2 + 2 * MiB


def test_tiny_pieces_by_hand():
    tiny = memory.TransformerDims.from_config(TINY_TRANSFORMER, torch.float32)
    assert (tiny.blocks, tiny.hidden, tiny.mlp_hidden, tiny.activation_bytes) == (2, 32, 96, 4)
    assert memory.kv_bytes_per_token(tiny) == 2 * 2 * 32 * 4 == 512
    assert memory.step_activation_bytes(tiny, 48) == 48 * ((8 * 32 + 3 * 96) * 4 + 64 * 4)
    # The tiny VAE (decoder width 8) in fp32 at 128x96: (9 x 4 + 2 x 4) x 8 B/px plus the 4-channel output twice.
    vae = memory.VaeDims(decoder_dim=8, out_channels=4, activation_bytes=4, weight_bytes=0)
    assert memory.vae_decode_bytes(vae, 128, 96) == 128 * 96 * (44 * 8 + 4 * 8)


def test_budget_of_a_1024_text_to_image_request():
    weights = {"transformer": 14_200_000_000}
    shape = memory.GenerationShape(1024, 1024, prefix_tokens=(128,))
    budget = memory.estimate(FULL, shape, weights)
    parts = dict(budget.parts)
    assert parts["transformer weights"] == 14_200_000_000
    assert parts["prefix K/V (128 tokens)"] == 128 * 512 * 1024  # 64 MiB
    assert parts["graph buffers"] == memory.entry_buffer_bytes(FULL, 1, 128, 4096) + memory.prefix_graph_bytes(
        FULL, 1, 128)
    assert parts["graph pool"] == memory.step_activation_bytes(FULL, 4096)
    assert budget.margin == int(memory.MARGIN_BYTES + memory.MARGIN_FRACTION * budget.need)
    # Eager: no graph buffers or pool; the step's activations and one block's concatenated K/V are transient.
    eager = memory.estimate(FULL, dataclasses.replace(shape, decode_mode="eager"), weights)
    assert "graph pool" not in dict(eager.parts)
    assert eager.total < budget.total - 2 * GiB
    # CFG doubles the prefix K/V and the graph buffers but not the pool (one pool, replayed one graph at a time).
    cfg = memory.estimate(FULL, dataclasses.replace(shape, prefix_tokens=(128, 96)), weights)
    assert dict(cfg.parts)["graph pool"] == parts["graph pool"]
    assert dict(cfg.parts)["graph buffers"] > 1.9 * parts["graph buffers"]


def test_int8_weights_are_sized_from_their_bytes():
    bf16 = 14_240_000_000
    int8 = FULL.int8_weight_bytes(bf16)
    # Block Linears: 32 x (4 x 4096^2 + 3 x 4096 x 12288) = 6.98e9 values, one byte each instead of two.
    assert int8 == bf16 - 32 * (4 * 4096**2 + 3 * 4096 * 12288) + 32 * (5 * 4096 + 2 * 12288) * 4
    assert 7.2e9 < int8 < 7.3e9  # ComfyUI's qwen_image_2.1_int8_convrot.safetensors is 7.3 GB
    int8_dims = dataclasses.replace(FULL, int8=True)
    assert int8_dims.int8_weight_bytes(int8) == int8
    assert memory.step_activation_bytes(int8_dims, 4096) > memory.step_activation_bytes(FULL, 4096)


# -- against what the code allocates and what the H200 measured ------------------------------------------------------


@pytest.mark.parametrize("target, prefix, batch", [(1024, 128, 1), (4096, 128, 1), (4096, 4224, 1), (4096, 128, 2)])
def test_step_activations_match_a_trace_of_the_full_size_step(target, prefix, batch):
    """The decode step's body (our kernels' fake implementations included) at full width, traced: its peak equals
    the formula within the output's 128 bytes per token. Two blocks: the peak is reached inside each block."""
    from diffusers import QwenImage21Transformer2DModel

    from graph_runtime.decode.step import DecodeInputs, DecodeStep

    mode, model = fake_module(lambda: QwenImage21Transformer2DModel(num_layers=2), torch.bfloat16)
    with mode:
        z = lambda *shape, dtype=torch.bfloat16: torch.zeros(*shape, dtype=dtype)  # noqa: E731
        inputs = DecodeInputs(hidden=z(batch, target, 64), timestep=z(batch),
                              k=[z(batch, prefix + target, 32, 128) for _ in range(2)],
                              v=[z(batch, prefix + target, 32, 128) for _ in range(2)],
                              cos=z(target, 1, 64, dtype=torch.float32), sin=z(target, 1, 64, dtype=torch.float32),
                              prefix_len=prefix, static_kv=True)
        existing = [*model.parameters(), *model.buffers(), inputs.hidden, inputs.timestep, *inputs.k, *inputs.v,
                    inputs.cos, inputs.sin]
        with torch.no_grad(), PeakTrace(existing) as trace:
            DecodeStep(model)(inputs)
    formula = memory.step_activation_bytes(FULL, batch * target)
    print(f"traced {trace.peak / MiB:.1f} MiB, formula {formula / MiB:.1f} MiB")
    assert trace.peak <= formula <= trace.peak + 128 * batch * target


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vae_decode_formula_matches_a_trace_of_the_full_size_vae(dtype):
    from diffusers import AutoencoderKLQwenImage21

    from graph_runtime.vae_decode import decode_frames

    mode, vae = fake_module(AutoencoderKLQwenImage21, dtype)
    dims = memory.VaeDims(decoder_dim=144, out_channels=4, activation_bytes=dtype.itemsize, weight_bytes=0)
    with mode:
        z = torch.zeros(1, 64, 1, 64, 64, dtype=dtype)  # 1024x1024
        existing = [*vae.parameters(), *vae.buffers(), z]
        with torch.no_grad(), PeakTrace(existing) as lean:
            decode_frames(vae, z)
        with torch.no_grad(), PeakTrace(existing) as cached:
            vae.decode(z, return_dict=False)
        # A tiled decode runs diffusers' (cached) decoder on one 256x256 px tile at a time, plus the blending.
        tile = torch.zeros(1, 64, 1, 16, 16, dtype=dtype)
        with torch.no_grad(), PeakTrace([*existing, tile]) as one_tile:
            vae.decode(tile, return_dict=False)
    tile_formula = memory.vae_decode_bytes(dims, 256, 256, tiled=True)
    print(f"one tile: traced {one_tile.peak / MiB:.0f} MiB, formula {tile_formula / MiB:.0f} MiB")
    assert one_tile.peak <= tile_formula <= 1.5 * one_tile.peak
    whole = memory.vae_decode_bytes(dims, 1024, 1024)
    print(f"lean {lean.peak / MiB:.0f} MiB (formula {whole / MiB:.0f}), diffusers' cached decode "
          f"{cached.peak / MiB:.0f} MiB")
    # The formula adds the fp32 copy of the output the nodes make: at most 2% above the trace.
    assert lean.peak <= whole <= 1.02 * lean.peak
    assert lean.peak < 0.65 * cached.peak  # the temporal cache's clones are most of the difference


def test_request_shape_counts_prefix_tokens_like_the_token_layout():
    from graph_runtime.decode import TokenLayout
    from graph_runtime.encoding.prompt import PromptEmbeds
    from graph_runtime.sampling.sampler import SamplingRequest

    image_mask = torch.tensor([[False] * 5 + [True] * 6 + [False] * 7])  # 6 slots: a 4x6-token reference
    embeds = PromptEmbeds(torch.zeros(1, 18, 64), image_mask)
    request = SamplingRequest(positive=embeds, negative=embeds, cfg=3.0, latent_height=6, latent_width=8,
                              reference_latents=[torch.zeros(1, 64, 4, 6)], batch_size=2)
    shape = budgets.request_shape(request)
    layout = TokenLayout.build(image_mask, [(1, 4, 6), (1, 6, 8)], "cpu")
    assert shape.prefix_tokens == (layout.prefix_len, layout.prefix_len) == (36, 36)
    assert (shape.width, shape.height, shape.batch, shape.target_tokens) == (128, 96, 2, 48)
    assert budgets.request_shape(request, graphs=False).decode_mode == "eager"


# -- the refusal ---------------------------------------------------------------------------------------------------


def plan_1024(**shape_changes):
    shape = dataclasses.replace(memory.GenerationShape(1024, 1024, prefix_tokens=(128,)), **shape_changes)
    vae = memory.VaeDims.standard(torch.bfloat16)
    return budgets.RequestPlan(FULL, shape, {"transformer": int(7.12e9 * 2), "VAE": vae.weight_bytes}, vae)


def test_a_budget_that_cannot_fit_refuses_naming_the_settings():
    plan = plan_1024(decode_mode="auto", batch=2, prefix_tokens=(128, 96))
    needed = plan.budget(16 * GiB).total  # the least it needs: the VAE decode tiled
    assert needed < plan.budget().total
    with pytest.raises(budgets.MemoryBudgetError) as info:
        plan.check(16 * GiB, "cuda:0", "test")
    message = str(info.value)
    print(message)
    assert f"needs {memory.gib(needed)}" in message and "16.0 GiB is available" in message
    for setting in ("decode_mode eager", "cfg 1", "batch 1", "width x height at most", "weights mode int8"):
        assert setting in message
    assert "Nothing was allocated" in message
    # What the message promises holds: the int8 option with a batch of 1 and no CFG fits in 16 GiB.
    int8 = budgets.RequestPlan(dataclasses.replace(FULL, int8=True), plan_1024().shape, {
        **plan.weights, "transformer": FULL.int8_weight_bytes(plan.weights["transformer"])}, plan.vae)
    assert int8.check(16 * GiB, "cuda:0", "test").total <= 16 * GiB


def test_the_options_that_fit_come_first_and_fit():
    plan = plan_1024()
    graph, eager = plan.budget(), dataclasses.replace(plan, shape=dataclasses.replace(plan.shape,
                                                                                        decode_mode="eager")).budget()
    available = (graph.total + eager.total) // 2  # eager fits, the graph path does not
    options = budgets.alternatives(plan.dims, plan.shape, plan.weights, plan.vae, available)
    fits = [o.endswith("(fits)") for o in options]
    assert fits == sorted(fits, reverse=True)
    assert any(o.startswith("decode_mode eager") and o.endswith("(fits)") for o in options)
    size = next(o for o in options if o.startswith("width x height"))
    width, height = (int(v) for v in size.split("at most ")[1].split(" ")[0].split("x"))
    smaller = dataclasses.replace(plan, shape=dataclasses.replace(plan.shape, width=width, height=height))
    assert width == height and width % 16 == 0 and width < 1024
    assert smaller.budget(available).total <= available


def test_a_tiled_vae_decode_is_planned_rather_than_refused():
    plan = plan_1024()
    whole = plan.budget()
    tiled = memory.estimate(plan.dims, plan.shape, plan.weights, plan.vae, vae_tiled=True)
    available = (whole.total + tiled.total) // 2
    budget = plan.check(available, "cuda:0", "test")
    assert budget.vae_tiled and budget.total == tiled.total and "tiled" in budget.notes[0]


def test_device_free_bytes_is_unknown_off_cuda():
    assert memory.device_free_bytes("cpu") is None


# -- a large batch, and the host's memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch, cfg", [(4, False), (4, True), (1, False)])
def test_the_budget_covers_a_traced_sampling_run_of_a_batch(tiny_models, batch, cfg):
    """A whole sampling run of the tiny model (eager, fp32, on the CPU: noise, prefill, steps, Euler updates, CFG),
    traced: its peak of live tensors is within the estimate (without its margin and the weights), and the estimate is
    not more than 1.5x that peak (its latent copies are counted for the step they are all alive in). Before the
    sampler's latent-sized tensors were counted, a batch's estimate fell short of the trace."""
    from tests.owners import generator_for
    from graph_runtime.sampling.sampler import SamplingRequest, sample

    generator = generator_for(tiny_models)
    positive = generator.encoder.encode("a red cube")
    request = SamplingRequest(positive=positive, negative=positive if cfg else None, cfg=2.0 if cfg else 1.0,
                              latent_height=32, latent_width=32, batch_size=batch, steps=3, decode_mode="eager",
                              scheduler_config=tiny_models.scheduler_config)
    plan = budgets.RequestPlan.for_request(tiny_models.transformer, request, None, graphs=False)
    need = plan.budget().need - plan.budget().part("transformer weights")
    existing = [*tiny_models.transformer.parameters(), *tiny_models.transformer.buffers(), positive.embeds]
    with torch.no_grad(), PeakTrace(existing) as trace:
        sample(generator.engine, request)
    print(f"batch {batch}, cfg {cfg}: traced {trace.peak / MiB:.2f} MiB, estimate {need / MiB:.2f} MiB")
    assert trace.peak <= need <= 1.5 * trace.peak


def test_a_decoded_batch_that_host_memory_cannot_hold_is_refused_naming_the_batch_that_fits():
    """ComfyUI's VAE decode keeps the whole IMAGE (float32 RGB) in host memory: a batch whose IMAGE exceeds what is
    available is refused before anything is decoded, naming the largest batch that fits, and that batch fits."""
    per_image = memory.decoded_images_bytes(1024, 1024, 1, memory.IMAGE_BYTES_PER_PIXEL)
    assert per_image == 12 * MiB
    free = 2 * GiB
    with pytest.raises(budgets.MemoryBudgetError) as info:
        budgets.check_decoded_on_host(1024, 1024, 4096, memory.IMAGE_BYTES_PER_PIXEL, 100 * MiB, "a latent batch",
                                      free=free)
    message = str(info.value)
    print(message)
    assert "decoded images (4096x 1024x1024) 48.00" in message and "one image's VAE decode 0.10" in message
    most = int(message.split("a latent batch at most ")[1].split(" ")[0])
    assert 0 < most < 4096
    assert budgets.check_decoded_on_host(1024, 1024, most, 12, 100 * MiB, free=free).total <= free
    with pytest.raises(budgets.MemoryBudgetError):
        budgets.check_decoded_on_host(1024, 1024, most + 1, 12, 100 * MiB, free=free)


def test_host_available_memory_is_read_and_the_cpu_has_a_figure():
    """The CPU's budget reads the host's available memory (psutil, else /proc/meminfo, capped by a cgroup limit):
    on this Linux machine it is a positive figure no larger than the machine's RAM."""
    available = memory.host_available_bytes()
    assert available is not None and 0 < available
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert available <= total
    assert memory.available_bytes("cpu") is not None and memory.available_bytes("meta") is None


# -- the lean VAE decode -------------------------------------------------------------------------------------------


def test_lean_vae_decode_is_bit_equal_to_diffusers_decode():
    from diffusers import AutoencoderKLQwenImage21

    from graph_runtime.vae_decode import decode_frames

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage21(**TINY_VAE).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0.0, 0.2)  # default init zeroes some layers; every path must carry signal
        z = torch.randn(2, 64, 1, 12, 10)
        expected = vae.decode(z, return_dict=False)[0]
        assert torch.equal(decode_frames(vae, z), expected)
        tiled = decode_frames(vae, z, tiled=True)  # 192x160 px is one tile: the tiled decoder's own path
    assert tiled.shape == expected.shape and not vae.use_tiling


def test_should_tile_only_when_a_whole_decode_does_not_fit(caplog):
    from diffusers import AutoencoderKLQwenImage21

    from graph_runtime.vae_decode import should_tile

    vae = AutoencoderKLQwenImage21(**TINY_VAE).eval()
    dims = memory.VaeDims.of(vae)
    whole = memory.vae_decode_bytes(dims, 1024, 1024) + memory.MARGIN_BYTES
    tiled = memory.vae_decode_bytes(dims, 1024, 1024, tiled=True) + memory.MARGIN_BYTES
    caplog.set_level(logging.INFO, logger="kvgraph")
    assert not should_tile(vae, 1024, 1024, None) and not should_tile(vae, 1024, 1024, whole)
    assert not should_tile(vae, 1024, 1024, tiled - 1)  # nothing fits: leave it to ComfyUI to make room
    assert should_tile(vae, 1024, 1024, whole - 1)
    assert any("tiled" in r.getMessage() for r in caplog.records)


def test_eviction_takes_the_least_recently_used_evictable_entries_until_within_the_limit_and_shortfall():
    from graph_runtime.eviction import Entry, evictions

    entries = [Entry("a", 5), Entry("b", 4, evictable=False), Entry("c", 3), Entry("d", 2)]
    assert evictions(entries, limit=None) == []
    assert [e.key for e in evictions(entries, limit=14)] == []
    assert [e.key for e in evictions(entries, limit=9)] == ["a"]  # 14 - 5 = 9
    assert [e.key for e in evictions(entries, limit=8)] == ["a", "c"]  # b is in use: skipped
    assert [e.key for e in evictions(entries, limit=None, shortfall=6)] == ["a", "c"]
    assert [e.key for e in evictions(entries, limit=0)] == ["a", "c", "d"]  # all it can


def test_the_cache_limit_reads_its_setting(monkeypatch):
    from graph_runtime import eviction

    monkeypatch.setenv(eviction.LIMIT_VARIABLE, "1.5")
    assert eviction.limit_bytes() == int(1.5 * GiB)
    monkeypatch.setenv(eviction.LIMIT_VARIABLE, "none")
    assert eviction.limit_bytes() is None
    monkeypatch.setenv(eviction.LIMIT_VARIABLE, "lots")
    total = memory.host_total_bytes()
    assert total and eviction.limit_bytes() == int(total * eviction.DEFAULT_RAM_FRACTION)
