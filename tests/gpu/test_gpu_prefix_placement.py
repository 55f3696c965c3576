"""Prefix placements on a real GPU (`pytest -m gpu tests/gpu/test_gpu_prefix_placement.py -s`): int8 and pinned-host
prefix K/V inside the captured decode step.

- A replay runs the kernels its capture recorded on the same inputs as the eager body run under the capture's
  settings, so replay and body are compared bit for bit, for every placement (the host one with its copy stream and
  events recorded into the graph).
- A host prefix only moves the gpu prefix's values: its replays equal the gpu prefix's bit for bit, in bf16 too.
- The int8 prefix is judged against the INT8 ConvRot bound (bench/prefix_placement.py, bench/fp8_quality.py): its error
  against an fp32 run, per block and over the step, within that of ComfyUI's INT8 ConvRot Linears with a bf16 prefix
  on the same weights (a 4-block full-width model at 512x512 with one reference).
- Ten 1024x1024 references on an emulated 24 GB card (`set_per_process_memory_fraction`, as test_gpu_memory.py): the
  int8 ConvRot transformer, `auto` picks a placement that fits (not the gpu one), the prompt runs and replays, and a
  second queued prompt captures nothing; the same with the prefix forced to int8 on an emulated 40 GB card.
"""

import copy

import pytest
import torch

from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.memory import budget as budgets
from graph_runtime.sampling.sampler import SamplingRequest, initial_noise, pack, sample
from tests.gpu.test_gpu_memory import fresh_device  # noqa: F401 - autouse: nothing of another test's held
from tests.owners import generator_for, loaded_for

pytestmark = pytest.mark.gpu
GB = 10**9


@pytest.fixture(scope="module")
def cuda_generator(cuda_models):
    return generator_for(cuda_models)




def _request(generator, dtype, shape=(1, 8, 8)):
    embeds = generator.encoder.encode("a red cube")
    layout = TokenLayout.build(embeds.image_mask, [shape], "cuda")
    latents = pack(initial_noise(3, 1, 64, shape[1], shape[2], torch.float32)).to("cuda", dtype)
    return layout, latents, embeds.embeds.to("cuda", dtype)


def _placed_steps(transformer, generator, placement, dtype):
    """Prefill under `placement`, capture, replay twice; returns the replays' outputs and the eager body's output on
    the entry's inputs (run under the capture's settings)."""
    engine = DecodeEngine(transformer)
    layout, latents, embeds = _request(generator, dtype)
    t0, t1 = (torch.full((1,), v, device="cuda", dtype=dtype) for v in (0.9, 0.6))
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds, t0, mode="graph", with_target=False,
                                   placement=placement)
        captured = engine.decode_step(prefix, latents, t0, "graph")
        replayed = engine.decode_step(prefix, latents, t1, "graph")
        entry = engine.graphs.entries[prefix.graph_key]
        with engine.graphs.backend.capture_settings():
            body = engine.step(entry.inputs)
    assert (captured.path, replayed.path) == ("capture", "replay"), (captured.reason, replayed.reason)
    assert prefix.graph_key.placement == placement
    out = {"captured": captured.output, "replayed": replayed.output, "body": body, "entry": entry}
    prefix.release()
    engine.release()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_kernel_equals_the_reference_and_writes_only_the_prefix_rows(dtype):
    """The Triton pass computes `int8 * scale` in fp32 and rounds once, as the PyTorch reference: bit-equal, into the
    prefix rows of a `[B, P + T, H, D]` buffer (batches apart), the target rows left as they were."""
    from graph_runtime.kernels.kv_int8 import dequantize_rows, reference_dequantize

    generator = torch.Generator("cpu").manual_seed(0)
    q = torch.randint(-127, 128, (2, 301, 32, 128), generator=generator, dtype=torch.int8).cuda()
    scale = (torch.rand(2, 301, 32, 1, generator=generator) * 0.1).cuda()
    work = torch.full((2, 301 + 64, 32, 128), 7.0, dtype=dtype, device="cuda")
    dequantize_rows(q, scale, work[:, :301])
    assert torch.equal(work[:, :301], reference_dequantize(q, scale, dtype))
    assert bool((work[:, 301:] == 7.0).all())


@pytest.mark.parametrize("placement", ["gpu", "int8", "host"])
def test_replay_equals_its_eager_body_for_each_placement(cuda_models, cuda_generator, placement):
    """Bit for bit (fp32 tiny model): the captured step, dequantization or copy stream included, is the body."""
    out = _placed_steps(cuda_models.transformer, cuda_generator, placement, torch.float32)
    assert torch.equal(out["body"], out["replayed"])
    if placement == "host":
        assert out["entry"].store.pinned  # the copies were asynchronous ones, recorded into the graph


def _pinned_bytes() -> int:
    """What PyTorch's pinned-memory allocator holds (its key names changed across releases)."""
    stats = torch.cuda.host_memory_stats()
    return stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0))


def test_a_dropped_host_prefix_gives_its_pinned_memory_back(cuda_models, cuda_generator):
    """Once the request is done and its graph entry released, the pinned rows leave PyTorch's pinned-memory cache
    too (`DecodeGraphs` hands them back when it drops a host entry): no locked memory is kept."""
    from graph_runtime.decode.prefix_store import release_host_cache

    layout, latents, embeds = _request(cuda_generator, torch.float32)
    release_host_cache()
    before = _pinned_bytes()
    engine = DecodeEngine(cuda_models.transformer)
    t = torch.full((1,), 0.9, device="cuda")
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds, t, mode="graph", with_target=False, placement="host")
        assert engine.decode_step(prefix, latents, t, "graph").path == "capture"
    held = engine.status()["host_bytes_held"]
    assert held > 0 and _pinned_bytes() >= before + held
    prefix.release()
    del prefix
    after_request = _pinned_bytes()
    engine.release()
    after = _pinned_bytes()
    assert after <= before, f"pinned bytes: {before} before, {after_request} after the request's, {after} after all"


def test_host_prefix_replays_equal_the_gpu_prefix_bit_for_bit_in_bf16(cuda_models, cuda_generator, monkeypatch):
    """The bf16 tiny model: the host prefix's captured and replayed steps equal the gpu prefix's exactly. Both prefix
    passes run eagerly (a short gpu prefix's pass is otherwise captured without a cuBLAS workspace, whose GEMMs may
    round differently), so both placements hold the same prefix values and only where they live differs."""
    monkeypatch.setattr(DecodeEngine, "captures_prefix_pass", staticmethod(lambda prefix_len: False))
    bf16 = copy.deepcopy(cuda_models.transformer).to(torch.bfloat16)
    gpu = _placed_steps(bf16, cuda_generator, "gpu", torch.bfloat16)
    host = _placed_steps(bf16, cuda_generator, "host", torch.bfloat16)
    assert torch.equal(gpu["captured"], host["captured"]) and torch.equal(gpu["replayed"], host["replayed"])


def test_int8_prefix_is_within_the_int8_convrot_bound_per_block_and_per_step():
    """The int8 prefix's error against fp32 is within the INT8 ConvRot bound's, in every block and over the step (the
    verdict of bench/prefix_placement.py; a 4-block full-width random model, 512x512 with one reference)."""
    from bench.model import build_transformer
    from bench.prefix_placement import quality
    from bench.scenarios import Scenario, build_inputs

    transformer = build_transformer(layers=4)
    config = transformer.config
    inputs = build_inputs(Scenario("edit1-512", 512, references=1), config.context_in_dim, config.in_channels, "cuda",
                          torch.bfloat16)
    judged = quality(transformer, inputs, "cuda")
    print(judged["verdict"], "int8 prefix", judged["int8-prefix"], "bound", judged["int8-convrot"])
    assert judged["verdict"]["pass"], judged["verdict"]
    assert judged["int8-prefix"]["step_err"] > 0  # measured: the int8 rows were really read


def _ten_references(transformer):
    """A 10-reference 1024x1024 edit request's prompt: 128 text tokens and 1024 image slots per reference."""
    from bench.scenarios import _vlm_mask

    mask = _vlm_mask(128, 10, 1024)
    generator = torch.Generator("cpu").manual_seed(0)
    embeds = torch.randn(1, mask.shape[1], transformer.config.context_in_dim, generator=generator)
    positive = PromptEmbeds(embeds.to("cuda", torch.bfloat16), mask.to("cuda"))
    references = [torch.randn(1, 64, 64, 64, generator=generator).to("cuda", torch.bfloat16) for _ in range(10)]
    return positive, references


def _two_prompts(transformer, placement: str, card_bytes: int) -> list:
    from tests.gpu.test_gpu_memory import emulated_card

    positive, references = _ten_references(transformer)
    loaded = loaded_for(transformer)
    results = []
    torch.cuda.reset_peak_memory_stats()
    with emulated_card(card_bytes):
        for seed in (1, 2):
            request = SamplingRequest(positive=positive, reference_latents=references, latent_height=64,
                                      latent_width=64, sigma_preset="turbo", seed=seed, prefix_placement=placement)
            budget = budgets.check_runtime_request(loaded, request)
            # As the command line runs it: the plan's resident blocks on the GPU, the others streamed.
            request.memory_plan = budget.plan
            loaded.follow_plan(torch.device("cuda"), budget.plan)
            result = sample(loaded.engine, request)
            print(budget.describe(), budget.notes, result.stats)
            results.append((request, budget, result))
    return results


def _int8_transformer():
    from bench.model import build_transformer
    from tests.gpu.test_gpu_memory import quantize_linears

    transformer = build_transformer()
    quantize_linears(transformer.transformer_blocks)
    torch.cuda.empty_cache()
    return transformer


@pytest.mark.parametrize("placement,card_gb", [("auto", 24), ("int8", 40)])
def test_ten_references_at_1024_run_and_replay_on_a_capped_card(placement, card_gb):
    """10 references at 1024x1024 (41 k prefix tokens, 21 GB of bf16 prefix K/V): on an emulated 24 GB card `auto`
    (the memory planner) places the prefix off the GPU layout, streaming blocks where its plan does, and the prompt
    runs; int8 forced on 40 GB; both replay every step after the
    first prompt's capture, and the second queued prompt captures nothing."""
    transformer = _int8_transformer()
    (first_request, budget, first), (_, _, second) = _two_prompts(transformer, placement, card_gb * GB)
    used = first_request.placement()
    assert used != "gpu" and (placement == "auto" or used == placement)
    assert budget.prefix_placement == used and first.stats["prefix_placements"] == {used: 1}
    if used == "recompute":
        pytest.fail("no cached placement fit the emulated card: " + budget.describe())
    assert first.stats["captures"] == 1 and not first.stats["eager_steps"], first.stats
    assert second.stats["captures"] == 0 and second.stats["replays"] == len(second.paths) == 8, second.stats
    assert set(second.paths) == {"replay"} and torch.isfinite(second.latents).all()
    assert torch.cuda.max_memory_reserved() <= card_gb * GB
