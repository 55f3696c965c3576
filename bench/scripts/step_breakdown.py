"""Where a replayed step's device time goes, by kernel kind, at 512x512 and 1024x1024, and the same for a replayed
128-token prefix pass; then the GEMM rates at the decode's row counts (128 prefix rows, 1024 and 4096 target rows)
for each weight layout, and the cuBLAS workspace settings' effect on the memsets recorded with each GEMM.

"span" is the first kernel's start to the last kernel's end in the profiled replay; "busy" the union of kernel time;
the difference is idle time between kernels (launch gaps inside the graph).

Run: python bench/scripts/step_breakdown.py (full-size random weights on the GPU)."""
import gc, json, os, subprocess, sys, time
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from graph_runtime.bench.timing import device_ms, host_ms

KINDS = [("memset", ("memset",)), ("gemm", ("nvjet", "gemm", "cutlass", "splitk")),
         ("attention", ("sdpa", "fmha", "flash", "attention", "cudnn")),
         ("ours", ("norm_modulate", "silu_mul", "qk_norm_rope"))]


def log(**row):
    print(json.dumps(row), flush=True)


def kind_of(name):
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def breakdown(fn):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans, by_kind, count, names = [], {}, {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end
        spans.append((start, end))
        kind = kind_of(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (end - start) / 1e3
        count[kind] = count.get(kind, 0) + 1
        names.setdefault(kind, set()).add(e.name[:70])
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    return {"span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3), "gaps_ms": round((span - busy) / 1e3, 3),
            "kernels": len(spans), "ms_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "count_by_kind": count, "gemm_kernels": sorted(names.get("gemm", ()))[:6],
            "attention_kernels": sorted(names.get("attention", ()))[:3]}


def steps():
    from graph_runtime.bench.model import build_transformer
    from graph_runtime.bench.paths import OursPath, PathSpec
    from graph_runtime.bench.runner import _prefixes
    from graph_runtime.bench.scenarios import Scenario, build_inputs

    tr = build_transformer()
    C, CH = tr.config.context_in_dim, tr.config.in_channels
    path = OursPath(PathSpec("compile+graph", compile=True), tr)
    engine = path.engine
    for size in (512, 1024):
        inputs = build_inputs(Scenario(f"s{size}", size), C, CH, "cuda", torch.bfloat16)
        with torch.no_grad():
            prefixes = _prefixes(tr, inputs, with_target=False)
            step = path.step(inputs, prefixes)
            step()
            entry = engine.manager.entries[prefixes["cond"].graph_key]
            ms = device_ms(step, "cuda", iters=10)
            log(what="decode step replay", size=size, step_ms=round(ms, 2), host_ms=round(host_ms(step, "cuda", 20), 3),
                **breakdown(entry.graph.replay))
            for p in prefixes.values():
                p.release()
            branch = inputs.branches[0]

            def prefill():
                _, prefix = engine.prefill(branch.layout, inputs.hidden_all, branch.embeds, inputs.timestep,
                                           branch=branch.name, with_target=False)
                prefix.release()

            prefill()
            log(what="prefix pass (128 text tokens) as the sampler runs it", size=size,
                prefill_ms=round(device_ms(prefill, "cuda", iters=5, warmup=1), 2), **breakdown(prefill))
        engine.release()
        del inputs, prefixes
        gc.collect()
    del path, engine, tr
    gc.collect()
    torch.cuda.empty_cache()


def gemm_rates():
    d, f = 4096, 12288
    for rows in (128, 1024, 4096):
        x = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (d, f)}
        for name, n, k in [("4096->4096", d, d), ("4096->12288", f, d), ("12288->4096", d, f),
                           ("4096->24576 (gate|up fused)", 2 * f, d)]:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            wt = w.t().contiguous()
            a = x[k]
            row = {"what": "gemm", "rows": rows, "shape": name}
            for layout, fn in [("F.linear W[n,k]", lambda: F.linear(a, w)), ("x @ Wt[k,n]", lambda: a @ wt)]:
                ms = device_ms(fn, "cuda", iters=30, warmup=5)
                row[layout] = {"us": round(ms * 1e3, 1), "tflops": round(2 * rows * n * k / ms / 1e9),
                               "weight_gbs": round(n * k * 2 / ms / 1e6)}
            log(**row)
            del w, wt
        del x
    torch.cuda.empty_cache()


WORKSPACE_PROBE = r"""
import json, os, torch, torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from graph_runtime.bench.timing import device_ms, host_ms
out = {"env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_BLAS_PREFER_CUBLASLT")}}
for rows in (1024, 4096):
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
    def body():
        y = x
        for i in range(96):
            y = F.linear(y, ws[i % 8])
        return y
    body(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
        with torch.cuda.graph(g, stream=s):
            body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay(); torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    out[rows] = {"device_us_per_gemm": round(device_ms(g.replay, "cuda", iters=20) * 1e3 / 96, 1),
                 "host_replay_ms": round(host_ms(g.replay, "cuda", iters=20), 3),
                 "memsets": sum("memset" in n.lower() for n in names), "kernels": len(names),
                 "gemm": sorted({n[:60] for n in names if "memset" not in n.lower()})}
print(json.dumps(out), flush=True)
"""


def workspace_settings():
    variants = [{}, {"CUBLAS_WORKSPACE_CONFIG": ":0:0"},
                {"TORCH_BLAS_PREFER_CUBLASLT": "1"},
                {"TORCH_BLAS_PREFER_CUBLASLT": "1", "CUBLASLT_WORKSPACE_SIZE": "0"}]
    for extra in variants:
        env = dict(os.environ, **extra)
        proc = subprocess.run([sys.executable, "-c", WORKSPACE_PROBE], env=env, capture_output=True, text=True,
                              timeout=300)
        print(proc.stdout.strip() or proc.stderr[-2000:], flush=True)


if __name__ == "__main__":
    t0 = time.time()
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    what = sys.argv[1].split(",") if len(sys.argv) > 1 else ["workspace", "gemm", "steps"]
    if "workspace" in what:
        workspace_settings()
    if "gemm" in what:
        gemm_rates()
    if "steps" in what:
        steps()
    print("wall s", round(time.time() - t0, 1), flush=True)
