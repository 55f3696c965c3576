"""What capturing without a cuBLAS workspace (`graph_entry.without_blas_workspace`, the default) does to the default
path's replayed step, against a capture with the process's usual workspace: memsets and kernels per graph, host
time to issue a replay, sustained and after-idle device time, and the output's difference, at 512x512 and
1024x1024, alternated twice in one process. It also checks that the process's workspace size is back after each
capture and that an eager GEMM outside the graph still gets the workspace kernel (with its memset).

Run: python bench/scripts/capture_workspace.py (full-size random weights on the GPU)."""
import json, time
import torch
import torch.nn.functional as F

from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.profile import kernel_names
from graph_runtime.bench.runner import _prefixes
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import after_idle_ms, host_ms, sustained_ms

T0 = time.time()
cuda = torch.backends.cuda
api = hasattr(cuda, "cublas_workspace_size")
print(json.dumps({"torch": torch.__version__, "workspace_api": api,
                  "workspace_bytes": cuda.cublas_workspace_size() if api else None}), flush=True)
tr = build_transformer()
path = OursPath(PathSpec("graph"), tr)
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    for size in (512, 1024):
        inputs = build_inputs(Scenario(f"s{size}", size), tr.config.context_in_dim, tr.config.in_channels, "cuda",
                              torch.bfloat16)
        reference = None
        for off in (False, True, False, True):
            path.engine.manager.backend.capture_without_blas_workspace = off
            before = cuda.cublas_workspace_size() if api else None
            prefixes = _prefixes(tr, inputs, with_target=False)
            step = path.step(inputs, prefixes)
            out = step()[0]
            entry = path.engine.manager.entries[prefixes["cond"].graph_key]
            names = kernel_names(entry.graph.replay, "cuda")
            eager_names = kernel_names(lambda: F.linear(a, w), "cuda")
            sustained = sustained_ms(entry.graph.replay, "cuda")
            reference = out if reference is None else reference
            print(json.dumps({
                "size": size, "capture": "no workspace" if off else "usual workspace",
                "memsets": sum("memset" in n.lower() for n in names), "kernels": len(names),
                "host_ms": round(host_ms(step, "cuda", iters=50), 3),
                "sustained_ms": round(sustained, 2),
                "after_idle_ms": round(after_idle_ms(step, "cuda"), 2),
                "max_abs_vs_first": (out.float() - reference.float()).abs().max().item(),
                "workspace_restored": (cuda.cublas_workspace_size() == before) if api else None,
                "eager_gemm_after": [n[:60] for n in eager_names]}), flush=True)
            path.engine.release()
            for p in prefixes.values():
                p.release()
print("wall s", round(time.time() - T0, 1), flush=True)
