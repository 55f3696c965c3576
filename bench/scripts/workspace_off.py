"""What `CUBLAS_WORKSPACE_CONFIG=:0:0` (no cuBLAS workspace, so no workspace memsets and static-schedule GEMM
kernels) does to the default path's replayed step: sustained and after-idle device time, host time to issue, and
memsets per graph, at 512x512 and 1024x1024. The setting is read once per process, so each setting runs in its
own process, alternated twice to spread the card's warm-up between them.

The pack does not set it (it would also apply to every other model in the ComfyUI process); this measures what a
user who sets it before starting ComfyUI gets.

Run: python bench/scripts/workspace_off.py (full-size random weights on the GPU)."""
import json, os, subprocess, sys, time

CHILD = r"""
import json, time, torch
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.profile import kernel_names
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.runner import _prefixes
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import after_idle_ms, host_ms, sustained_ms

tr = build_transformer()
path = OursPath(PathSpec("graph"), tr)
out = {}
with torch.no_grad():
    for size in (512, 1024):
        inputs = build_inputs(Scenario(f"s{size}", size), tr.config.context_in_dim, tr.config.in_channels, "cuda",
                              torch.bfloat16)
        prefixes = _prefixes(tr, inputs, with_target=False)
        step = path.step(inputs, prefixes)
        step()
        entry = path.engine.manager.entries[prefixes["cond"].graph_key]
        memsets = sum("memset" in name.lower() for name in kernel_names(entry.graph.replay, "cuda"))
        out[size] = {"sustained_ms": round(sustained_ms(entry.graph.replay, "cuda", seconds=4.0), 2),
                     "after_idle_ms": round(after_idle_ms(step, "cuda"), 2),
                     "host_ms": round(host_ms(step, "cuda", iters=50), 3), "memsets": memsets}
        path.engine.release()
        for p in prefixes.values():
            p.release()
print("RESULT", json.dumps(out), flush=True)
"""

if __name__ == "__main__":
    t0 = time.time()
    for label, extra in [("default", {}), ("CUBLAS_WORKSPACE_CONFIG=:0:0", {"CUBLAS_WORKSPACE_CONFIG": ":0:0"})] * 2:
        env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        env.update(extra)
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=400)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[0][7:]) if lines else {"error": proc.stderr[-1500:]}
        print(json.dumps({"setting": label, **result}), flush=True)
    print("wall s", round(time.time() - t0, 1), flush=True)
