"""Core's samplers on the pack's MODEL on a CUDA GPU: their steps replay the captured graphs.

Run on the H200:

    python -m pytest -m gpu tests/gpu/test_gpu_core_sampling.py                        # the runtime's model function
    KVGRAPH_COMFYUI_DIR=/path/to/ComfyUI python -m pytest -m gpu -s tests/gpu/test_gpu_core_sampling.py

With KVGRAPH_COMFYUI_DIR (a ComfyUI checkout whose `comfy` package imports in this Python) the tests drive ComfyUI's
own KSampler / SamplerCustomAdvanced code (tests/core_sampling_driver.py) and the benchmark prints the step time
through KSampler against the KV-Graph Sampler's in the same process (full-size random weights, 1024x1024).

The tiny model runs in fp32 so tolerances are about graph mechanics: a replayed step against an eager one differs by
fp32 round-off (1e-5 on values ~1-5, tests/gpu/test_gpu_decode.py); core's Euler adds a few float32 ulps of latents of
magnitude ~5-20 over 6 steps (tests/test_core_model.py), so 5e-5 between core's path on graphs and the KV-Graph
Sampler decoding eagerly.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comfy_fake.env import close_env, make_env  # noqa: E402

pytestmark = pytest.mark.gpu
REAL_COMFY = os.environ.get("KVGRAPH_COMFYUI_DIR")
STEPS = 6
ATOL = 5e-5


# -- the runtime's model function, no ComfyUI needed ------------------------------------------------------------------


def test_core_style_runs_replay_and_a_second_run_captures_nothing(cuda_models):
    """Core's Euler over the model function on CUDA: the first run captures the decode graph of its shape (every
    call replays it), a second run with the same shapes captures nothing, and the result equals an eager run."""
    from graph_runtime.core_model import ModelFunction, SamplingRun
    from graph_runtime.decode import DecodeEngine
    from tests.gpu.core_calls import core_call_inputs
    from tests.test_core_model import core_euler

    transformer = cuda_models.transformer.float()
    engine = DecodeEngine(transformer)
    source, sigmas, noise = core_call_inputs(cuda_models, STEPS)
    fn = ModelFunction(engine)

    def run(mode):
        before = engine.stats.snapshot()
        with SamplingRun(engine, mode) as sampling:
            out, _ = core_euler(fn, noise, sigmas.cuda(), source, run=sampling)
        return out, engine.stats.delta(before), sampling.counts

    first, stats, counts = run("auto")
    assert stats["captures"] == 1 and stats["replays"] == STEPS and stats["eager_steps"] == {}
    assert counts.paths == {"capture": 1, "replay": STEPS - 1}
    _, stats, _ = run("auto")
    assert stats["captures"] == 0 and stats["prefill_captures"] == 0 and stats["replays"] == STEPS
    eager, stats, _ = run("eager")
    assert stats["eager_steps"] == {"decode mode is eager": STEPS}
    assert (first - eager).abs().max() <= ATOL


# -- ComfyUI's own samplers (KVGRAPH_COMFYUI_DIR) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def core_env():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not REAL_COMFY:
        pytest.skip("set KVGRAPH_COMFYUI_DIR to a ComfyUI checkout: core's samplers come from its comfy package")
    env = make_env(device="cuda", real_comfy=REAL_COMFY)
    try:
        import comfy.sample  # noqa: F401
        import comfy.samplers  # noqa: F401
    except ImportError as exc:
        close_env(env)
        pytest.skip(f"ComfyUI's sampling code does not import in this Python: {exc}")
    yield env
    close_env(env)


@pytest.fixture(scope="module")
def loaded(core_env):
    import core_sampling_driver as driver

    handle, model = driver.run_node(core_env, "KVGraphLoadTransformer", transformer_name="qwen_image_2.1_bf16.safetensors",
                                    dtype="fp32")
    text_encoder, = driver.run_node(core_env, "KVGraphLoadTextEncoder", text_encoder_name="qwen3vl_8b_bf16.safetensors",
                                    dtype="fp32", text_encoder_placement="gpu while encoding, then offload")
    positive, negative, latent = driver.run_node(core_env, "KVGraphTextEncode", text_encoder=text_encoder,
                                                 prompt="a red cube", negative_prompt="", width=256, height=192,
                                                 size_from_reference=True, reference_resolution=256)
    return handle, model, positive, negative, latent


def test_a_second_ksampler_prompt_with_the_same_shapes_captures_nothing(loaded):
    """KSampler on the MODEL: the first prompt captures its decode graph and replays it every step; the second
    queued prompt (another seed, the same shapes) captures nothing and replays every step."""
    import core_sampling_driver as driver

    handle, model, positive, negative, latent = loaded
    engine = handle.engine
    before = engine.stats.snapshot()
    driver.ksampler(model, positive, negative, latent, 1, STEPS, 1.0)
    first = engine.stats.delta(before)
    assert next(handle.module.parameters()).is_cuda
    assert first["eager_steps"] == {} and first["replays"] == STEPS
    before = engine.stats.snapshot()
    driver.ksampler(model, positive, negative, latent, 2, STEPS, 1.0)
    second = engine.stats.delta(before)
    assert second["captures"] == 0 and second["prefill_captures"] == 0
    assert second["replays"] == STEPS and second["eager_steps"] == {}


def test_core_sampling_on_graphs_equals_the_kvgraph_sampler_decoding_eagerly(core_env, loaded):
    """SamplerCustomAdvanced with euler over KV-Graph Sigmas, replaying graphs, gives the KV-Graph Sampler's latents
    computed with no graph at all; the KV-Graph Sampler then replays the graph core's run captured."""
    import core_sampling_driver as driver

    handle, model, positive, negative, latent = loaded
    sigmas, = driver.run_node(core_env, "KVGraphSigmas", model=model, steps=STEPS, sigma_preset="auto",
                              width=1024, height=1024, denoise=1.0, latent=latent)
    core = driver.custom_advanced(model, positive, negative, latent, sigmas, "euler", 1.0, 5)
    engine = handle.engine
    before = engine.stats.snapshot()
    eager = kv_sampler(core_env, handle, positive, latent, 5, "eager")
    assert engine.stats.delta(before)["eager_steps"] == {"decode mode is eager": STEPS}
    assert (core - eager).abs().max() <= ATOL
    before = engine.stats.snapshot()
    kv_sampler(core_env, handle, positive, latent, 6, "auto")
    stats = engine.stats.delta(before)
    assert stats["captures"] == 0 and stats["replays"] == STEPS


def test_a_lora_switch_through_cores_loader_captures_nothing(core_env, loaded):
    """Core's LoraLoaderModelOnly (ComfyUI's own file reading and `load_lora_for_models`) on the MODEL: KSampler with
    the LoRA, with it at another strength, and without it, after a first plain prompt captured the shape: every
    prompt replays every step and captures nothing (the merge writes the weights where the graphs read them), each
    LoRA prompt differs from the plain one, and the weights are their originals bit for bit at the end."""
    import comfy.sd
    import comfy.utils

    import core_sampling_driver as driver
    from graph_runtime.lora.tiny import write_tiny_lora

    handle, model, positive, negative, latent = loaded
    path = write_tiny_lora(core_env.models / "loras" / "kvgraph_gpu_core_lora.safetensors", dtype=torch.float32)
    lora = comfy.utils.load_torch_file(str(path), safe_load=True)
    engine = handle.engine
    plain = driver.ksampler(model, positive, negative, latent, 7, STEPS, 1.0)  # the shape's graphs exist after it
    original = {name: p.detach().clone() for name, p in handle.module.named_parameters()}
    for strength in (1.0, 0.5, 0.0):
        patched = comfy.sd.load_lora_for_models(model, None, lora, strength, 0)[0] if strength else model
        before = engine.stats.snapshot()
        out = driver.ksampler(patched, positive, negative, latent, 7, STEPS, 1.0)
        stats = engine.stats.delta(before)
        assert stats["captures"] == 0 and stats["prefill_captures"] == 0, (strength, stats)
        assert stats["replays"] == STEPS and stats["eager_steps"] == {}, (strength, stats)
        assert torch.equal(out, plain) if strength == 0 else (out - plain).abs().max() > 1e-3
    assert all(torch.equal(p, original[name]) for name, p in handle.module.named_parameters())


def kv_sampler(env, handle, positive, latent, seed, decode_mode):
    import core_sampling_driver as driver

    return driver.run_node(env, "KVGraphSampler", model=handle, positive=positive, latent=latent, seed=seed,
                           steps=STEPS, cfg=1.0, sigma_preset="auto", denoise=1.0, decode_mode=decode_mode,
                           compile="off")[0]["samples"].float()


# -- the benchmark: the step time through KSampler against the KV-Graph Sampler's -------------------------------------

BENCH_STEPS = (10, 40)  # the step time is the difference of two runs' times over the difference of their steps
BENCH_REPEATS = 3


def test_bench_ksampler_step_time_against_the_kvgraph_sampler(core_env):
    """Full-size random weights, 1024x1024, a 128-token prompt, bf16: the time per step of KSampler (euler, cfg 1) on
    the MODEL and of the KV-Graph Sampler on the same engine, each the median over repeats of
    (T(40 steps) - T(10 steps)) / 30, so prefill, conditioning and set-up cancel out. Printed with their ratio; the
    assertions are that every timed step replayed a graph and nothing was captured while timing."""
    import comfy.sample

    from bench.model import build_transformer
    from graph_runtime.comfy_interop.conditioning import prompt_to_conditioning
    from graph_runtime.encoding.prompt import PromptEmbeds
    from graph_runtime.loading import default_scheduler_config
    from tests.owners import loaded_for
    from graph_runtime.sampling.sampler import SamplingRequest, sample

    core_model = sys.modules[f"{core_env.pack.__name__}.nodes.comfyui.core_model"]
    transformer = build_transformer()
    config = default_scheduler_config()
    model = core_model.make_model_patcher(loaded_for(transformer), config, "base", "cuda", "cpu",
                                          size=sum(p.numel() * p.element_size() for p in transformer.parameters()))
    engine = loaded_for(transformer).engine
    generator = torch.Generator("cpu").manual_seed(0)
    embeds = torch.randn(1, 128, transformer.config.context_in_dim, generator=generator).to(torch.bfloat16)
    prompt = PromptEmbeds(embeds, torch.zeros(1, 128, dtype=torch.bool))
    conditioning = prompt_to_conditioning(prompt)
    latent = torch.zeros(1, 64, 64, 64)

    def kvgraph(steps):
        request = SamplingRequest(positive=prompt, latent_height=64, latent_width=64, steps=steps, seed=1,
                                  scheduler_config=config)
        sample(engine, request)

    def ksampler(steps):
        noise = comfy.sample.prepare_noise(latent, 1)
        comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", conditioning, conditioning, latent, seed=1)

    def timed(run, steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run(steps)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for run in (kvgraph, ksampler):  # captures and warm-up, not timed
        run(BENCH_STEPS[0])
    before = engine.stats.snapshot()
    per_step = {"KV-Graph Sampler": [], "KSampler on the MODEL": []}
    for _ in range(BENCH_REPEATS):
        for name, run in (("KV-Graph Sampler", kvgraph), ("KSampler on the MODEL", ksampler)):
            short, long = (timed(run, steps) for steps in BENCH_STEPS)
            per_step[name].append((long - short) / (BENCH_STEPS[1] - BENCH_STEPS[0]) * 1e3)
    stats = engine.stats.delta(before)
    assert stats["captures"] == 0 and stats["eager_steps"] == {}
    assert stats["replays"] == 2 * BENCH_REPEATS * sum(BENCH_STEPS)
    medians = {name: statistics.median(values) for name, values in per_step.items()}
    ratio = medians["KSampler on the MODEL"] / medians["KV-Graph Sampler"]
    print(f"\ncore sampling bench on {torch.cuda.get_device_name()}, 1024x1024, bf16, 128-token prompt:")
    for name, values in per_step.items():
        print(f"  {name:24s} {medians[name]:8.2f} ms/step (runs: {', '.join(f'{v:.2f}' for v in values)})")
    print(f"  KSampler / KV-Graph Sampler step time: {ratio:.3f}")
