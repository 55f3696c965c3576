"""Decode steps on several GPUs against one GPU, in the same run: sequence parallelism (and CFG parallelism), each
rank replaying its own captured graphs.

    python -m bench.multi_gpu [--gpus 2,4] [--sizes 1024,2048] [--steps 10] [--cfg-size 1024]
    python -m bench.multi_gpu --tiny --device cpu --gpus 2 --sizes 128 --steps 3   # a smoke run of the script

For each image size: a text-to-image request (a 128-token prompt; the full-size transformer with random bf16 weights,
built on the first GPU) is sampled twice on one GPU and then twice on each GPU count, on the same model object (the
workers get its weights by broadcast). The first prompt on N GPUs starts the workers and captures every rank's
graphs; the second must capture nothing on any rank. Its decode ms/step (the sampler's own timing of the loop) is
compared with one GPU's second prompt. `--cfg-size` adds a true-CFG request at that size (CFG parallelism: one
branch per half of the GPUs). Results go to bench/results/multi-gpu-<stamp>.{md,json}, headed by the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.loaded import LoadedTransformer
from graph_runtime.parallel import sample_on_devices
from graph_runtime.sampling.sampler import SamplingRequest

from .model import build_transformer

ROOT = Path(__file__).resolve().parents[1]

PROMPT_TOKENS = 128


def _embeds(context_dim: int, device, dtype, seed: int) -> PromptEmbeds:
    generator = torch.Generator("cpu").manual_seed(seed)
    embeds = torch.randn(1, PROMPT_TOKENS, context_dim, generator=generator).to(device, dtype)
    return PromptEmbeds(embeds=embeds, image_mask=torch.zeros(1, PROMPT_TOKENS, dtype=torch.bool))


def _request(model, size: int, steps: int, cfg: bool) -> SamplingRequest:
    param = next(model.parameters())
    context = model.config.context_in_dim
    return SamplingRequest(positive=_embeds(context, param.device, param.dtype, 0), latent_height=size // 16,
                           latent_width=size // 16, steps=steps, seed=0,
                           negative=_embeds(context, param.device, param.dtype, 1) if cfg else None,
                           cfg=4.0 if cfg else 1.0)


def _twice(loaded, request, gpus: int) -> dict:
    """Two prompts on `gpus` devices: the first's wall time and captures, the second's step time and captures."""
    start = time.perf_counter()
    first = sample_on_devices(loaded, request, gpus)
    first_s = time.perf_counter() - start
    second = sample_on_devices(loaded, request, gpus)
    ranks = lambda result, key: [r[key] for r in result.stats.get("ranks", [result.stats])]  # noqa: E731
    plan = second.stats.get("parallel", {"world": 1, "cfg_groups": 1, "sp": 1})
    return {"gpus": gpus, "sp": plan["sp"], "cfg_groups": plan["cfg_groups"],
            "decode_ms": second.timings["decode_ms_per_step"], "prefill_ms": second.timings["prefill_ms"],
            "first_prompt_s": round(first_s, 2), "captures_first": ranks(first, "captures"),
            "captures_second": ranks(second, "captures"), "replays_second": ranks(second, "replays"),
            "eager_second": ranks(second, "eager_steps"),
            "max_diff_vs_1": None, "_latents": second.latents.float().cpu()}


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_transformer(tiny=args.tiny, layers=args.layers, device=device, dtype=dtype)
    loaded = LoadedTransformer(model)  # one owner: the engine and the ranks are kept between the runs
    scenarios = [(size, False) for size in args.sizes] + ([(args.cfg_size, True)] if args.cfg_size else [])
    rows = []
    for size, cfg in scenarios:
        request = _request(model, size, args.steps, cfg)
        base = _twice(loaded, request, 1)
        base_ms = base["decode_ms"]
        for row in [base] + [_twice(loaded, request, gpus) for gpus in args.gpus]:
            row.update(size=size, scenario="cfg" if cfg else "t2i",
                       speedup=round(base_ms / row["decode_ms"], 3) if row["decode_ms"] else None,
                       max_diff_vs_1=(row["_latents"] - base["_latents"]).abs().max().item())
            rows.append(row)
            print(_line(row), flush=True)
        for row in rows:
            row.pop("_latents", None)
    loaded.shutdown_parallel()
    return rows


def _line(row) -> str:
    return (f"{row['scenario']} {row['size']}x{row['size']} on {row['gpus']} (sp {row['sp']} x cfg "
            f"{row['cfg_groups']}): {row['decode_ms']:.2f} ms/step, x{row['speedup']} vs 1 GPU, first prompt "
            f"{row['first_prompt_s']} s, captures per rank {row['captures_first']} then {row['captures_second']}")


def _machine(device) -> str:
    if torch.device(device).type != "cuda":
        return "CPU (gloo processes)"
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    return f"{torch.cuda.device_count()} x {', '.join(sorted(names))}"


def write(rows, args, wall_s: float) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    out = ROOT / "bench" / "results" / f"multi-gpu-{stamp}"
    command = "python -m bench.multi_gpu " + " ".join(sys.argv[1:])
    meta = {"date": stamp, "command": command, "machine": _machine(args.device), "torch": torch.__version__,
            "layers": args.layers if not args.tiny else "tiny", "steps": args.steps, "wall_s": round(wall_s, 1)}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Decode on several GPUs, {stamp}", "", f"- machine: {meta['machine']}; torch {meta['torch']}",
             f"- command: `{command}` ({meta['wall_s']} s)",
             f"- model: {'tiny' if args.tiny else f'{args.layers} blocks, random bf16 weights'}; "
             f"{PROMPT_TOKENS}-token prompt; {args.steps} steps; ms/step of the second prompt (graphs replayed)", "",
             "| scenario | size | GPUs | sp x cfg | ms/step | speed-up vs 1 GPU | first prompt s | captures per rank "
             "(1st prompt) | captures per rank (2nd) | max abs diff vs 1 GPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['size']} | {r['gpus']} | {r['sp']} x {r['cfg_groups']} | "
                     f"{r['decode_ms']:.2f} | {r['speedup']} | {r['first_prompt_s']} | {r['captures_first']} | "
                     f"{r['captures_second']} | {r['max_diff_vs_1']:.2e} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multi_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="2,4", help="GPU counts to compare with one GPU (default 2,4)")
    parser.add_argument("--sizes", default="1024,2048", help="square image sizes in pixels (default 1024,2048)")
    parser.add_argument("--cfg-size", type=int, default=1024, help="also a true-CFG request at this size (0: none)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="the tiny transformer (a smoke run of the script)")
    args = parser.parse_args(argv)
    args.gpus = [int(g) for g in args.gpus.split(",") if g]
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    start = time.perf_counter()
    rows = run(args)
    out = write(rows, args, time.perf_counter() - start)
    print(f"wrote {out}.md and {out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
