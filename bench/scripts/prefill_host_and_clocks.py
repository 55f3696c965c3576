"""(1) Where the host time of a replayed prefill goes: a 1024x1024 prompt's 128-token prefix pass as the sampler runs
it (the entry's captured pass replayed), timed on the host and on the device, then a cProfile of 20 of them.
(2) What holds the clock down: each decode shape replayed back to back for ~5 s with the SM clock, power and the
driver's clock event reasons sampled, then one replay after 3 s idle.

Run: python bench/scripts/prefill_host_and_clocks.py (full-size random weights on the GPU)."""
import cProfile, io, json, pstats, statistics, time
import torch
from graph_runtime.bench.clocks import ClockSampler
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.runner import _prefixes, sampler_prefill
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import device_ms, host_ms


def log(**row):
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


T0 = time.time()
tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels
path = OursPath(PathSpec("compile+graph", compile=True), tr)
engine = path.engine

with torch.no_grad():
    inputs = build_inputs(Scenario("s1024", 1024), C, CH, "cuda", torch.bfloat16)
    prefill = sampler_prefill(engine, inputs)

    for _ in range(3):
        prefill()
    torch.cuda.synchronize()
    log(what="prefill 1024 (prefix pass replayed)", device_ms=device_ms(prefill, "cuda", iters=10, warmup=1),
        host_ms=host_ms(prefill, "cuda", iters=10), replays=engine.manager.stats.prefill_replays)
    profiler = cProfile.Profile()
    for _ in range(20):
        torch.cuda.synchronize()
        profiler.enable()
        prefill()
        profiler.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(28)
        print(f"--- cProfile of 20 prefills, by {key} ---")
        print("\n".join(line[:170] for line in text.getvalue().splitlines()[6:]), flush=True)

    for size in (512, 1024):
        engine.release()
        inputs = build_inputs(Scenario(f"s{size}", size), C, CH, "cuda", torch.bfloat16)
        prefixes = _prefixes(tr, inputs, with_target=False)
        step = path.step(inputs, prefixes)
        step()
        entry = engine.manager.entries[prefixes["cond"].graph_key]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays = 0
        with ClockSampler("cuda", period_ms=50) as clocks:
            start.record()
            t_end = time.time() + 5
            while time.time() < t_end:
                for _ in range(10):
                    entry.graph.replay()
                replays += 10
                torch.cuda.current_stream().synchronize()
            end.record()
            end.synchronize()
        sustained = start.elapsed_time(end) / replays
        idle = []
        for _ in range(3):
            time.sleep(3)
            start.record()
            entry.graph.replay()
            end.record()
            end.synchronize()
            idle.append(start.elapsed_time(end))
        log(what="replays back to back for 5 s, then single replays after 3 s idle", size=size,
            sustained_ms_per_replay=sustained, after_idle_ms=[round(t, 2) for t in idle],
            after_idle_median_ms=statistics.median(idle), **clocks.summary(),
            clock_samples=len(clocks.samples),
            reasons_seen=sorted({hex(m) for _, _, m in clocks.samples if m is not None}))
        for p in prefixes.values():
            p.release()
engine.release()
print("wall s", round(time.time() - T0, 1), flush=True)
