"""Command-line options of `python -m bench` and the start its stand-alone benchmarks (`bench.lora`,
`bench.step_cache`) share."""

import datetime
import json
import platform
import shlex
import sys
from pathlib import Path

import torch


def standalone_start(prog: str, device: str, argv) -> tuple[str, torch.dtype] | None:
    """The command line to write into the results (`argv`: what `main` was given, None: the process's own) and the
    weights' dtype (bf16 on a GPU, fp32 for a CPU smoke run); None, said on stderr, where `device` needs CUDA and
    there is none."""
    if device != "cpu" and not torch.cuda.is_available():
        print(f"{prog}: no CUDA device; run with --device cpu --tiny for a smoke run", file=sys.stderr)
        return None
    used = sys.argv[1:] if argv is None else argv
    command = f"python -m {prog} " + " ".join(shlex.quote(a) for a in used)
    return command, torch.bfloat16 if device != "cpu" else torch.float32


def standalone_meta(command: str, device: str, transformer, dtype: torch.dtype, wall_s: float, **extra) -> dict:
    """What a stand-alone benchmark's results are headed by: when, the command, the machine, the model."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "device": torch.cuda.get_device_name() if device != "cpu" else platform.processor() or "cpu",
            "torch": torch.__version__, "layers": transformer.config.num_layers, "dtype": str(dtype)[6:],
            **extra, "wall_s": round(wall_s, 1)}


def write_results(prog: str, out_dir, kind: str, markdown: str, payload: dict) -> None:
    """`<kind>-<UTC stamp>.md` and `.json` into `out_dir`, said on stdout as `<prog>: wrote ...`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    md, js = out / f"{kind}-{stamp}.md", out / f"{kind}-{stamp}.json"
    md.write_text(markdown)
    js.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{prog}: wrote {md} and {js}", flush=True)


def add_bench_arguments(parser) -> None:
    parser.add_argument("--scenarios", default="default", help="'default', 'quick' or a comma list of names")
    parser.add_argument("--paths", default="default",
                        help="comma list of paths, 'default' (diffusers, eager, graph, compile+graph) or 'all'")
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks (32 = the real model)")
    parser.add_argument("--iters", type=int, default=10, help="timed decode steps per path (median reported)")
    parser.add_argument("--out-dir", default="bench/results", help="where the markdown and JSON results go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny 2-block model (a CPU smoke run of the bench)")
    parser.add_argument("--profile", action="store_true", help="also print a kernel table of the fastest path")
    # The prompt-to-image benchmark (e2e_runner.py).
    parser.add_argument("--e2e", action="store_true",
                        help="prompt to PNG instead of the decode step: ours vs diffusers' pipeline, full-size random "
                             "DiT + Qwen3-VL-8B + VAE, first prompt of a fresh process and warm")
    parser.add_argument("--e2e-scenarios", default="t2i,turbo,edit", help="comma list of t2i, turbo, edit")
    parser.add_argument("--e2e-paths", default="ours,diffusers", help="comma list of ours, diffusers")
    parser.add_argument("--e2e-first", action="store_true", help="only the first-prompt runs (fresh processes)")
    parser.add_argument("--e2e-warm", action="store_true", help="only the warm runs (both paths in one process)")
    parser.add_argument("--e2e-no-extras", action="store_true",
                        help="first prompts without the extra children of ours' first job (--e2e-extras)")
    parser.add_argument("--e2e-extras", default="preload,warm_up,profile",
                        help="the extra children of ours' first job: preload (without the preload, and Triton's "
                             "part alone), warm_up (after warm_up at load), profile")
    parser.add_argument("--e2e-precisions", default="bf16",
                        help="bf16, or bf16 and one FP8 precision (bf16,fp8-attn): also our path with that FP8 "
                             "transformer (graph_runtime/fp8)")
    parser.add_argument("--e2e-repeats", type=int, default=2, help="measured warm prompts per scenario and path")
    parser.add_argument("--e2e-timeout", type=int, default=300, help="seconds a benchmark process may take")
