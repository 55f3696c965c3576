"""`python -m bench.prefix_placement`: the decode step with the prefix K/V on the GPU, int8 on the GPU, and in pinned
host memory, on one transformer in one process; and the int8 prefix's error against the INT8 ConvRot bound.

Speed: per placement, a graph entry is prefilled with the scenario's prefix (the 2-reference 1024x1024 edit by default:
8192 reference tokens + the prompt), captured once, and the replayed step is timed (CUDA events, median of `--iters`
after warm-up), gpu / int8 / host alternated over `--rounds`. The host step copies every block's prefix rows from
pinned memory on a copy stream while the block before computes: its floor is max(the gpu step, the prefix bytes / the
measured host-to-device bandwidth), which is printed beside it.

Error (bf16 step against an fp32 run of the same weights, `fp8_quality.py`'s two measures): per block, each block
run alone on the fp32 run's input with the prefix rows as the placement gives them (int8: quantized and dequantized),
its update against the fp32 block's; over the step, the placement's own prefix pass and step against the fp32 output.
The bound is ComfyUI's INT8 ConvRot W8A8 Linears (comfy-kitchen) with a bf16 prefix, measured the same way on the
same weights: the int8 prefix passes when every block and the step are within it. The host prefix's output is also
compared with the gpu prefix's (bit-equal: the same values, moved).

`--card GB` adds the int8 and host rows on an emulated card, the transformer loaded as the memory planner plans it
there (prefix_card.py), against the uncapped gpu row.

Results go to `bench/results/prefix-placement-<time>.md` and `.json` with the command that made them. `--tiny --device
cpu` is a smoke run of this script (eager steps, no graphs, no bound).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from graph_runtime.decode import DecodeEngine
from graph_runtime.kernels.kv_int8 import dequantize_rows, quantize_rows
from graph_runtime.memory.link import copy_rate

from . import prefix_card
from .model import build_transformer, fp32_copy
from .options import standalone_meta, standalone_start, write_results
from .scenarios import DEFAULT_SCENARIOS, TINY_SCENARIOS, build_inputs
from .timing import device_ms

PLACEMENTS = ("gpu", "int8", "host")


def prefilled(engine: DecodeEngine, inputs, placement: str, mode: str):
    """The scenario's first branch prefilled under `placement` (its prefix pass), its step captured when `mode` is
    graph."""
    branch = inputs.branches[0]
    with torch.no_grad():
        _, prefix = engine.prefill(branch.layout, inputs.hidden_all, branch.embeds, inputs.timestep,
                                   with_target=False, mode=mode, placement=placement)
        first = engine.decode_step(prefix, inputs.latents, inputs.timestep, mode)
    return prefix, first


def step_ms(engine, prefix, inputs, mode: str, iters: int) -> float:
    def step():
        with torch.no_grad():
            engine.decode_step(prefix, inputs.latents, inputs.timestep, mode)

    return device_ms(step, inputs.latents.device, iters=iters)


def h2d_gbps(nbytes: int = 1 << 30) -> float:
    """Pinned host-to-device copy bandwidth (GB/s, 10^9 bytes), the host prefix's floor (memory/link.py's way)."""
    return copy_rate("cuda", nbytes, 5) / 1e9


def speed(transformer, inputs, rounds: int, iters: int, device) -> tuple[dict, torch.Tensor]:
    """The rows of the three placements, and the gpu prefix's first output (what the others are compared with)."""
    mode = "graph" if torch.device(device).type == "cuda" else "eager"
    rows = {p: {"ms": [], "paths": []} for p in PLACEMENTS}
    outputs = {}
    for placement in PLACEMENTS:
        engine = DecodeEngine(transformer)
        prefix, first = prefilled(engine, inputs, placement, mode)
        outputs[placement] = first.output.float()
        rows[placement]["paths"].append(first.path)
        rows[placement]["prefix_device_bytes"] = prefix.nbytes
        rows[placement]["prefix_host_bytes"] = 0 if prefix.store is None else prefix.store.host_bytes
        rows[placement]["engine"], rows[placement]["prefix"] = engine, prefix
    for _ in range(rounds):  # alternated, so drift in clocks hits every placement alike
        for placement in PLACEMENTS:
            row = rows[placement]
            row["ms"].append(step_ms(row["engine"], row["prefix"], inputs, mode, iters))
    result = {}
    for placement, row in rows.items():
        row["prefix"].release()
        row["engine"].release()
        result[placement] = {"ms": round(statistics.median(row["ms"]), 3), "all_ms": [round(m, 3) for m in row["ms"]],
                             "first_path": row["paths"][0], "prefix_device_bytes": row["prefix_device_bytes"],
                             "prefix_host_bytes": row["prefix_host_bytes"]}
    gpu = outputs["gpu"]
    for placement in PLACEMENTS:
        result[placement]["vs_gpu"] = round(result[placement]["ms"] / result["gpu"]["ms"], 3)
        result[placement]["rel_l2_vs_gpu_prefix"] = _rel(outputs[placement], gpu)
    result["host"]["bit_equal_to_gpu"] = bool(torch.equal(outputs["host"], gpu))
    if torch.device(device).type == "cuda":
        bandwidth = h2d_gbps()
        copy_ms = result["host"]["prefix_host_bytes"] / bandwidth / 1e6
        result["host"].update(h2d_gbps=round(bandwidth, 2), copy_ms=round(copy_ms, 3),
                              floor_ms=round(max(copy_ms, result["gpu"]["ms"]), 3))
    return result, gpu


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _int8_round_trip(rows: torch.Tensor) -> torch.Tensor:
    q = torch.empty(rows.shape, dtype=torch.int8, device=rows.device)
    scale = torch.empty(*rows.shape[:-1], 1, device=rows.device)
    quantize_rows(rows, q, scale)
    back = torch.empty_like(rows)
    dequantize_rows(q.contiguous(), scale, back)
    return back


def int8_prefix_errors(transformer, reference: dict, inputs) -> dict:
    """The int8 prefix's errors against the fp32 run (`fp8_quality._reference`): per block (each block alone on the
    fp32 input, its prefix rows int8-rounded from the fp32 ones cast to the model's dtype) and over the step (the int8
    prefix's own pass and step)."""
    from .fp8_quality import _cast, _rel as rel, _residual

    dtype = next(transformer.parameters()).dtype
    step = DecodeEngine(transformer).step
    static32 = reference["blocks"][0]["static"]
    prefix_len = static32.prefix_len
    step.use_attention(step.blocks, static32.hidden.device, dtype)
    blocks = []
    with torch.no_grad():
        for i, (block, record) in enumerate(zip(step.blocks, reference["blocks"])):
            x, pending = _cast(record["x"], dtype), _cast(record["pending"], dtype)
            modulation, cos, sin, _, _, _, static_kv, mask = record["rest"]
            caches = []
            for cache in (static32.k[i], static32.v[i]):
                cache = cache.to(dtype)
                cache[:, :prefix_len] = _int8_round_trip(cache[:, :prefix_len])
                caches.append(cache)
            out_x, out_pending = block(x, pending, modulation.to(dtype), cos, sin, *caches, prefix_len, static_kv,
                                       mask)
            update = _residual(out_x, out_pending) - _residual(x, pending)
            update32 = _residual(*record["out"]) - _residual(record["x"], record["pending"])
            blocks.append(rel(update, update32))
        engine = DecodeEngine(transformer)
        outs = []
        for branch in inputs.branches:
            _, prefix = engine.prefill(branch.layout, inputs.hidden_all, branch.embeds, inputs.timestep,
                                       with_target=False, mode="eager", placement="int8")
            outs.append(engine.decode_step(prefix, inputs.latents, inputs.timestep, "eager").output)
            prefix.release()
    num = sum((o.float() - r.float()).pow(2).sum().item() for o, r in zip(outs, reference["outputs"]))
    den = sum(r.float().pow(2).sum().item() for r in reference["outputs"])
    return {"block_err": blocks, "step_err": (num / max(den, 1e-30)) ** 0.5}


def quality(transformer, inputs, device) -> dict:
    """The int8 prefix's errors and the INT8 ConvRot bound's (with the bf16 prefix) against one fp32 run, and the
    verdict: every block and the step within the bound."""
    from .fp8_quality import INT8, _reference, measure

    bound = measure(transformer, {"s": inputs}, device, variants=["bf16", INT8])["scenarios"]["s"]
    model32 = fp32_copy(transformer)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            reference = _reference(model32, inputs.to(torch.float32))
        del model32
        ours = int8_prefix_errors(transformer, reference, inputs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    ratios = [e / max(b, 1e-30) for e, b in zip(ours["block_err"], bound[INT8]["block_err"])]
    step_ratio = ours["step_err"] / max(bound[INT8]["step_err"], 1e-30)
    return {"int8-prefix": ours, "bf16": bound["bf16"], INT8: bound[INT8],
            "verdict": {"blocks_within": sum(r <= 1.0 for r in ratios), "blocks": len(ratios),
                        "worst_block_ratio": max(ratios), "step_ratio": step_ratio,
                        "pass": all(r <= 1.0 for r in ratios) and step_ratio <= 1.0}}


def markdown(meta: dict, result: dict, judged: dict | None, card: dict | None = None) -> str:
    lines = [f"# Prefix placement benchmark, {meta['date']}", "",
             f"- device: {meta['device']}; torch {meta['torch']}; {meta['layers']} blocks, random {meta['dtype']} "
             f"weights; scenario {meta['scenario']} ({meta['prefix_tokens']} prefix + {meta['target_tokens']} target "
             f"tokens)", f"- command: `{meta['command']}` ({meta['wall_s']} s)", "",
             "| prefix | step ms (median) | vs gpu | prefix on the device | prefix on the host | first step | rel. L2 "
             "vs gpu prefix |", "|---|---:|---:|---:|---:|---|---:|"]
    for placement in PLACEMENTS:
        r = result[placement]
        lines.append(f"| {placement} | {r['ms']:.2f} | {r['vs_gpu']:.3f}x | {r['prefix_device_bytes'] / 2**30:.2f} GiB "
                     f"| {r['prefix_host_bytes'] / 2**30:.2f} GiB | {r['first_path']} | "
                     f"{r['rel_l2_vs_gpu_prefix']:.3g} |")
    host = result["host"]
    lines.append("")
    lines.append(f"host prefix: bit-equal to the gpu prefix: {host['bit_equal_to_gpu']}"
                 + (f"; pinned H2D {host['h2d_gbps']} GB/s, the prefix's copy {host['copy_ms']} ms, floor "
                    f"max(gpu step, copy) {host['floor_ms']} ms, step / floor {host['ms'] / host['floor_ms']:.3f}"
                    if "h2d_gbps" in host else ""))
    if judged is not None:
        v = judged["verdict"]
        lines += ["", "## int8 prefix against the INT8 ConvRot bound (error vs fp32)", "",
                  "| variant | step err | worst block err | mean block err |", "|---|---:|---:|---:|"]
        for name in ("bf16", "int8-convrot", "int8-prefix"):
            e = judged[name]
            lines.append(f"| {name} | {e['step_err']:.4g} | {max(e['block_err']):.4g} | "
                         f"{statistics.mean(e['block_err']):.4g} |")
        lines += ["", f"int8 prefix: {v['blocks_within']}/{v['blocks']} blocks within the bound (worst ratio "
                      f"{v['worst_block_ratio']:.3f}), step ratio {v['step_ratio']:.3f}: "
                      + ("PASS" if v["pass"] else "FAIL")]
    lines += prefix_card.markdown(card or {})
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_placement", description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="edit2-1024", help="a scenario of bench/scenarios.py")
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks (32 = the real model)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of the three placements")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per round (median reported)")
    parser.add_argument("--no-quality", action="store_true", help="skip the error against the INT8 bound")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny 2-block model (a CPU smoke run)")
    parser.add_argument("--card", type=float, default=None, metavar="GB",
                        help="also run the int8 and host prefix rows on an emulated card of GB (10^9 bytes), the "
                             "transformer loaded as the memory planner plans it there; the gpu row stays uncapped "
                             "(default: none)")
    args = parser.parse_args(argv)
    if args.card is not None and not args.card > 0:
        parser.error(f"--card {args.card:g}: expected a card size in GB above 0, e.g. 8, 12, 16 or 24")
    start = standalone_start("bench.prefix_placement", args.device, argv)
    if start is None:
        return 2
    command, dtype = start
    started = time.perf_counter()
    scenarios = {s.name: s for s in (*DEFAULT_SCENARIOS, *TINY_SCENARIOS)}
    scenario = scenarios[args.scenario if not args.tiny else "tiny-edit1-cfg"]
    transformer = build_transformer(tiny=args.tiny, layers=args.layers, device=args.device, dtype=dtype)
    config = transformer.config
    inputs = build_inputs(scenario, config.context_in_dim, config.in_channels, args.device, dtype)
    result, gpu_output = speed(transformer, inputs, args.rounds, args.iters, args.device)
    card = None
    if args.card is not None:
        card = prefix_card.capped_rows(transformer, inputs, args.card, args.rounds, args.iters, args.device,
                                       result["gpu"], gpu_output, prefilled, step_ms)
    judged = None
    if not args.no_quality and args.device != "cpu":
        judged = quality(transformer, inputs, args.device)
    layout = inputs.branches[0].layout
    meta = standalone_meta(command, args.device, transformer, dtype, time.perf_counter() - started,
                           scenario=scenario.name, prefix_tokens=layout.prefix_len,
                           target_tokens=layout.target_tokens)
    print(json.dumps(result), flush=True)
    write_results("bench.prefix_placement", args.out_dir, "prefix-placement", markdown(meta, result, judged, card),
                  {"meta": meta, "speed": result, "quality": judged, "card": card})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
