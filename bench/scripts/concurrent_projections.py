"""Concurrent projections (q/k/v and the MLP's gate/up on side-by-side CUDA streams) against one after another, in
the default path (compiled blocks in a CUDA graph), alternated on, off, on, off in one process so clock and power
drift show. For each: the step synced per call (the benchmark's median) and queued back to back (as the sampler
runs steps), host time, the prefix pass, graph memory, the SM clock and power, bit-equality of the outputs; then
sampler runs (512x512 40 steps, 1024x1024 Turbo 8 steps) through the process-wide engine.

Run: python bench/scripts/concurrent_projections.py (full-size random weights on the GPU)."""
import gc, json, time
import torch
from graph_runtime.bench.clocks import ClockSampler
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.runner import _prefixes
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import device_ms, host_ms, wall_s
from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.registry import engine_for
from graph_runtime.sampling.sampler import SamplingRequest, sample


def log(**row):
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


def set_concurrent(engine, on):
    for block in engine.step.blocks:
        getattr(block, "_orig_mod", block).concurrent_projections = on


def queued_ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


T0 = time.time()
tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels
path = OursPath(PathSpec("compile+graph", compile=True), tr)
engine = path.engine
outputs = {}
for variant in ("concurrent", "sequential", "concurrent", "sequential"):
    on = variant == "concurrent"
    set_concurrent(engine, on)
    for size in (512, 1024):
        engine.release()
        inputs = build_inputs(Scenario(f"s{size}", size), C, CH, "cuda", torch.bfloat16)
        branch = inputs.branches[0]
        with torch.no_grad():
            prefixes = _prefixes(tr, inputs, with_target=False)
            step = path.step(inputs, prefixes)
            out = step()[0]
            entry = engine.manager.entries[prefixes["cond"].graph_key]
            with ClockSampler("cuda") as clocks:
                synced = device_ms(step, "cuda", iters=10)
                queued = queued_ms(step)
            host = host_ms(step, "cuda", iters=20)
            prev = outputs.setdefault(size, out)
            for p in prefixes.values():
                p.release()

            def prefill():
                _, prefix = engine.prefill(branch.layout, inputs.hidden_all, branch.embeds, inputs.timestep,
                                           branch=branch.name, with_target=False)
                prefix.release()

            prefill()
            prefill_ms = device_ms(prefill, "cuda", iters=5, warmup=1)
        log(variant=variant, size=size, step_synced_ms=synced, step_queued_ms=queued, host_ms=host,
            prefill_ms=prefill_ms, graph_gib=entry.pool_bytes / 2**30, max_abs_vs_first=(out - prev).abs().max().item(),
            eager_steps=engine.manager.stats.snapshot()["eager_steps"], **clocks.summary())
        del inputs, prefixes, step, out
        gc.collect()
engine.release()
del path, engine
gc.collect()

sampler_engine = engine_for(tr)
for variant in ("concurrent", "sequential", "concurrent", "sequential"):
    set_concurrent(sampler_engine, variant == "concurrent")
    sampler_engine.release()
    for size, steps, preset in [(512, 40, "dynamic"), (1024, 8, "turbo")]:
        inputs = build_inputs(Scenario(f"s{size}", size), C, CH, "cuda", torch.bfloat16)
        branch = inputs.branches[0]
        request = SamplingRequest(positive=PromptEmbeds(branch.embeds[:1], branch.vlm_mask.bool()),
                                  latent_height=size // 16, latent_width=size // 16, steps=steps,
                                  sigma_preset=preset, decode_mode="auto", seed=1)
        sample(sampler_engine, request)  # the shape's first prompt: capture
        result, wall = wall_s(lambda: sample(sampler_engine, request), "cuda")
        t = result.timings
        log(variant=variant, sampler=f"{size} x {steps} steps", dit_total_ms=t["prefill_ms"] + t["decode_ms_total"],
            prefill_ms=t["prefill_ms"], decode_ms_per_step=t["decode_ms_per_step"], wall_s=wall,
            captures=result.stats["captures"], replays=result.stats["replays"])
        del inputs, result
sampler_engine.release()
print("wall s", round(time.time() - T0, 1), flush=True)
