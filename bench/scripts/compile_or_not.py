"""Compiled blocks or not, now that our kernels do the fusing: (1) the captured step with and without compiled blocks,
alternated three times in one process at 512x512 and 1024x1024 (synced per call, as the benchmark times, and queued
back to back, as the sampler runs), with bit-equality of the outputs; (2) a fresh process per setting running the
product sampler twice at 1024x1024, 40 steps (a first prompt after loading, then a queued second one).

Run: python bench/scripts/compile_or_not.py (full-size random weights on the GPU)."""
import json, subprocess, sys, time
import torch

FRESH = r"""
import json, sys, time, torch
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.registry import engine_for
from graph_runtime.sampling.sampler import SamplingRequest, sample
tr = build_transformer()
inputs = build_inputs(Scenario("s1024", 1024), tr.config.context_in_dim, tr.config.in_channels, "cuda", torch.bfloat16)
branch = inputs.branches[0]
engine = engine_for(tr)
for run in ("first prompt", "second prompt"):
    request = SamplingRequest(positive=PromptEmbeds(branch.embeds[:1], branch.vlm_mask.bool()), latent_height=64,
                              latent_width=64, steps=40, compile=sys.argv[1] == "blocks", seed=1)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    result = sample(engine, request)
    torch.cuda.synchronize()
    print(json.dumps({"compile": sys.argv[1], "run": run, "wall_s": round(time.perf_counter() - t0, 3),
                      "prefill_ms": round(result.timings["prefill_ms"], 1),
                      "decode_ms_per_step": round(result.timings["decode_ms_per_step"], 2),
                      "captures": result.stats["captures"], "compiles": result.stats["compiles"]}), flush=True)
"""


def log(**row):
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


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


def alternated():
    from graph_runtime.bench.model import build_transformer
    from graph_runtime.bench.paths import OursPath, PathSpec
    from graph_runtime.bench.runner import _prefixes
    from graph_runtime.bench.scenarios import Scenario, build_inputs
    from graph_runtime.bench.timing import device_ms, wall_s

    tr = build_transformer()
    C, CH = tr.config.context_in_dim, tr.config.in_channels
    paths = {"graph": OursPath(PathSpec("graph"), tr), "compile+graph": OursPath(PathSpec("compile+graph", compile=True), tr)}
    for size in (512, 1024):
        inputs = build_inputs(Scenario(f"s{size}", size), C, CH, "cuda", torch.bfloat16)
        with torch.no_grad():
            steps, outs = {}, {}
            for name, path in paths.items():
                prefixes = _prefixes(tr, inputs, with_target=False)
                steps[name] = path.step(inputs, prefixes)
                outs[name], first_s = wall_s(lambda: steps[name]()[0], "cuda")
                log(size=size, path=name, first_call_s=first_s)
            log(size=size, max_abs_graph_vs_compiled=(outs["graph"] - outs["compile+graph"]).abs().max().item())
            for round_ in range(3):
                for name in paths:
                    log(size=size, round=round_, path=name, step_synced_ms=device_ms(steps[name], "cuda", iters=10),
                        step_queued_ms=queued_ms(steps[name]))
        for path in paths.values():
            path.engine.release()


if __name__ == "__main__":
    t0 = time.time()
    alternated()
    torch.cuda.empty_cache()
    for setting in ("off", "blocks"):
        proc = subprocess.run([sys.executable, "-c", FRESH, setting], capture_output=True, text=True, timeout=400)
        print(proc.stdout.strip() or proc.stderr[-3000:], flush=True)
    print("wall s", round(time.time() - t0, 1), flush=True)
