"""CUDA-graph decode on a real GPU (run on the H200: `pytest -m gpu`).

The tiny model runs in fp32 here so tolerances are about graph mechanics, not bf16 rounding. Replaying a captured
step runs the same kernels on the same inputs as the eager body run under the capture's settings, so the expected
difference is 0 (without those settings cuBLAS may pick its workspace variant of a GEMM: round-off only); the eager
fallback concatenates the prefix instead of reading the static buffer, which can change SDPA's kernel choice, so
graph-vs-eager comparisons allow 1e-5 (fp32 round-off on values ~1-5). Compiled blocks fuse elementwise work and
reassociate, so compile+graph vs eager allows 1e-3.
"""

import gc

import pytest
import torch

from graph_runtime.decode import CudaGraphBackend, DecodeEngine, TokenLayout
from graph_runtime.decode import eligibility as why
from graph_runtime.decode.capture import DecodeGraphEntry
from tests.owners import generator_for
from graph_runtime.sampling.sampler import initial_noise, pack
from graph_runtime.sampling.schedule import build_schedule, euler_step

pytestmark = pytest.mark.gpu
GRAPH_ATOL = 1e-5
COMPILE_ATOL = 1e-3


@pytest.fixture(scope="module")
def cuda_generator(cuda_models):
    return generator_for(cuda_models)


def _fresh_transformer(cuda_models):
    from diffusers import QwenImage21Transformer2DModel
    from graph_runtime.tiny import TINY_TRANSFORMER

    t = QwenImage21Transformer2DModel(**TINY_TRANSFORMER).eval()
    t.load_state_dict(cuda_models.transformer.state_dict())
    return t.to("cuda")


def _steps(engine, generator, prompt, seed, mode, steps=6, shape=(1, 8, 8)):
    """A sampling loop as a generator of per-step states, so two requests can be interleaved step by step."""
    embeds = generator.encoder.encode(prompt)
    layout = TokenLayout.build(embeds.image_mask, [shape], "cuda")
    latents = pack(initial_noise(seed, 1, 64, shape[1], shape[2], torch.float32)).cuda()
    timesteps, sigmas = build_schedule(None, steps, shape[1] * shape[2], device="cuda")
    prefix, outcomes = None, []
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            timestep = t.expand(1) / 1000
            if i == 0:
                pred, prefix = engine.prefill(layout, latents, embeds.embeds.cuda(), timestep, mode=mode)
            else:
                outcome = engine.decode_step(prefix, latents, timestep, mode)
                outcomes.append(outcome)
                pred = outcome.output
            latents = euler_step(latents, pred, sigmas[i], sigmas[i + 1])
            yield latents, outcomes
    prefix.release()


def _run(engine, generator, prompt, seed, mode, **kw):
    for latents, outcomes in _steps(engine, generator, prompt, seed, mode, **kw):
        pass
    return latents, outcomes


def test_replay_equals_eager_and_second_generation_captures_nothing(cuda_models, cuda_generator):
    transformer = _fresh_transformer(cuda_models)  # the engine holds it weakly, like a loaded model's owner
    engine = DecodeEngine(transformer)
    eager, _ = _run(engine, cuda_generator, "a red cube", 1, "eager")
    graph, outcomes = _run(engine, cuda_generator, "a red cube", 1, "graph")
    assert [o.path for o in outcomes] == ["capture"] + ["replay"] * 4
    diff = (graph - eager).abs().max().item()
    print(f"graph vs eager latents after 6 steps: max abs diff {diff:.3e}")
    assert diff <= GRAPH_ATOL
    again, outcomes = _run(engine, cuda_generator, "a red cube", 2, "graph")  # equal shapes, new request
    assert [o.path for o in outcomes] == ["replay"] * 5
    assert engine.graphs.stats.captures == 1


def test_equal_token_counts_different_layouts_separate_entries(cuda_models, cuda_generator):
    transformer = _fresh_transformer(cuda_models)  # the engine holds it weakly, like a loaded model's owner
    engine = DecodeEngine(transformer)
    _run(engine, cuda_generator, "a red cube", 1, "graph", shape=(1, 8, 8))
    _, outcomes = _run(engine, cuda_generator, "a red cube", 1, "graph", shape=(1, 4, 16))
    assert outcomes[0].path == "capture"
    assert len(engine.graphs.entries) == 2 and engine.graphs.stats.captures == 2


def test_compile_and_graph_match_eager(cuda_models, cuda_generator):
    transformer = _fresh_transformer(cuda_models)  # the engine holds it weakly, like a loaded model's owner
    engine = DecodeEngine(transformer)
    eager, _ = _run(engine, cuda_generator, "a red cube", 4, "eager")
    engine.enable_compile()
    compiled, outcomes = _run(engine, cuda_generator, "a red cube", 4, "graph")
    assert outcomes[0].path == "capture" and outcomes[-1].path == "replay"
    diff = (compiled - eager).abs().max().item()
    print(f"compile+graph vs eager latents: max abs diff {diff:.3e}")
    assert diff <= COMPILE_ATOL


def test_interleaved_generations_with_one_key(cuda_models, cuda_generator):
    """The second live request with the owner's key runs eager; both equal their solo results."""
    transformer = _fresh_transformer(cuda_models)  # the engine holds it weakly, like a loaded model's owner
    engine = DecodeEngine(transformer)
    solo_a, _ = _run(engine, cuda_generator, "a red cube", 1, "graph")
    solo_b, _ = _run(engine, cuda_generator, "a red cube", 2, "graph")
    a = _steps(engine, cuda_generator, "a red cube", 1, "graph")
    b = _steps(engine, cuda_generator, "a red cube", 2, "graph")
    for (latents_a, outcomes_a), (latents_b, outcomes_b) in zip(a, b):
        pass
    assert {o.path for o in outcomes_a} == {"replay"}
    assert {o.reason for o in outcomes_b} == {why.OWNED}
    assert (latents_a - solo_a).abs().max().item() <= GRAPH_ATOL
    assert (latents_b - solo_b).abs().max().item() <= GRAPH_ATOL
    del a, b
    gc.collect()


def test_injected_capture_failure_ends_eager_and_correct(cuda_models, cuda_generator, monkeypatch):
    transformer = _fresh_transformer(cuda_models)  # the engine holds it weakly, like a loaded model's owner
    engine = DecodeEngine(transformer)
    eager, _ = _run(engine, cuda_generator, "a red cube", 3, "eager")

    def broken_capture(self, entry, body):
        raise RuntimeError("injected: operation not permitted when stream is capturing")

    monkeypatch.setattr(CudaGraphBackend, "capture", broken_capture)
    latents, outcomes = _run(engine, cuda_generator, "a red cube", 3, "auto")
    assert {o.reason for o in outcomes} == {why.CAPTURE_FAILED}
    assert (latents - eager).abs().max().item() <= GRAPH_ATOL


def test_injected_allocation_failure_ends_eager_and_correct(cuda_models, cuda_generator, monkeypatch):
    transformer = _fresh_transformer(cuda_models)  # the engine holds it weakly, like a loaded model's owner
    engine = DecodeEngine(transformer)
    eager, _ = _run(engine, cuda_generator, "a red cube", 3, "eager")
    real_init = DecodeGraphEntry.__init__

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    monkeypatch.setattr(DecodeGraphEntry, "__init__", oom)
    latents, outcomes = _run(engine, cuda_generator, "a red cube", 3, "auto")
    monkeypatch.setattr(DecodeGraphEntry, "__init__", real_init)
    assert {o.reason for o in outcomes} == {why.ALLOCATION_FAILED}
    assert (latents - eager).abs().max().item() <= GRAPH_ATOL


def test_weights_moved_after_capture_never_replay_stale(cuda_models, cuda_generator):
    """Moving the weights (as an offload/reload does) drops the stale graph; that step is eager and correct."""
    transformer = _fresh_transformer(cuda_models)
    engine = DecodeEngine(transformer)
    _run(engine, cuda_generator, "a red cube", 1, "graph")
    transformer.to("cpu")
    transformer.to("cuda")  # new allocations: every weight at a new address
    eager, _ = _run(engine, cuda_generator, "a red cube", 5, "eager")
    latents, outcomes = _run(engine, cuda_generator, "a red cube", 5, "auto")
    assert outcomes[0].reason == why.WEIGHTS_MOVED
    assert [o.path for o in outcomes[1:]] == ["capture", "replay", "replay", "replay"]
    assert (latents - eager).abs().max().item() <= GRAPH_ATOL


def test_offloaded_weights_decode_eager(cuda_models, cuda_generator):
    transformer = _fresh_transformer(cuda_models)
    engine = DecodeEngine(transformer)
    transformer.transformer_blocks[1].img_mlp.to("cpu")
    transformer.transformer_blocks[1].img_mlp.to("cuda")
    transformer.transformer_blocks[0].attn.to_q.weight.data = transformer.transformer_blocks[0].attn.to_q.weight.data.cpu()
    assert why.static_reason(transformer) == why.WEIGHTS_OFF_GPU


def test_generate_cli_path_with_graph_decode(cuda_generator):
    """The main job on the GPU with the default settings (blocks not compiled): two generations, the second replays
    only; statistics reported."""
    first = cuda_generator.generate("a red cube", width=128, height=128, steps=4, seed=0, decode_mode="graph")
    second = cuda_generator.generate("a red cube", width=128, height=128, steps=4, seed=1, decode_mode="graph")
    print("first:", first.stats, first.timings, "second:", second.stats, second.timings)
    assert first.stats["captures"] == 1 and first.stats["replays"] == 4
    assert not first.stats["compiled"] and first.stats["compiles"] == 0
    assert second.stats["captures"] == 0 and second.stats["replays"] == 4 and second.stats["compiles"] == 0
    assert first.images[0].size == (128, 128)


def test_compiled_blocks_follow_new_prompt_lengths(cuda_models, cuda_generator):
    """Each new prompt length changes the prefix K/V shape; compiled blocks must keep working (and stay correct)
    across lengths instead of recompiling per length. Dynamo's unique-graph counter shows how many compiles ran."""
    from torch._dynamo.utils import counters

    transformer = _fresh_transformer(cuda_models)
    engine = DecodeEngine(transformer)
    engine.enable_compile()
    before = counters["stats"]["unique_graphs"]
    prompts = ["a cube", "a red cube on a table", "a red cube on a wooden table in a sunny kitchen, photo"]
    for seed, prompt in enumerate(prompts):
        eager, _ = _run(engine, cuda_generator, prompt, seed, "eager")
        graph, outcomes = _run(engine, cuda_generator, prompt, seed, "graph")
        assert outcomes[0].path == "capture"
        assert (graph - eager).abs().max().item() <= COMPILE_ATOL
    compiles = counters["stats"]["unique_graphs"] - before
    print(f"dynamo graphs compiled for {len(prompts)} prompt lengths: {compiles}")
    assert compiles <= 2 * 2  # static first, then one symbolic recompile, for the static- and the eager-KV body


@pytest.mark.parametrize("batch", [1, 2])
def test_prefix_pass_into_static_buffers_equals_joint_forward(cuda_models, cuda_generator, batch):
    """On the GPU (our Triton kernels, a block-causal bool mask, a claimed entry's static buffers): the sampler's
    prefix-only prefill leaves the joint forward's prefix K/V in the buffers, and step 1 decoded from them (a graph
    capture) equals the joint forward's prediction. fp32, 1e-4 as in tests/test_cached_decode.py: the two split
    attention into different calls."""
    transformer = cuda_models.transformer
    embeds = cuda_generator.encoder.encode("a red cube on a table")
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 6)], "cuda")
    latents = pack(initial_noise(4, batch, 64, 8, 6, torch.float32)).cuda()
    text = embeds.embeds.cuda().expand(batch, -1, -1)
    t = torch.full((batch,), 0.8, device="cuda")
    engine = DecodeEngine(transformer)
    with torch.no_grad():
        pred, joint = DecodeEngine(transformer).prefill(layout, latents, text, t, mode="eager")
        _, alone = engine.prefill(layout, latents, text, t, with_target=False)
        entry = next(iter(engine.graphs.entries.values()))
        assert alone.k[0].data_ptr() == entry.inputs.k[0].data_ptr()  # written into the static buffers
        outcome = engine.decode_step(alone, latents, t)
    assert outcome.path == "capture"
    for a, b in zip(alone.k + alone.v, joint.k + joint.v):
        assert (a - b).abs().max().item() <= GRAPH_ATOL * 10
    assert (outcome.output - pred).abs().max().item() <= GRAPH_ATOL * 10


def test_next_prompt_replays_the_captured_prefix_pass(cuda_models, cuda_generator):
    """The second prompt with a key replays the prefix pass the first one captured (a CUDA graph over our Triton
    kernels and a bool mask), with its own text: its K/V equal an eager prefix pass over the same inputs. Same
    kernels on the same inputs, so expected equal; GRAPH_ATOL allows for a GEMM algorithm picked differently for
    the pool's addresses."""
    from graph_runtime.decode.prefill import run_prefill

    transformer = cuda_models.transformer
    embeds = cuda_generator.encoder.encode("a red cube on a table")
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 6)], "cuda")
    latents = pack(initial_noise(4, 1, 64, 8, 6, torch.float32)).cuda()
    t = torch.full((1,), 0.8, device="cuda")
    engine = DecodeEngine(transformer)
    with torch.no_grad():
        first_text = embeds.embeds.cuda()
        _, first = engine.prefill(layout, latents, first_text, t, with_target=False)
        first.release()
        gc.collect()
        second_text = first_text.flip(1) * 0.5  # another prompt of the same length: same key
        _, second = engine.prefill(layout, latents, second_text, t, with_target=False)
        _, eager = run_prefill(transformer, layout, latents, second_text, t, with_target=False)
    stats = engine.graphs.stats
    assert (stats.prefill_captures, stats.prefill_replays, dict(stats.eager_prefills)) == (1, 2, {})
    for a, b in zip(second.k + second.v, eager.k + eager.v):
        assert (a - b).abs().max().item() <= GRAPH_ATOL


def test_capture_records_no_blas_workspace_memsets_and_restores_the_size():
    """A capture runs its GEMMs without a cuBLAS workspace, so the graph records none of the dynamic scheduler's
    memsets that a capture with the usual workspace records, and the process's workspace size is back afterwards.
    Outputs: the static-schedule kernel may accumulate in another order than the eager one, so the bound is two bf16
    ulps of the output's largest value (2**-7 relative); run eagerly under the capture's settings, the body gets
    the graph's kernel and equals the replay exactly."""
    import types

    import torch.nn.functional as F

    from bench.profile import kernel_names
    from graph_runtime.decode.capture import CaptureRecord

    cuda = torch.backends.cuda
    if not hasattr(cuda, "cublas_workspace_size"):
        pytest.skip("this torch has no torch.backends.cuda.cublas_workspace_size (2.13+): captures keep the workspace")
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    expected = F.linear(x, w)
    before = cuda.cublas_workspace_size(), cuda.cublaslt_workspace_size()
    memsets = {}
    for without in (False, True):
        record = CaptureRecord()
        record.inputs = types.SimpleNamespace(hidden=x)
        backend = CudaGraphBackend()
        backend.capture_without_blas_workspace = without
        backend.capture(record, lambda inputs: F.linear(inputs.hidden, w))
        assert (cuda.cublas_workspace_size(), cuda.cublaslt_workspace_size()) == before
        memsets[without] = sum("memset" in n.lower() for n in kernel_names(record.graph.replay, "cuda"))
        out = backend.replay(record)
        assert torch.allclose(out.float(), expected.float(), rtol=0, atol=expected.abs().max().item() * 2 ** -7)
        with backend.capture_settings():
            assert torch.equal(F.linear(x, w), out)
    assert memsets[False] > 0 and memsets[True] == 0
    assert torch.equal(F.linear(x, w), expected)  # eager GEMMs after the captures: the usual workspace and kernel
