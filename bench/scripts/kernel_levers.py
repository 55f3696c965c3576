"""Kernel levers at 1024x1024 and 512x512: each variant of the decode step compiled and captured in one process.

Variants: inductor only ("base"), + the q/k norm/RoPE/K-V kernel ("qk"), + the residual/norm/modulation kernel
("qk+norms"), each also with inductor coordinate-descent tuning ("+cdt"). For each: median step time, host time,
graph-launch host time, kernel time summed over a replayed graph, error vs an fp32 run relative to diffusers' bf16
error; for two variants the SM clock and power while replaying back to back, and one replay after 3 s idle; then
the peak memory of the product sampler (t2i, edit after t2i, edit from a released engine).
Run on the GPU: `python bench/scripts/kernel_levers.py` (results: bench/results/kernel-levers-20261202T1305.log).
"""
import gc, json, os, statistics, subprocess, sys, time
import torch
import torch._inductor.config as ic
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.paths import OursPath, PathSpec, reference_caches, reference_step
from graph_runtime.bench.runner import _prefixes, _fp32_references
from graph_runtime.bench.timing import device_ms, host_ms
from graph_runtime.bench import quality
from graph_runtime.decode import step as step_mod

def log(*a):
    print(*a, flush=True)

tr = build_transformer()
cfg = tr.config
C, CH = cfg.context_in_dim, cfg.in_channels
refs = _fp32_references(tr, [Scenario("s1024", 1024, quality=True)], "cuda", C, CH)
inputs_by = {s: build_inputs(Scenario(f"s{s}", s), C, CH, "cuda", torch.bfloat16) for s in (1024, 512)}
# diffusers error at 1024
with torch.no_grad():
    pre = _prefixes(tr, inputs_by[1024]); caches = reference_caches(pre)
    dout = reference_step(tr, inputs_by[1024], caches)()
    derr = quality.relative_error(dout, refs["s1024"])
    for p in pre.values(): p.release()
log("diffusers rel err", derr)

orig_rope = step_mod.apply_rope
def flip_rope(x, cos, sin):
    if not torch.compiler.is_compiling():
        return orig_rope(x, cos, sin)
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    c = cos.repeat_interleave(2, -1)
    s = torch.stack((-sin, sin), -1).flatten(-2)
    return (xf * c + swapped * s).to(x.dtype)

VARIANTS = {
    "base": dict(qk=False, norms=False, cdt=False, rope=orig_rope),
    "qk": dict(qk=True, norms=False, cdt=False, rope=orig_rope),
    "qk+norms": dict(qk=True, norms=True, cdt=False, rope=orig_rope),
    "qk+norms+cdt": dict(qk=True, norms=True, cdt=True, rope=orig_rope),
    "base+cdt": dict(qk=False, norms=False, cdt=True, rope=orig_rope),
}
results = {}
keep = {}
only = sys.argv[1].split(",") if len(sys.argv) > 1 else ["base", "qk+norms", "qk", "qk+norms+cdt", "base+cdt"]
for name in only:
    v = VARIANTS[name]
    torch._dynamo.reset()
    step_mod.apply_rope = v["rope"]
    ic.coordinate_descent_tuning = v["cdt"]
    path = OursPath(PathSpec(name, compile=True), tr)
    for blk in path.engine.step.blocks:
        blk.fuse_qk, blk.fuse_norms = v["qk"], v["norms"]
    for size in (1024, 512):
        inputs = inputs_by[size]
        with torch.no_grad():
            prefixes = _prefixes(tr, inputs)
            st = path.step(inputs, prefixes)
            t0 = time.perf_counter(); out = st(); torch.cuda.synchronize(); first = time.perf_counter() - t0
            ms = device_ms(st, "cuda", iters=20, warmup=3)
            h = host_ms(st, "cuda", iters=10)
            row = dict(variant=name, size=size, ms=round(ms, 2), host_ms=round(h, 3), first_s=round(first, 1),
                       stats=path.engine.manager.stats.snapshot()["eager_steps"])
            if size == 1024:
                err = quality.relative_error(out, refs["s1024"])
                row.update(err_ratio=round(err / derr, 3))
                if name == "base":
                    keep["base"] = out
                elif "base" in keep:
                    row["vs_base_maxabs"] = quality.max_abs(out, keep["base"])
                # host breakdown: graph.replay alone
                entry = next(e for e in path.engine.manager.entries.values() if getattr(e, "graph", None) is not None)
                torch.cuda.synchronize()
                ts = []
                for _ in range(10):
                    torch.cuda.synchronize(); t0 = time.perf_counter(); entry.graph.replay(); ts.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
                row["replay_host_ms"] = round(statistics.median(ts), 3)
                # kernel sum in a replay
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        entry.graph.replay()
                    torch.cuda.synchronize()
                evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                row["kernel_sum_ms_per_step"] = round(sum(e.time_range.elapsed_us() for e in evs) / 1e3 / 3, 2)
                row["kernels_per_step"] = len(evs) / 3
                if name in ("base", "qk+norms"):
                    log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=80))
                    # sustained clocks
                    q = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active", "--format=csv,noheader", "-lms", "250"], stdout=subprocess.PIPE, text=True)
                    t_end = time.time() + 4
                    n = 0
                    while time.time() < t_end:
                        entry.graph.replay(); n += 1
                        if n % 8 == 0: torch.cuda.synchronize()
                    torch.cuda.synchronize(); q.terminate(); outtxt = q.communicate()[0]
                    log("clocks during sustained replay:\n" + outtxt)
                    time.sleep(3)
                    # single replay after idle
                    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                    e0.record(); entry.graph.replay(); e1.record(); e1.synchronize()
                    row["after_idle_ms"] = round(e0.elapsed_time(e1), 2)
            log(json.dumps(row))
            results.setdefault(name, []).append(row)
            for p in prefixes.values(): p.release()
            del out
    path.engine.release(); del path; gc.collect(); torch.cuda.empty_cache()

log(subprocess.run(["nvidia-smi", "--query-gpu=power.limit,enforced.power.limit,clocks.max.sm,clocks.sm", "--format=csv"], capture_output=True, text=True).stdout)

# memory: edit from a fresh engine, product path
from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.registry import engine_for
from graph_runtime.sampling.sampler import SamplingRequest, sample
step_mod.apply_rope = orig_rope
ic.coordinate_descent_tuning = False
torch._dynamo.reset()
engine = engine_for(tr)
for label, refs_n, steps in [("t2i", 0, 4), ("edit1", 1, 4), ("edit1-fresh", 1, 4)]:
    if label == "edit1-fresh":
        engine.release(); gc.collect(); torch.cuda.empty_cache()
    inputs = build_inputs(Scenario(label, 1024, references=refs_n), C, CH, "cuda", torch.bfloat16)
    b = inputs.branches[0]
    embeds = PromptEmbeds(b.embeds[:1], b.vlm_mask.bool())
    rl = [inputs.cond_tokens[:1].transpose(1, 2).reshape(1, CH, 64, 64)] if refs_n else []
    req = SamplingRequest(positive=embeds, latent_height=64, latent_width=64, reference_latents=rl, steps=steps,
                          sigma_preset="dynamic", decode_mode="auto", seed=0)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base_alloc = torch.cuda.memory_allocated() / 2**30
    res = sample(engine, req)
    torch.cuda.synchronize()
    log(json.dumps(dict(run=label, alloc_before_gib=round(base_alloc, 2), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                        held_gib=round(engine.manager.bytes_held() / 2**30, 2), prefill_ms=round(res.timings["prefill_ms"], 1),
                        decode=round(res.timings["decode_ms_per_step"], 2), stats=res.stats)))
    del res, inputs
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "explore.json"), "w"), indent=1, default=str)

# generated code for reading: the inductor cache's python modules
import glob, tarfile, getpass
root = f"/tmp/torchinductor_{getpass.getuser()}"
files = [f for f in glob.glob(root + "/**/*.py", recursive=True) if os.path.getsize(f) < 400_000]
with tarfile.open(os.path.join(os.environ.get("OUT", "/tmp"), "inductor_code.tgz"), "w:gz") as tar:
    for f in files:
        tar.add(f, arcname=os.path.relpath(f, root))
log("inductor files", len(files))
