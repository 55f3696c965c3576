"""Host cost of launching a CUDA graph: trivial kernels vs cuBLAS GEMMs (each with the workspace memset cuBLAS adds).

Run on the GPU: `python bench/scripts/graph_launch_cost.py` (results: bench/results/graph-launch-cost-20261202T1311.log).
"""
import statistics, time, torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

def host_replay(g, n=30):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); g.replay(); ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(ts) * 1e3, 4)

x = torch.zeros(1 << 16, device="cuda")
for n in (50, 200, 700):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1)
    g.replay(); torch.cuda.synchronize()
    print("graph of", n, "add kernels: host replay ms", host_replay(g), flush=True)

a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    F.linear(a, w); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            F.linear(a, w)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(lib, "per linear:", {n[:60]: names.count(n) / 5 for n in set(names)}, flush=True)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        F.linear(a, w)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(100):
            out = F.linear(a, w)
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record(); g.replay(); e1.record(); e1.synchronize()
    print(lib, "graph of 100 linears: host replay ms", host_replay(g, 10), "device ms per linear", round(e0.elapsed_time(e1) / 100, 4), flush=True)
torch.backends.cuda.preferred_blas_library("cublas")
