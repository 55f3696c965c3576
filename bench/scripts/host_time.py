"""Where the host time of a replayed decode step and of a sampler's prefill goes, on the default path (graph, blocks
not compiled), at 512x512 and 1024x1024:

(1) a decode step as the sampler issues it (`engine.decode`), against the graph launch alone (`graph.replay()`),
    the per-step checks alone, and a cProfile of 50 steps; the number of memset nodes cuBLAS put in the graph.
(2) the same graph captured with cuBLAS split-K disallowed (`allow_bf16_reduced_precision_reduction = (False,
    False)`, set around the capture only): its memsets, launch and step time, and how far its output is from the
    default capture's.
    (The step's inputs and output were also copied with one `_foreach_copy_` kernel instead of `copy_`/`clone`'s
    memcpys: no difference (host-time-20261202T1939.log); that code stays in commit ae4e58f.)
(3) a prompt's prefill as the sampler runs it (prefix pass replayed), with the module-tree scan kept from the last
    prompt when the tree is unchanged, against a fresh walk at every prompt (the behaviour before that change).

Run: python bench/scripts/host_time.py (full-size random weights on the GPU)."""
import cProfile, io, json, pstats, statistics, time
import torch

from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.profile import kernel_names
from graph_runtime.bench.runner import _prefixes, sampler_prefill
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import device_ms, host_ms
from graph_runtime.decode import eligibility as why


def log(**row):
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


def memsets(fn):
    names = kernel_names(fn, "cuda")
    return sum("memset" in n.lower() for n in names), len(names)


def cprofile(fn, n, title, lines=18):
    profiler = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        profiler.enable()
        fn()
        profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    print(f"--- cProfile of {n} {title}, by tottime ---")
    print("\n".join(line[:170] for line in text.getvalue().splitlines()[6:]), flush=True)


def issue_ways(step, entry, n=40):
    """The host time of issuing one step, measured four ways: after a sync (the benchmark's way); after a sync and
    1 ms of busy Python (a CPU that was not just waiting); behind a ~50 ms GPU sleep with no sync in the timed
    region (how the sampler issues steps: it never syncs between them); and CPU time after a sync. The same for
    the step's parts: the graph launch alone, and a 2-element copy_."""
    small_dst, small_src = torch.zeros(2, device="cuda"), torch.ones(2, device="cuda")
    cycles = int(50e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    parts = {"decode step": step, "graph launch": entry.graph.replay,
             "copy_ of 2 elements": lambda: small_dst.copy_(small_src),
             "_foreach_copy_ of 2 elements": lambda: torch._foreach_copy_([small_dst], [small_src]),
             "add_ of 2 elements": lambda: small_dst.add_(small_src)}
    for name, fn in parts.items():
        row = {}
        for way in ("after sync", "after sync + 1 ms busy", "behind a GPU sleep", "CPU time after sync"):
            times = []
            for _ in range(n):
                torch.cuda.synchronize()
                if way == "after sync + 1 ms busy":
                    end = time.perf_counter() + 1e-3
                    while time.perf_counter() < end:
                        pass
                elif way == "behind a GPU sleep":
                    torch.cuda._sleep(cycles)
                clock = time.thread_time if way.startswith("CPU") else time.perf_counter
                t0 = clock()
                fn()
                times.append((clock() - t0) * 1e3)
            torch.cuda.synchronize()
            row[way] = round(statistics.median(times), 4)
        log(what="host ms to issue, 1024x1024", part=name, **row)


T0 = time.time()
tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels
path = OursPath(PathSpec("graph"), tr)
engine = path.engine
manager = engine.manager

with torch.no_grad():
    for size in (512, 1024):
        inputs = build_inputs(Scenario(f"s{size}", size), C, CH, "cuda", torch.bfloat16)
        prefixes = _prefixes(tr, inputs, with_target=False)
        step = path.step(inputs, prefixes)
        default_out = step()[0]
        entry = manager.entries[prefixes["cond"].graph_key]
        prefix = prefixes["cond"]
        checks = lambda: manager._blocker(prefix.k[0].dtype, prefix.key_valid, manager._fingerprint())  # noqa: E731
        n_memsets, n_kernels = memsets(entry.graph.replay)
        if size == 1024:
            issue_ways(step, entry)
        log(what="decode step, default capture", size=size, device_ms=device_ms(step, "cuda", iters=10),
            host_decode_ms=host_ms(step, "cuda", iters=50),
            host_graph_launch_ms=host_ms(entry.graph.replay, "cuda", 50), host_checks_ms=host_ms(checks, "cuda", 50), memsets=n_memsets, kernels=n_kernels)
        cprofile(step, 50, f"{size}x{size} decode steps")

        # The same graph captured with split-K disallowed around the capture only.
        manager.release()
        old = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        old_library = torch.backends.cuda.preferred_blas_library()
        try:
            # torch accepts split-K off only through cuBLASLt and with reduced-precision reductions off too.
            torch.backends.cuda.preferred_blas_library("cublaslt")
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
            no_split_out = step()[0]
        except Exception as exc:  # an older torch has no split-K switch
            log(what="split-K switch unavailable", error=f"{type(exc).__name__}: {exc}"[:300])
            no_split_out = None
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old
            torch.backends.cuda.preferred_blas_library(old_library)
        if no_split_out is not None:
            entry = manager.entries[prefixes["cond"].graph_key]
            n_memsets, n_kernels = memsets(entry.graph.replay)
            diff = no_split_out.float() - default_out.float()
            log(what="decode step, cuBLASLt with split-K disallowed at capture", size=size,
                device_ms=device_ms(step, "cuda", iters=10), host_decode_ms=host_ms(step, "cuda", iters=50),
                host_graph_launch_ms=host_ms(entry.graph.replay, "cuda", 50), memsets=n_memsets, kernels=n_kernels,
                max_abs_vs_default=diff.abs().max().item(),
                rel_l2_vs_default=(diff.norm() / default_out.float().norm()).item())
        manager.release()
        for p in prefixes.values():
            p.release()
        del inputs, prefixes, step, entry

    prefill = sampler_prefill(engine, build_inputs(Scenario("s1024", 1024), C, CH, "cuda", torch.bfloat16))

    for setting in ("scan kept when the tree is unchanged", "tree walked at every prompt"):
        if setting.startswith("tree walked"):
            why.ModelScan.stale = lambda self: True
        for _ in range(3):
            prefill()
        torch.cuda.synchronize()
        host = [host_ms(prefill, "cuda", iters=1) for _ in range(20)]
        log(what="prefill 1024, prefix pass replayed", setting=setting,
            device_span_ms=device_ms(prefill, "cuda", iters=10, warmup=1), host_ms=statistics.median(host),
            prefill_replays=manager.stats.prefill_replays)
        cprofile(prefill, 20, f"prefills ({setting})", lines=10)
print("wall s", round(time.time() - T0, 1), flush=True)
