"""`python -m bench.step_cache`: a whole prompt with the step cache at EasyCache's default settings against the same
prompt without it, in one process.

The prompt is the sampling loop the KV-Graph Sampler runs (`graph_runtime.sampling.sample`): 40 steps at 1024x1024 by
default, a 128-token random prompt embedding, the full-size random bf16 transformer of `model.py`, graph replay. The
cache is the KV-Graph Step Cache with core's EasyCache defaults (threshold 0.2, from 0.15 to 0.95), the rule core's
EasyCache node applies (tests/test_step_cache_comfyui.py checks the two skip the same steps).

A first prompt without the cache captures the graph; then, alternated, prompts without and with the cache (same seed).
Per prompt: wall time (synchronized at both ends), steps skipped, captures (0 after the first prompt) and replays
(= the computed steps). Against the prompt without the cache: the relative L2 change of the final latents. On random
weights that change is a check of the mechanics (the skipped steps reuse the last prediction), not a claim about image
quality.

With `--comfyui DIR` (a ComfyUI checkout whose `comfy` package imports in this Python), the same transformer and
engine also run core's own EasyCache node at its defaults with core's KSampler (euler, scheduler `simple`) on the
pack's MODEL, against KSampler without it, alternated the same way: the same columns, from ComfyUI's own code.

Results go to `bench/results/step-cache-<time>.md` and `.json` with the command that made them. `--tiny --device cpu`
is a smoke run of this script (eager steps, no graphs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.loaded import LoadedTransformer
from graph_runtime.sampling.sampler import SamplingRequest, sample
from graph_runtime.sampling.step_cache import StepCacheSettings

from .model import build_transformer
from .options import standalone_start, write_results
from .scenarios import TEXT_TOKENS
from .timing import wall_s

ROUNDS = ("without", "with", "without", "with")


def prompt_embeds(transformer, device, seed: int = 0) -> PromptEmbeds:
    generator = torch.Generator("cpu").manual_seed(seed)
    dtype = next(transformer.parameters()).dtype
    embeds = torch.randn(1, TEXT_TOKENS, transformer.config.context_in_dim, generator=generator).to(device, dtype)
    return PromptEmbeds(embeds=embeds, image_mask=torch.zeros(1, TEXT_TOKENS, dtype=torch.bool, device=device))


def one_prompt(engine, embeds, size: int, steps: int, cache: StepCacheSettings | None, device) -> dict:
    request = SamplingRequest(positive=embeds, latent_height=size // 16, latent_width=size // 16, steps=steps,
                              seed=42, step_cache=cache)
    result, seconds = wall_s(lambda: sample(engine, request), device)
    return prompt_row("KV-Graph Sampler", cache is not None, seconds, result.stats, result.latents)


def prompt_row(sampler: str, cache: bool, seconds: float, stats: dict, latents) -> dict:
    return {"sampler": sampler, "cache": cache, "s": round(seconds, 3), "skipped_steps": stats["skipped_steps"],
            "captures": stats["captures"], "replays": stats["replays"], "eager_steps": stats["eager_steps"],
            "latents": latents.float()}


def core_prompts(comfyui: str, loaded, embeds, size: int, steps: int, threshold: float, device) -> list[dict]:
    """Core's EasyCache (its node, its defaults but the threshold) with core's KSampler on the pack's MODEL over
    `loaded`, against KSampler alone: a first prompt without, then ROUNDS. ComfyUI's real `comfy` package under the
    tests' small fake of the rest (node API, folders, server)."""
    sys.path[:0] = [comfyui, str(Path(__file__).resolve().parents[1] / "tests")]
    if torch.device(device).type == "cpu":
        sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI picks its device from its command line
    import comfy.options

    comfy.options.enable_args_parsing()
    from comfy_fake.env import close_env, make_env

    env = make_env(device=device, real_comfy=comfyui)
    try:
        import comfy.sample
        from comfy_extras.nodes_easycache import EasyCacheNode

        from graph_runtime.comfy_interop.conditioning import prompt_to_conditioning
        from graph_runtime.loading import default_scheduler_config
        from graph_runtime.report import module_bytes

        core_model = sys.modules[f"{env.pack.__name__}.nodes.comfyui.core_model"]
        model = core_model.make_model_patcher(loaded, default_scheduler_config(), "base", device, "cpu",
                                              size=module_bytes(loaded.transformer))
        cached, = EasyCacheNode.execute(model, reuse_threshold=threshold, start_percent=0.15, end_percent=0.95,
                                        verbose=False).args
        conditioning = prompt_to_conditioning(PromptEmbeds(embeds.embeds.cpu(), embeds.image_mask.cpu()))
        latent = torch.zeros(1, loaded.transformer.config.in_channels, size // 16, size // 16)
        engine = loaded.engine

        def ksampler(patcher, with_cache):
            before = engine.stats.snapshot()
            noise = comfy.sample.prepare_noise(latent, 42)
            out, seconds = wall_s(lambda: comfy.sample.sample(patcher, noise, steps, 1.0, "euler", "simple",
                                                              conditioning, conditioning, latent, seed=42), device)
            return prompt_row("KSampler", with_cache, seconds, engine.stats.delta(before), out)

        rows = [ksampler(model, False)]
        rows += [ksampler(cached, True) if label == "with" else ksampler(model, False) for label in ROUNDS]
        return rows
    finally:
        close_env(env)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def markdown(meta: dict, rows: list[dict], summary: dict) -> str:
    lines = [f"# Step cache benchmark, {meta['date']}", "",
             f"- device: {meta['device']}; torch {meta['torch']}; {meta['layers']} blocks, random {meta['dtype']} "
             f"weights; {meta['size']}x{meta['size']}, {meta['steps']} steps, cache: {meta['cache']}",
             f"- command: `{meta['command']}` ({meta['wall_s']} s)",
             "- the latent change is measured on random weights: a check of the mechanics, not of image quality", "",
             "| prompt | sampler | cache | s | skipped steps | captures | replays | eager steps | latent change vs "
             "without (rel. L2) |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        change = "" if r["change"] is None else f"{r['change']:.3g}"
        lines.append(f"| {i + 1} | {r['sampler']} | {'with' if r['cache'] else 'without'} | {r['s']:.3f} | "
                     f"{r['skipped_steps']} | {r['captures']} | {r['replays']} | {sum(r['eager_steps'].values())} | "
                     f"{change} |")
    lines.append("")
    for sampler, numbers in summary.items():
        lines.append(f"{sampler}: median without {numbers['without_s']:.3f} s, with {numbers['with_s']:.3f} s "
                     f"({numbers['speedup']:.2f}x); skipped {numbers['skipped_steps']}/{meta['steps']} steps.")
    return "\n".join(lines) + "\n"


def summarize(rows: list[dict]) -> dict:
    """The prompts of one sampler: the relative change of each cached prompt's latents against the first prompt
    without the cache after the warm-up one, and the medians (the warm-up prompt, which captures, left out)."""
    reference = rows[1]["latents"]
    for r in rows:
        r["change"] = rel_l2(r["latents"], reference) if r["cache"] else None
    without = [r["s"] for r in rows[1:] if not r["cache"]]
    with_cache = [r["s"] for r in rows if r["cache"]]
    numbers = {"without_s": statistics.median(without), "with_s": statistics.median(with_cache),
               "skipped_steps": rows[-1]["skipped_steps"]}
    numbers["speedup"] = numbers["without_s"] / numbers["with_s"]
    return numbers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_cache", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (a multiple of 16)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threshold", type=float, default=StepCacheSettings().reuse_threshold)
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks (32 = the real model)")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny 2-block model (a CPU smoke run)")
    parser.add_argument("--comfyui", default=None, metavar="DIR",
                        help="a ComfyUI checkout: also run core's EasyCache with KSampler on the pack's MODEL")
    args = parser.parse_args(argv)
    start = standalone_start("bench.step_cache", args.device, argv)
    if start is None:
        return 2
    command, dtype = start
    started = time.perf_counter()
    transformer = build_transformer(tiny=args.tiny, layers=args.layers, device=args.device, dtype=dtype)
    loaded = LoadedTransformer(transformer)  # one engine (one set of graphs) for both samplers
    embeds = prompt_embeds(transformer, args.device)
    settings = StepCacheSettings(reuse_threshold=args.threshold)

    rows = [one_prompt(loaded.engine, embeds, args.size, args.steps, None, args.device)]  # captures the graph
    for label in ROUNDS:
        rows.append(one_prompt(loaded.engine, embeds, args.size, args.steps, settings if label == "with" else None,
                               args.device))
    summary = {"KV-Graph Sampler + KV-Graph Step Cache": summarize(rows)}
    if args.comfyui:
        core = core_prompts(args.comfyui, loaded, embeds, args.size, args.steps, args.threshold, args.device)
        summary["KSampler + core EasyCache"] = summarize(core)
        rows += core
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "latents"}), flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "device": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor() or "cpu",
            "torch": torch.__version__, "layers": transformer.config.num_layers, "dtype": str(dtype)[6:],
            "size": args.size, "steps": args.steps, "cache": settings.describe(),
            "wall_s": round(time.perf_counter() - started, 1)}
    rows_out = [{k: v for k, v in r.items() if k != "latents"} for r in rows]
    write_results("bench.step_cache", args.out_dir, "step-cache", markdown(meta, rows_out, summary),
                  {"meta": meta, "prompts": rows_out, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
