"""cuBLAS against cuBLASLt as PyTorch's GEMM library for the captured decode step: step time, host time of a
replay, and kernels per step (cuBLAS records a workspace memset with many of its GEMMs; each is a graph node to
launch). Alternated cublas, cublaslt, cublas so clock and power drift show.

Run: python bench/scripts/blas_library.py (full-size random weights on the GPU)."""
import gc, json, time
import torch
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.profile import kernel_names
from graph_runtime.bench.runner import _prefixes
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import device_ms, host_ms

T0 = time.time()
tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels
path = OursPath(PathSpec("compile+graph", compile=True), tr)
for library in ("cublas", "cublaslt", "cublas"):
    torch.backends.cuda.preferred_blas_library(library)
    for size in (512, 1024):
        inputs = build_inputs(Scenario(f"s{size}", size), C, CH, "cuda", torch.bfloat16)
        with torch.no_grad():
            prefixes = _prefixes(tr, inputs, with_target=False)
            step = path.step(inputs, prefixes)
            out = step()[0]
            entry = path.engine.manager.entries[prefixes["cond"].graph_key]
            names = kernel_names(entry.graph.replay, "cuda")
            row = {"library": library, "size": size, "decode_ms": round(device_ms(step, "cuda", iters=10), 2),
                   "host_ms": round(host_ms(step, "cuda", iters=20), 3), "kernels": len(names),
                   "memsets": sum("memset" in n.lower() for n in names),
                   "gemm_kernels": sorted({n[:60] for n in names if "gemm" in n.lower() or "nvjet" in n.lower()}),
                   "output_abs_max": out.float().abs().max().item()}
            print(json.dumps(row), flush=True)
            for p in prefixes.values():
                p.release()
        path.engine.release()
        del inputs, prefixes
        gc.collect()
print("wall s", round(time.time() - T0, 1))
