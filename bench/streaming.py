"""`python -m bench.streaming`: the decode step of a partly loaded transformer on emulated small cards, streamed
through device slots and replayed, against its bound and against the eager way of streaming.

The model is the full-size random transformer of `model.py` (32 blocks), its blocks' Linears INT8 ConvRot by default
(`--precision bf16` keeps them bf16), at 1024x1024 with a 128-token prompt. In one process:

1. the whole model on the device: one prompt's prefill and decode step captured, then the replayed step timed
   (median of `--iters`): the step's resident compute, and what the step adds on the device beyond the weights
   (graph buffers, pool, activations);
2. the host-to-device bandwidth: a page-locked buffer of `--copy-mib` copied to the device, timed;
3. per emulated card (`--cards`, GB; `KVGRAPH_EMULATE_CARD_GB` semantics, graph_runtime/free_memory.py: the
   allocator is capped to that size): the weights' budget is the card less what the step adds less `--reserve-gb`;
   the plan (`streaming.plan_stream`) keeps what fits resident and streams the rest through `--slots` slots. Timed:
   the streamed step replayed (its first step captured it), and the same resident blocks streamed the eager way
   (stream slots 0, today's per-block copies: every step eager). The bound is max(resident compute, streamed
   bytes / bandwidth); the ratios are the replayed step over the bound and the eager step over the replayed one.
   Peak device memory while streaming is reported against the card.

Results go to `bench/results/streaming-<time>.md` and `.json` with the command that made them. `--tiny --device cpu`
is a smoke run of this script (no cards, no graphs: half the blocks resident, timings meaningless).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time

import torch

from graph_runtime.decode import TokenLayout
from graph_runtime.free_memory import emulate_card
from graph_runtime.loaded import LoadedTransformer
from graph_runtime.memory.link import copy_rate
from graph_runtime.streaming import DEFAULT_SLOTS, plan_stream, plan_with

from .model import build_transformer
from .options import standalone_start, write_results
from .paths import CONVROT_GROUP
from .scenarios import TEXT_TOKENS
from .timing import device_ms

GB = 10**9


def quantize_blocks(transformer) -> None:
    """The blocks' Linears INT8 ConvRot, in place (comfy-kitchen, on the weights' device)."""
    from graph_runtime.quantized import quantize_linears_

    quantize_linears_(transformer, CONVROT_GROUP, lambda name, _: name.startswith("transformer_blocks."))


def h2d_gbps(device, mib: int, iters: int = 10) -> float:
    """Host-to-device bandwidth in GB/s: a page-locked buffer of `mib` MiB copied to the device (median), measured
    as the memory plans measure it (graph_runtime/memory/link.py)."""
    return copy_rate(device, mib << 20, iters) / GB


class Request:
    """One prompt's prefill and a decode step over it, on `engine`."""

    def __init__(self, transformer, size: int, device):
        g = torch.Generator("cpu").manual_seed(0)
        dtype = next(p for p in transformer.parameters() if p.is_floating_point()).dtype
        side = size // 16
        self.embeds = torch.randn(1, TEXT_TOKENS, transformer.config.context_in_dim, generator=g).to(device, dtype)
        self.layout = TokenLayout.build(torch.zeros(1, TEXT_TOKENS, dtype=torch.bool), [(1, side, side)], device)
        self.latents = torch.randn(1, side * side, transformer.config.in_channels, generator=g).to(device, dtype)
        self.t = torch.tensor([0.6], device=device)

    def step_ms(self, engine, device, iters: int) -> tuple[float, list[str]]:
        """Median ms of a decode step after the prefill (the first step, which may capture, is left out), and the
        paths the steps took."""
        with torch.no_grad():
            _, prefix = engine.prefill(self.layout, self.latents, self.embeds, torch.tensor([0.9], device=device))
            paths = []

            def step():
                paths.append(engine.decode_step(prefix, self.latents, self.t).path)

            step()
            ms = device_ms(step, device, iters=iters, warmup=1)
            prefix.release()
        return ms, paths


def card_plans(transformer, budget, slot_counts) -> list:
    """The plans timed on one card: one per slot count (`plan_stream` within `budget`; None: half the blocks
    resident, the smoke run), then the eager way (stream slots 0) at the first plan's resident blocks."""
    if budget is None:
        plans = [plan_with(transformer, transformer.config.num_layers // 2, s) for s in slot_counts]
    else:
        plans = [plan_stream(transformer, budget, slots=s) for s in slot_counts]
    if any(p is None for p in plans):
        return []  # the whole model fits: nothing streams on this card
    return plans + [plan_with(transformer, plans[0].resident_blocks, 0)]


def unload(loaded, cuda: bool) -> None:
    """Back to nothing on the device: no streamer, no graphs, the weights on the host."""
    loaded.release_graphs("next plan")
    loaded.stop_streaming()
    loaded.transformer.to("cpu")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def run_card(loaded, request, card_gb, args, whole: dict, gbps: float | None, device) -> list[dict]:
    """The rows of one emulated card: the replayed streamed step per slot count, and the eager way."""
    transformer = loaded.transformer
    cuda = torch.device(device).type == "cuda"
    unload(loaded, cuda)
    budget = None
    if cuda:
        emulate_card(device, int(card_gb * GB))
        budget = card_gb * GB - whole["run_bytes"] - args.reserve_gb * GB
    rows = []
    try:
        for plan in card_plans(transformer, budget, args.slots):
            loaded.load_streamed(device, plan)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            ms, paths = request.step_ms(loaded.engine, device, args.iters)
            peak = torch.cuda.max_memory_allocated() if cuda else 0
            streamed_bytes = loaded.streamer.host_bytes
            bound = max(whole["ms"], streamed_bytes / (gbps * GB) * 1e3) if gbps else None
            rows.append({"card_gb": card_gb, "slots": plan.slots, "resident_blocks": plan.resident_blocks,
                         "streamed_blocks": plan.streamed_blocks, "streamed_mib": streamed_bytes >> 20,
                         "ms": round(ms, 2), "bound_ms": None if bound is None else round(bound, 2),
                         "vs_bound": None if bound is None else round(ms / bound, 3),
                         "paths": sorted(set(paths)), "peak_gib": round(peak / 2**30, 2)})
            unload(loaded, cuda)
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    if not rows:
        return [{"card_gb": card_gb, "slots": None, "resident_blocks": transformer.config.num_layers,
                 "streamed_blocks": 0, "streamed_mib": 0, "ms": whole["ms"], "bound_ms": whole["ms"], "vs_bound": 1.0,
                 "paths": ["fits whole: not streamed"], "peak_gib": None, "eager_vs_this": None}]
    eager = rows[-1]["ms"]
    for r in rows:
        r["eager_vs_this"] = round(eager / r["ms"], 2) if r["slots"] else None
    return rows


def markdown(meta: dict, whole: dict, rows: list[dict]) -> str:
    lines = [f"# Streamed steps on emulated cards, {meta['date']}", "",
             f"- device: {meta['device']}; torch {meta['torch']}; {meta['layers']} blocks, random weights, blocks "
             f"{meta['precision']}; {meta['size']}x{meta['size']}, {TEXT_TOKENS} text tokens",
             f"- command: `{meta['command']}` ({meta['wall_s']} s)",
             f"- whole model resident, replayed step: {whole['ms']:.2f} ms; it adds {whole['run_bytes'] / GB:.2f} GB "
             f"beyond the weights ({whole['weights_bytes'] / GB:.2f} GB)",
             f"- host-to-device bandwidth (pinned, {meta['copy_mib']} MiB): {meta['h2d_gbps']:.1f} GB/s",
             f"- weights budget per card: the card less the step's additions less {meta['reserve_gb']} GB", "",
             "| card | slots | resident blocks | streamed blocks | streamed MiB | step ms | bound ms | step / bound | "
             "eager / step | paths | peak GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        slots = "0 (eager way)" if r["slots"] == 0 else r["slots"] or "-"
        lines.append(f"| {r['card_gb']:g} GB | {slots} | {r['resident_blocks']} | {r['streamed_blocks']} | "
                     f"{r['streamed_mib']} | {r['ms']:.2f} | {r['bound_ms']} | {r['vs_bound']} | "
                     f"{r['eager_vs_this'] or ''} | {', '.join(r['paths'])} | {r['peak_gib']} |")
    lines += ["", "bound = max(whole-model replayed step, streamed bytes / bandwidth); targets: step / bound <= 1.15, "
              "eager / step >= 2."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.streaming", description=__doc__.split("\n")[0])
    parser.add_argument("--cards", default="8,12", help="comma list of emulated card sizes in GB")
    parser.add_argument("--slots", default=str(DEFAULT_SLOTS), help="comma list of slot counts to time (2, 3)")
    parser.add_argument("--precision", choices=("int8", "bf16"), default="int8", help="the blocks' Linears")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (a multiple of 16)")
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks (32 = the real model)")
    parser.add_argument("--iters", type=int, default=10, help="timed decode steps per row (median reported)")
    parser.add_argument("--reserve-gb", type=float, default=0.5,
                        help="left free beside the weights and the step (the CUDA context of a real card)")
    parser.add_argument("--copy-mib", type=int, default=1024, help="the bandwidth measurement's copy size")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny 2-block model (a CPU smoke run)")
    args = parser.parse_args(argv)
    args.slots = [int(s) for s in args.slots.split(",")]
    if any(s not in (1, 2, 3) for s in args.slots):
        parser.error(f"--slots {args.slots}: expected slot counts among 1, 2, 3")
    cards = [float(c) for c in args.cards.split(",")]
    start = standalone_start("bench.streaming", args.device, argv)
    if start is None:
        return 2
    command, dtype = start
    started = time.perf_counter()
    device = args.device
    cuda = torch.device(device).type == "cuda"
    transformer = build_transformer(tiny=args.tiny, layers=args.layers, device=device, dtype=dtype)
    if args.precision == "int8" and cuda:
        quantize_blocks(transformer)
    loaded = LoadedTransformer(transformer)
    request = Request(transformer, args.size if not args.tiny else 64, device)

    if cuda:
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms, paths = request.step_ms(loaded.engine, device, args.iters)
    whole = {"ms": round(ms, 2), "paths": sorted(set(paths)),
             "weights_bytes": weights if cuda else 0,
             "run_bytes": torch.cuda.max_memory_allocated() - weights if cuda else 0}
    loaded.release_graphs("streamed plans next")
    print(json.dumps({"whole": whole}), flush=True)
    gbps = h2d_gbps(device, args.copy_mib) if cuda else None
    print(json.dumps({"h2d_gbps": gbps}), flush=True)

    rows = []
    for card in (cards if cuda else [0.0]):
        for row in run_card(loaded, request, card, args, whole, gbps, device):
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "layers": transformer.config.num_layers,
            "precision": args.precision if cuda else str(dtype)[6:], "size": args.size, "copy_mib": args.copy_mib,
            "h2d_gbps": gbps or 0.0, "reserve_gb": args.reserve_gb, "wall_s": round(time.perf_counter() - started, 1)}
    write_results("bench.streaming", args.out_dir, "streaming", markdown(meta, whole, rows),
                  {"meta": meta, "whole": whole, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
