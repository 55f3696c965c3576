"""`python -m bench`: decode-step speed, memory and quality of every path, in one process.

Phases: (1) fp32 reference outputs for the quality scenarios (an fp32 copy of the weights, freed afterwards);
(2) every scenario x path: prefill, decode step (median CUDA-event time), host time, capture/compile time, peak
and held memory, FLOPs, ratios to the diffusers reference and to the bf16 roofline, and the quality guard;
(3) amortization: two sampler runs back to back with equal shapes, through the process-wide engine, as a second
queued prompt would see it, and one of each length after the card idled, as a lone prompt would. Results go to
`bench/results/` as markdown and JSON with the command that made them.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from graph_runtime.decode import DecodeEngine
from graph_runtime.decode.attention import ATTENTION_CHOICES, FP8

from . import quality
from .model import build_transformer, fp32_copy
from .paths import ALL_PATHS, DEFAULT_PATHS, OursPath, reference_caches, reference_prefill, reference_step
from .report import write_reports
from .scenarios import (DEFAULT_SCENARIOS, LARGE_SCENARIOS, QUICK_SCENARIOS, TINY_SCENARIOS, build_inputs, decode_flops,
                        describe, prefill_flops)
from .clocks import ClockSampler
from .timing import after_idle_ms, device_ms, host_ms, wall_s

PEAK_TFLOPS = float(os.environ.get("PEAK_TFLOPS", "790"))


def _select_scenarios(spec: str, tiny: bool):
    if tiny:
        return TINY_SCENARIOS
    pool = {s.name: s for s in DEFAULT_SCENARIOS + QUICK_SCENARIOS + LARGE_SCENARIOS}
    if spec == "default":
        return DEFAULT_SCENARIOS
    if spec == "quick":
        return QUICK_SCENARIOS
    return [pool[name] for name in spec.split(",")]


def _select_paths(spec: str, device):
    specs = ALL_PATHS
    if spec == "default":
        specs = [p for p in ALL_PATHS if p.name in DEFAULT_PATHS]
    elif spec != "all":
        wanted = spec.split(",")
        specs = [p for p in ALL_PATHS if p.name in wanted or p.reference]
    if torch.device(device).type != "cuda":
        specs = [p for p in specs if p.reference or p.mode == "eager"]  # nothing is captured off CUDA
    return specs


def _prefixes(engine, inputs, with_target=True):
    """Every branch's prefill, eager and unclaimed (no graph entry): the prefix caches every path decodes from."""
    prefixes = {}
    for branch in inputs.branches:
        _, prefixes[branch.name] = engine.prefill(branch.layout, inputs.hidden_all, branch.embeds, inputs.timestep,
                                                  branch=branch.name, mode="eager", with_target=with_target)
    return prefixes


def sampler_prefill(engine, inputs):
    """A prompt's prefill as the sampler runs it on a graph path (prefix rows alone, into the claimed entry), as a
    callable. Each prefix is released at once, as a finished prompt's is, so the next call may claim the entry."""

    def prefill():
        for branch in inputs.branches:
            _, prefix = engine.prefill(branch.layout, inputs.hidden_all, branch.embeds, inputs.timestep,
                                       branch=branch.name, with_target=False)
            prefix.release()

    return prefill


def _engine_prefill_ms(engine, inputs, device) -> float:
    """The sampler's prefill time: the first call captures the entry's prefix pass (warm-up, not timed), later
    prompts replay it."""
    return device_ms(sampler_prefill(engine, inputs), device, iters=3, warmup=1)


def _fp32_references(transformer, scenarios, device, context, channels):
    wanted = [s for s in scenarios if s.quality]
    if not wanted:
        return {}
    refs = {}
    model32 = fp32_copy(transformer)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference, not TF32
    try:
        for scenario in wanted:
            inputs = build_inputs(scenario, context, channels, device, torch.bfloat16).to(torch.float32)
            with torch.no_grad():
                caches = reference_caches(_prefixes(DecodeEngine(model32), inputs))
                refs[scenario.name] = [o.cpu() for o in reference_step(model32, inputs, caches)()]
            del inputs, caches
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        del model32
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return refs


def _weight_bytes(module) -> int:
    """A module's weights in bytes (int8 layers at one byte per weight, their scales included)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _weights_gb(model) -> float:
    """The whole model's weights in GiB: the blocks, and the embeddings, shared modulation and output layers that
    every precision keeps in bf16."""
    return _weight_bytes(model) / 2**30


def _block_weights_gb(model) -> float:
    """The transformer blocks' weights alone, in GB (10^9 bytes): what a precision quantizes."""
    return sum(_weight_bytes(block) for block in model.transformer_blocks) / 1e9


def _peak_reset(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def run_scenario(transformer, scenario, path_specs, engines, refs, device, iters, context, channels,
                 fp8_verdicts=None):
    """Every path on one scenario. `fp8_verdicts`: {precision: {scenario: verdict}} from `fp8_quality`: an FP8
    path's guard is that bound (its error within INT8 ConvRot's), not the bf16 paths' 10% of diffusers' error."""
    rows = []
    with torch.no_grad():
        inputs = build_inputs(scenario, context, channels, device,
                              torch.bfloat16 if device != "cpu" else torch.float32)
        prefixes = _prefixes(DecodeEngine(transformer), inputs)
        try:
            _run_paths(transformer, scenario, inputs, prefixes, path_specs, engines, refs, device, iters, rows,
                       fp8_verdicts or {})
        finally:
            for prefix in prefixes.values():
                prefix.release()
    return {"scenario": scenario.name, **describe(scenario, inputs.branches),
            "prefill_flop": prefill_flops(transformer.config, scenario, inputs.branches), "rows": rows}


def _run_paths(transformer, scenario, inputs, prefixes, path_specs, engines, refs, device, iters, rows,
               fp8_verdicts):
    config = transformer.config
    flops = decode_flops(config, scenario, inputs.branches)
    roofline_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
    # Our sampler runs the prefix rows alone and predicts step 1 with a decode step (DecodeEngine.prefill): eagerly
    # here, replayed from the entry's captured prefix pass on graph paths (measured per path below); diffusers'
    # prefill is its extract forward, which predicts step 1 itself.
    prefill_engine = DecodeEngine(transformer)  # made outside the timed call
    prefill_ms = device_ms(lambda: _prefixes(prefill_engine, inputs, with_target=False), device, iters=3, warmup=1)
    caches = reference_caches(prefixes)
    seen = {"reference_outputs": None, "reference_err": None, "eager_outputs": None}
    for spec in path_specs:
        if not spec.reference and spec.name not in engines:
            engines[spec.name] = OursPath(spec, transformer)  # before the peak reset: a quantized copy's build
        _peak_reset(device)
        if spec.reference and inputs.latents.shape[1] % 4:
            # diffusers lays the target out in 2x2-token slots, so it cannot decode an odd latent grid (its pipeline
            # rounds such sizes down to a multiple of 32 px); ratios then use our eager step.
            rows.append({"scenario": scenario.name, "path": spec.name, "skipped": "odd latent grid"})
            continue
        row = {"scenario": scenario.name, "path": spec.name, "prefill_ms": prefill_ms, "decode_flop": flops,
               "roofline_ms": roofline_ms}
        if spec.reference:
            _measure(row, reference_step(transformer, inputs, caches), None, spec, transformer, inputs, prefixes,
                     caches, refs, device, iters, seen)
        else:
            path = engines[spec.name]
            with path.installed():
                path_prefill_ms = _engine_prefill_ms(path.engine, inputs, device) if spec.mode == "graph" else None
                _measure(row, path.step(inputs, prefixes), path, spec, transformer, inputs, prefixes, caches, refs,
                         device, iters, seen)
                if path_prefill_ms is not None:
                    row["prefill_ms"] = path_prefill_ms
                path.engine.release()  # each path's peak is its own: drop its graphs before the next path
            verdict = fp8_verdicts.get(_bound_variant(spec), {}).get(scenario.name)
            if _bound_variant(spec) != "bf16":
                # The INT8 bound replaces the bf16 guard for 8-bit paths; without a verdict for this scenario there is no guard.
                row.pop("quality_ok", None)
                if verdict is not None:
                    row["quality_ok"] = verdict["pass"]
        rows.append(row)
    measured = [r for r in rows if "skipped" not in r]
    base = next((r for r in measured if r["path"] == "diffusers"), measured[0])
    for row in measured:
        row["speedup_vs_diffusers"] = base["decode_ms"] / row["decode_ms"]
        row["x_roofline"] = row["decode_ms"] / roofline_ms
        decode_steps = 0 if row["path"] == "diffusers" else 1  # is step 1 a decode step?
        row["dit_40_steps_ms"] = row["prefill_ms"] + (39 + decode_steps) * row["decode_ms"]
        row["dit_8_steps_ms"] = row["prefill_ms"] + (7 + decode_steps) * row["decode_ms"]


def _measure(row, step, path, spec, transformer, inputs, prefixes, caches, refs, device, iters, seen) -> None:
    """One path's figures on one scenario into `row` (`path` is None for the reference)."""
    stats_before = None if path is None else path.engine.stats.snapshot()
    outputs, row["first_call_s"] = wall_s(step, device)
    if stats_before is not None:
        delta = path.engine.stats.delta(stats_before)
        row["captures"] = delta["captures"]
        row["capture_s"] = delta["capture_seconds"]
        row["warmup_s"] = warmup_seconds(path.engine)
        row["compile_s"] = row["warmup_s"] if spec.compile else 0.0
        row["eager_steps"] = delta["eager_steps"]
    with ClockSampler(device) as clocks:
        row["decode_ms"] = device_ms(step, device, iters=iters)
    row.update(clocks.summary())
    row["host_ms"] = host_ms(step, device, iters=iters)
    if device != "cpu":
        row["decode_ms_after_idle"] = after_idle_ms(step, device)
    row["peak_gb"] = _peak_gb(device)
    if path is not None:
        row["graph_bytes"] = path.engine.bytes_held()
        row["weights_gb"] = _weights_gb(path.engine.transformer)
        row["block_weights_gb"] = _block_weights_gb(path.engine.transformer)
    if spec.reference:
        seen["reference_outputs"] = outputs
        row["prefill_ms"] = device_ms(reference_prefill(transformer, inputs), device, iters=2, warmup=1)
    if spec.name == "eager":
        seen["eager_outputs"] = outputs
    elif seen["eager_outputs"] is not None and not spec.reference:
        row["vs_own_eager_maxabs"] = quality.max_abs(outputs, seen["eager_outputs"])
    if not spec.reference and spec.mode == "graph":
        row["replay_vs_body_maxabs"] = _replay_vs_body(path, inputs, prefixes)
    if seen["reference_outputs"] is not None and not spec.reference:
        row["vs_diffusers_maxabs"] = quality.max_abs(outputs, seen["reference_outputs"])
    if row["scenario"] in refs:
        err = quality.relative_error(outputs, refs[row["scenario"]])
        row["rel_err_vs_fp32"] = err
        row["psnr_vs_fp32_db"] = quality.psnr_db(outputs, refs[row["scenario"]])
        if spec.reference:
            seen["reference_err"] = err
        if seen["reference_err"]:
            row["err_ratio_vs_diffusers"] = err / seen["reference_err"]
            row["quality_ok"] = err <= quality.GUARD_RATIO * seen["reference_err"]


def body_as_captured(engine, prefix) -> torch.Tensor:
    """The step body of `prefix`'s graph entry run eagerly on its static buffers under the settings its capture ran
    with, so it launches the kernels a replay runs: what a replay is compared with exactly."""
    entry = engine.graphs.entries[prefix.graph_key]
    with engine.graphs.backend.capture_settings():
        return engine.step(entry.inputs)


def warmup_seconds(engine) -> float:
    """The eager warm-up runs of every captured entry, in seconds (compiling included, for compiled blocks)."""
    return sum(getattr(entry, "warmup_seconds", 0.0) for entry in engine.graphs.entries.values())


def _replay_vs_body(path, inputs, prefixes) -> float:
    """Max abs difference between each branch's graph replay and the same body run eagerly on the same static
    buffers, under the settings the capture ran with (so cuBLAS picks the graph's GEMM kernels): the graph's own
    correctness, apart from any difference between decode bodies or kernel choices."""
    worst = 0.0
    for branch in inputs.branches:
        prefix = prefixes[branch.name]
        replayed = path.engine.decode_step(prefix, inputs.latents, inputs.timestep, "graph").output
        body = body_as_captured(path.engine, prefix)  # on torch 2.13+ without a cuBLAS workspace, as captured
        worst = max(worst, (body - replayed).abs().max().item())
    return worst


IDLE_S = 3.0
AFTER_IDLE = f"after {IDLE_S:g} s idle"


def amortization(transformer, device, context, channels):
    """Two sampler runs back to back, equal shapes, through one loaded model's engine (like two queued prompts),
    with the product's default settings (decode "auto", blocks not compiled)."""
    from graph_runtime.encoding.prompt import PromptEmbeds
    from graph_runtime.loaded import LoadedTransformer
    from graph_runtime.sampling.sampler import SamplingRequest, sample
    from .scenarios import Scenario

    engine = LoadedTransformer(transformer).engine
    results = []
    size = 1024 if device != "cpu" else 128
    for label, steps, preset, refs in [("t2i-40", 40, "dynamic", 0), ("t2i-40", 40, "dynamic", 0),
                                       ("turbo-8", 8, "turbo", 0), ("turbo-8", 8, "turbo", 0),
                                       (f"t2i-40 {AFTER_IDLE}", 40, "dynamic", 0),
                                       (f"turbo-8 {AFTER_IDLE}", 8, "turbo", 0),
                                       ("edit1-40", 40, "dynamic", 1), ("edit1-40 alone", 40, "dynamic", 1)]:
        if label.endswith("alone"):
            # What a card with no other entry held sees (a short card evicts idle entries; see _make_room).
            engine.release()
        if label.endswith(AFTER_IDLE) and device != "cpu":
            # A prompt queued on an idle card, as most single prompts are: the first steps run at the boost clock
            # until the card draws its power limit (see timing.after_idle_ms). The rows above run back to back.
            torch.cuda.synchronize(device)
            time.sleep(IDLE_S)
        inputs = build_inputs(Scenario(label, size, references=refs), context, channels, device,
                              next(transformer.parameters()).dtype)
        branch = inputs.branches[0]
        embeds = PromptEmbeds(branch.embeds[:1], branch.vlm_mask.bool())
        reference_latents = []
        if refs:
            g = size // 16
            reference_latents = [inputs.cond_tokens[:1].transpose(1, 2).reshape(1, channels, g, g)]
        request = SamplingRequest(positive=embeds, latent_height=size // 16, latent_width=size // 16,
                                  reference_latents=reference_latents, steps=steps, sigma_preset=preset,
                                  decode_mode="auto", seed=len(results))
        _peak_reset(device)
        compiles_before = engine.compiles
        result, wall = wall_s(lambda: sample(engine, request), device)
        results.append({
            "run": label, "steps": steps, "wall_s": wall, "dit_total_ms": result.timings["prefill_ms"]
            + result.timings["decode_ms_total"], "prefill_ms": result.timings["prefill_ms"],
            "decode_ms_per_step": result.timings["decode_ms_per_step"], "captures": result.stats["captures"],
            "replays": result.stats["replays"], "eager_steps": result.stats["eager_steps"],
            "compiles": engine.compiles - compiles_before, "peak_gb": _peak_gb(device),
            "graph_bytes": engine.bytes_held(),
        })
        del result, inputs
    engine.release()
    return results


def main(args, argv=()) -> int:
    """The run `args` (parsed by `cli.py`) ask for; `argv`, the options as given, goes into the results' command."""
    if getattr(args, "e2e", False):
        from .e2e_runner import e2e_main

        return e2e_main(args)
    device = args.device if torch.cuda.is_available() or args.device == "cpu" else "cpu"
    if device != "cpu" and not torch.cuda.is_available():
        print("bench: no CUDA device; run with --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    started = time.perf_counter()
    command = " ".join(["python -m bench", *(shlex.quote(a) for a in argv)])
    transformer = build_transformer(tiny=args.tiny, layers=args.layers, device=device,
                                    dtype=torch.bfloat16 if device != "cpu" else torch.float32)
    config = transformer.config
    context, channels = config.context_in_dim, config.in_channels
    scenarios = _select_scenarios(args.scenarios, args.tiny)
    specs = _select_paths(args.paths, device)
    print(f"bench: {len(scenarios)} scenarios x {len(specs)} paths on {device}", flush=True)
    # Back-to-back sampler runs first, while only the bf16 weights are resident: their peak memory is what a
    # user sees (text encoder off the GPU).
    amort = amortization(transformer, device, context, channels)
    for row in amort:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    gc.collect()
    refs = _fp32_references(transformer, scenarios, device, context, channels)
    fp8_report = _fp8_quality(transformer, scenarios, specs, device, context, channels, every=args.paths == "all")
    fp8_verdicts = _verdicts_by_precision(fp8_report)
    engines: dict = {}
    results = []
    for scenario in scenarios:
        result = run_scenario(transformer, scenario, specs, engines, refs, device, args.iters, context, channels,
                              fp8_verdicts)
        results.append(result)
        for row in result["rows"]:
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    for path in engines.values():
        path.engine.release()
    engines.clear()
    gc.collect()
    tied, totals = _fastest_passing(results, specs)
    print(f"bench: fastest path passing the quality guard: {describe_fastest(tied, totals)}", flush=True)
    profile_text = None
    if args.profile and device != "cpu" and tied:
        best = tied[0]
        profile_text = _profile(transformer, best, device, context, channels)
        print(profile_text, flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "gpu": torch.cuda.get_device_name() if device != "cpu" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
        "peak_tflops_assumed": PEAK_TFLOPS,
        "layers": config.num_layers,
        "params_billion": sum(p.numel() for p in transformer.parameters()) / 1e9,
        "fastest_passing_path": describe_fastest(tied, totals),
        "wall_s": round(time.perf_counter() - started, 1),
        "quality_guard": f"relative L2 error vs fp32 <= {quality.GUARD_RATIO:.2f} x the diffusers bf16 path's"
                         + ("; FP8 paths: within INT8 ConvRot W8A8's error per block and over the step"
                            if fp8_report else ""),
    }
    md, js = write_reports(Path(args.out_dir), meta, results, amort, profile_text, fp8_report)
    print(f"bench: wrote {md} and {js} in {meta['wall_s']} s", flush=True)
    return 0


def _fp8_quality(transformer, scenarios, specs, device, context, channels, every=False) -> dict | None:
    """`fp8_quality`'s errors on the quality scenarios when an 8-bit path runs (None otherwise); a failure is
    reported in the results instead of ending the run (those paths then have no guard and are no candidates). The
    variants of the selected paths are measured beside bf16 and the INT8 bound; `every` (`--paths all`) adds the
    exploratory ones (FP8 per Linear group, FP8 with rotation)."""
    precisions = [_bound_variant(spec) for spec in specs if _bound_variant(spec) != "bf16"]
    if not precisions:
        return None
    from . import fp8_quality

    dtype = next(transformer.parameters()).dtype
    wanted = {s.name: build_inputs(s, context, channels, device, dtype) for s in scenarios if s.quality}
    variants = (fp8_quality.DEFAULT_VARIANTS if every
                else list(dict.fromkeys(["bf16", fp8_quality.INT8, *precisions])))
    try:
        report = fp8_quality.measure(transformer, wanted, device, variants)
    except Exception as exc:  # noqa: BLE001 - the timings of every other path are still worth writing
        print(f"bench: the FP8 quality measurement failed: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    for line in fp8_quality.summary_lines(report):
        print("bench: FP8 bound: " + line, flush=True)
    return report


def _bound_variant(spec) -> str:
    """The quality variant whose verdict judges `spec`: its precision, and for an INT8 file kept int8 the `int8`
    variant (the same ConvRot weights through our kernels), since its error is W8A8's and not bf16's; a path with
    another attention is a variant of its own."""
    if spec.attention not in ATTENTION_CHOICES or spec.attention == FP8:  # an 8-bit attention: a variant of its own
        return spec.name
    return "int8" if spec.weights == "int8" else spec.precision


def _verdicts_by_precision(report: dict | None) -> dict:
    return {} if not report or "verdicts" not in report else report["verdicts"]


def _profile(transformer, spec, device, context, channels) -> str:
    """Kernel table of one step of `spec` at 1024x1024 (eager body on the static buffers, under the capture's
    settings) and per-op rates."""
    from .profile import kernel_table, op_rates
    from .scenarios import Scenario

    scenario = Scenario("profile-1024", 1024)
    inputs = build_inputs(scenario, context, channels, device, torch.bfloat16)
    path = OursPath(spec, transformer)
    with torch.no_grad(), path.installed():
        prefixes = _prefixes(DecodeEngine(transformer), inputs)
        path.step(inputs, prefixes)()
        prefix = prefixes[inputs.branches[0].name]  # the first entry the step registered
        table = kernel_table(lambda: body_as_captured(path.engine, prefix), device)
    layout = inputs.branches[0].layout
    rates = op_rates(transformer, layout.target_tokens, layout.seq_len, device)
    path.engine.release()
    title = f"profile of one {spec.name} step at 1024x1024 (eager body on static buffers, capture settings):"
    lines = [title, table, "op rates:"]
    lines += [f"  {r['op']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s" for r in rates]
    return "\n".join(lines)


# Summed decode times this close are run-to-run noise: the same path's step moves by a few percent between runs with
# the clock the card's power cap leaves, and paths within this margin swap places from one run to the next
# (docs/performance.md).
TIE = 0.01


def _fastest_passing(results, specs) -> tuple[list, dict]:
    """The paths that passed every quality check whose summed decode time over the scenarios is within `TIE` of the
    fastest one's, fastest first, and every passing path's sum (ms)."""
    candidates = [s for s in specs if not s.reference]
    totals = {}
    for spec in candidates:
        rows = [r for res in results for r in res["rows"] if r["path"] == spec.name and "skipped" not in r]
        if any(r.get("quality_ok") is False for r in rows):
            continue
        if _bound_variant(spec) != "bf16" and not any(r.get("quality_ok") for r in rows):
            continue  # an 8-bit path is a candidate only once its bound was measured and met
        totals[spec.name] = sum(r["decode_ms"] for r in rows)
    if not totals:
        return [], totals
    best = min(totals.values())
    tied = sorted((name for name, total in totals.items() if total <= best * (1 + TIE)), key=totals.get)
    return [next(s for s in candidates if s.name == name) for name in tied], totals


def describe_fastest(tied, totals) -> str:
    """One line for the report: the fastest path, and any others tied with it."""
    if not tied:
        return "none (no path met its quality bound)"
    text = tied[0].name
    if len(tied) > 1:
        sums = ", ".join(f"{s.name} {totals[s.name]:.1f}" for s in tied)
        text += f" (tied within {TIE:.0%} with {', '.join(s.name for s in tied[1:])}; summed decode ms: {sums})"
    return text
