"""`python -m bench.lora`: what merging a LoRA costs at full size, and that a merged LoRA decodes at
the same speed through the same captured graph.

The LoRA is rank 64 on every Linear of the 32 blocks (to_q, to_k, to_v, to_out.0, gate_layer, proj, out: 224
weights), random, built on the GPU, merged into the full-size random bf16 transformer of `model.py`:

- merge times: the first merge (which first copies each original weight into pinned host memory), a switch to
  another strength (originals copied back from the host, merged again), a switch to two LoRAs, the restore to no
  LoRA (which frees the host copies) and a merge after it;
- per scenario, the decode step on the graph path, timed without the LoRA, merged, without, merged (alternated so
  clock drift shows): the one graph captured before the merge replays throughout (captures counted), its output
  changes with the merge and is the unmerged one again bit for bit after the restore. (The prefix K/V stay the
  unmerged model's: the step's time and the graph's reuse are what is measured here, not a merged prompt.)

Results go to `bench/results/lora-<time>.md` and `.json` with the command that made them. `--tiny --device cpu` is
a smoke run of this script (the eager path; CPU steps run no graph).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch

from graph_runtime.lora import LoraChoice, LoraFile, LoraMerge, WeightPatch

from .model import build_transformer
from .options import standalone_start, write_results
from .paths import OursPath, PathSpec
from .runner import _prefixes, _select_scenarios
from .scenarios import build_inputs
from .timing import device_ms, wall_s

ROUNDS = ("without", "merged", "without", "merged")


def random_lora(transformer, rank: int, seed: int, std: float = 0.016) -> LoraFile:
    """A rank-`rank` LoRA on every 2-D weight of the blocks, made on the weights' device. With the benchmark's
    N(0, 0.02) weights, `std` makes each delta about a tenth of its weight (sqrt(rank) * std**2 ~ 0.002)."""
    param = next(transformer.parameters())
    generator = torch.Generator(param.device).manual_seed(seed)
    patches = {}
    for name, weight in transformer.transformer_blocks.named_parameters():
        if weight.dim() == 2:
            rows, cols = weight.shape
            up = torch.randn(rows, rank, generator=generator, device=param.device).to(param.dtype) * std
            down = torch.randn(rank, cols, generator=generator, device=param.device).to(param.dtype) * std
            patches[f"transformer_blocks.{name}"] = [WeightPatch(up=up, down=down)]
    return LoraFile(path=f"random-rank{rank}-seed{seed}", identity=("bench", rank, seed), patches=patches)


def merge_times(transformer, loras: list[LoraFile], device) -> list[dict]:
    state = LoraMerge(transformer)
    rows = []
    for label, choices in (("first merge (host copies + merge)", [LoraChoice(loras[0], 1.0)]),
                           ("switch strength 1.0 -> 0.5", [LoraChoice(loras[0], 0.5)]),
                           ("switch to two LoRAs", [LoraChoice(loras[0], 1.0), LoraChoice(loras[1], 0.5)]),
                           ("restore (no LoRA)", []),
                           ("merge after the restore", [LoraChoice(loras[0], 1.0)])):
        changed, seconds = wall_s(lambda: state.apply(choices), device)
        rows.append({"step": label, "changed": changed, "s": round(seconds, 4),
                     "weights": len(set().union(*(c.lora.patches for c in choices))),
                     "host_copies_gib": round(state.originals_bytes() / 2**30, 2)})
        print(json.dumps(rows[-1]), flush=True)
    state.apply([])
    return rows


def step_times(transformer, lora: LoraFile, scenario, device, iters: int) -> dict:
    config, dtype = transformer.config, next(transformer.parameters()).dtype
    inputs = build_inputs(scenario, config.context_in_dim, config.in_channels, device, dtype)
    spec = PathSpec("graph") if torch.device(device).type == "cuda" else PathSpec("eager", mode="eager")
    path = OursPath(spec, transformer)
    state = LoraMerge(transformer)
    with torch.no_grad():
        prefixes = _prefixes(path.engine, inputs, with_target=False)
        step = path.step(inputs, prefixes)
        plain = step()[0].clone()  # the capture, before any merge
        captures = path.engine.stats.captures
        times = {"without": [], "merged": []}
        merged_out, restored_equal = None, True
        for label in ROUNDS:
            state.apply([LoraChoice(lora, 1.0)] if label == "merged" else [])
            out = step()[0]
            if label == "merged":
                merged_out = out.clone()
            else:
                restored_equal = restored_equal and torch.equal(out, plain)
            times[label].append(device_ms(step, device, iters=iters, warmup=2))
        state.apply([])
        recaptured = path.engine.stats.captures - captures
        path.engine.release()
        for prefix in prefixes.values():
            prefix.release()
    without, merged = statistics.median(times["without"]), statistics.median(times["merged"])
    return {"scenario": scenario.name, "path": spec.name, "decode_ms_without": round(without, 3),
            "decode_ms_merged": round(merged, 3), "merged_over_without": round(merged / without, 4),
            "rounds_ms": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
            "captures_after_merges": recaptured, "captures": captures,
            "output_change_rel_l2": ((merged_out.float() - plain.float()).norm() / plain.float().norm()).item(),
            "restored_output_equal": restored_equal}


def markdown(meta: dict, merges: list[dict], steps: list[dict]) -> str:
    lines = [f"# LoRA merge benchmark, {meta['date']}", "",
             f"- device: {meta['device']}; torch {meta['torch']}; {meta['layers']} blocks, random {meta['dtype']} "
             f"weights; LoRA rank {meta['rank']} on {meta['lora_weights']} block weights "
             f"({meta['lora_mib']:.0f} MiB)",
             f"- command: `{meta['command']}` ({meta['wall_s']} s)", "",
             "| merge step | weights merged | s | host copies GiB |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['weights']} | {r['s']:.3f} | {r['host_copies_gib']:.2f} |" for r in merges]
    lines += ["", "| scenario | path | decode ms/step without | merged | merged / without | captures after merges "
                  "| output change (rel. L2) | restored output equal |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['path']} | {r['decode_ms_without']:.2f} | {r['decode_ms_merged']:.2f} | "
              f"{r['merged_over_without']:.3f} | {r['captures_after_merges']} | {r['output_change_rel_l2']:.3g} | "
              f"{r['restored_output_equal']} |" for r in steps]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks (32 = the real model)")
    parser.add_argument("--scenarios", default="t2i-512,t2i-1024", help="comma list of benchmark scenario names")
    parser.add_argument("--iters", type=int, default=20, help="timed decode steps per round (median reported)")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny 2-block model (a CPU smoke run)")
    args = parser.parse_args(argv)
    start = standalone_start("bench.lora", args.device, argv)
    if start is None:
        return 2
    command, dtype = start
    started = time.perf_counter()
    transformer = build_transformer(tiny=args.tiny, layers=args.layers, device=args.device, dtype=dtype)
    loras = [random_lora(transformer, args.rank, seed) for seed in (1, 2)]
    merges = merge_times(transformer, loras, args.device)
    steps = []
    for scenario in _select_scenarios(args.scenarios, args.tiny):
        steps.append(step_times(transformer, loras[0], scenario, args.device, args.iters))
        print(json.dumps(steps[-1]), flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "device": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor() or "cpu",
            "torch": torch.__version__, "layers": transformer.config.num_layers, "rank": args.rank,
            "dtype": str(dtype).removeprefix("torch."),
            "lora_weights": len(loras[0].patches), "lora_mib": loras[0].nbytes / 2**20,
            "wall_s": round(time.perf_counter() - started, 1)}
    write_results("bench.lora", args.out_dir, "lora", markdown(meta, merges, steps),
                  {"meta": meta, "merges": merges, "steps": steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
