"""`bench.prefix_placement --card GB`: the int8 and host prefix rows on an emulated card (graph_runtime/free_memory.py
`emulate_card`: the allocator capped to that size), the transformer loaded as the memory planner plans it for that
card (resident blocks, the others streamed through slots), against the uncapped whole-GPU step.

Issue 42's target is of this form: a 2-reference 1024x1024 edit on a 16 GB card, host prefix <= 1.3x the whole-GPU
step."""

from __future__ import annotations

import statistics

import torch

from graph_runtime.free_memory import device_free_bytes, emulate_card
from graph_runtime.loaded import LoadedTransformer
from graph_runtime.memory import GenerationShape, ModelSizes, plan_memory
from graph_runtime.memory.plan import default_bandwidth

from .streaming import unload  # back to nothing on the device: no streamer, no graphs, the weights on the host

GB = 10**9
CAPPED = ("int8", "host")


def card_plan(transformer, inputs, placement: str, available: int, mode: str):
    """The planner's plan for this scenario with the prefix forced to `placement` within `available` device bytes."""
    layout = inputs.branches[0].layout
    side = int(layout.target_tokens ** 0.5) * 16  # the scenarios are square
    shape = GenerationShape(width=side, height=side, prefix_tokens=(layout.prefix_len,), decode_mode=mode,
                            prefix_placement=placement)
    return plan_memory(ModelSizes.of(transformer), shape, available, placements=(placement,),
                       bandwidth=default_bandwidth(next(transformer.parameters()).device))


def capped_rows(transformer, inputs, card_gb: float, rounds: int, iters: int, device, gpu: dict, gpu_output,
                prefilled, step_ms) -> dict:
    """Per capped placement: the plan for the card, its replayed step (median over `rounds` of `iters`), the ratio
    to the uncapped `gpu` row, the peak device memory and the output against the gpu prefix's `gpu_output`. The
    transformer is back whole on `device` afterwards. `prefilled` and `step_ms` are prefix_placement's."""
    cuda = torch.device(device).type == "cuda"
    mode = "graph" if cuda else "eager"
    loaded = LoadedTransformer(transformer)
    rows = {}
    try:
        for placement in CAPPED:
            unload(loaded, cuda)
            # On the CPU nothing is capped: the plan is made for the card's size, a smoke run of the path.
            emulate_card(device, int(card_gb * GB))
            free = device_free_bytes(device)
            available = int(card_gb * GB) if free is None else free
            plan = card_plan(transformer, inputs, placement, available, mode)
            if plan.streamed_blocks:
                loaded.follow_plan(device, plan)
            else:
                transformer.to(device)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            engine = loaded.engine
            try:
                prefix, first = prefilled(engine, inputs, placement, mode)
                times = [step_ms(engine, prefix, inputs, mode, iters) for _ in range(rounds)]
            except torch.OutOfMemoryError as exc:  # the plan did not hold on the card: a result, not a crash
                rows[placement] = {"card_gb": card_gb, "plan": plan.describe(), "fits": plan.fits,
                                   "error": f"out of memory on the card: {str(exc).splitlines()[0]}"}
                continue
            output = first.output.float()
            ms = round(statistics.median(times), 3)
            rows[placement] = {
                "card_gb": card_gb, "plan": plan.describe(), "fits": plan.fits,
                "resident_blocks": plan.resident_blocks, "streamed_blocks": plan.streamed_blocks,
                "planned_step_ms": round(plan.step_ms, 1), "ms": ms, "all_ms": [round(t, 3) for t in times],
                "vs_gpu": round(ms / gpu["ms"], 3), "first_path": first.path,
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                "rel_l2_vs_gpu_prefix": float((output - gpu_output).norm() / gpu_output.norm().clamp_min(1e-30)),
                "bit_equal_to_gpu": bool(torch.equal(output, gpu_output)),
            }
            prefix.release()
            del prefix, first
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        unload(loaded, cuda)
        transformer.to(device)
    return rows


def markdown(rows: dict) -> list[str]:
    """The capped rows' table and each row's plan, for the results file."""
    if not rows:
        return []
    card = next(iter(rows.values()))["card_gb"]
    lines = ["", f"## On an emulated {card:g} GB card (the gpu row above uncapped: the whole-GPU reference)", "",
             "| prefix | resident / streamed blocks | step ms (median) | vs whole-GPU gpu step | planned ms | peak "
             "GiB | first step | rel. L2 vs gpu prefix |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for placement, r in rows.items():
        if "error" in r:
            lines.append(f"| {placement} | {r['error']} | | | | | | |")
            continue
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {placement} | {r['resident_blocks']} / {r['streamed_blocks']} | {r['ms']:.2f} | "
                     f"{r['vs_gpu']:.3f}x | {r['planned_step_ms']:.0f} | {peak} | {r['first_path']} | "
                     f"{r['rel_l2_vs_gpu_prefix']:.3g} |")
    lines.append("")
    lines += [f"- {placement}: {r['plan']}" for placement, r in rows.items()]
    if "vs_gpu" in rows["host"]:
        lines += ["", f"host prefix on the {card:g} GB card: {rows['host']['vs_gpu']:.3f}x the whole-GPU step (issue "
                      "42's target for the 2-reference edit on 16 GB: <= 1.3x)"]
    return lines
