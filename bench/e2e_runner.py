"""`python -m bench --e2e`: prompt to PNG, ours against diffusers' pipeline, first prompt and warm.

The parent process only plans and reports; every measurement runs in a child (`e2e_worker`) that builds its own
models, so a "first prompt" is the first of a fresh process: no kernel loaded, no plan made, no graph captured.
Compiled kernels survive restarts in two on-disk caches: Triton's (our kernels) and the CUDA driver's JIT cache
(kernels the libraries build at run time, ~1 s of a machine's first one-reference edit). Each run gives both a
folder of its own, empty at the start, so the machine's history does not change the figures: the first child of
ours meets them empty (a machine's very first prompt). A second child then runs every scenario once on every path,
unmeasured, so that every later child meets the caches a restart finds after that job has run once on the machine,
whatever its scenario and path. Then one child runs both paths warm, alternating them, in one process.

Results go to `bench/results/e2e-<time>.md` and `.json`, with the command that produced them.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .e2e_report import write_e2e_reports
from .e2e_scenarios import select
from .e2e_worker import SPAWNED_AT_ENV

WORKER_MODULE = __package__ + ".e2e_worker"
PATHS = ("ours", "diffusers")
EXTRAS = ("preload", "warm_up", "profile")


def plan_tasks(scenarios: list[str], paths: list[str], first: bool, warm: bool, device: str, tiny: bool,
               repeats: int, extras=True, fp8: str | None = None) -> list[dict]:
    """The child processes to run, in order. Ours' first child meets the empty kernel caches; a "fill" child then
    runs every scenario on every path once (unmeasured), and each later first-prompt child is a restart with the
    caches they filled. `fp8` names the FP8 precision of the "ours-fp8" path
    (`fp8/convert.py`: fp8, fp8-attn, ...), or None for no FP8 path. `extras`: True (all of EXTRAS), False, or
    the names of those to run."""
    extras = set(EXTRAS if extras is True else extras or ())
    base = {"device": device, "tiny": tiny, **({"fp8_precision": fp8} if fp8 else {})}
    tasks = []
    if first:
        if "ours" in paths:
            ours = {**base, "kind": "first", "paths": ["ours"], "cache": "warm"}
            tasks.append({**ours, "scenarios": scenarios[:1], "cache": "cold"})
            fill_paths = ["ours", *(["ours-fp8"] if fp8 else []), *(["diffusers"] if "diffusers" in paths else [])]
            tasks.append({**base, "kind": "fill", "paths": fill_paths, "scenarios": scenarios, "cache": "warm"})
            tasks += [{**ours, "scenarios": [s]} for s in scenarios]
            # The first job again: without the preload and with its Triton part alone (what each saves), after
            # the engine's warm_up at load (kernels only, then with its graphs kept), and profiled (where the first
            # prompt's extra time goes).
            if "preload" in extras:
                tasks += [{**ours, "scenarios": scenarios[:1], "preload": p} for p in (False, "triton")]
            if "warm_up" in extras:
                tasks += [{**ours, "scenarios": scenarios[:1], "warm_up": w} for w in ("kernels", "capture")]
            if "profile" in extras:
                tasks.append({**ours, "kind": "profile", "scenarios": scenarios[:1]})
            if fp8:
                # The FP8 transformer's first prompt, alone on the card but for the text encoder and VAE (its
                # DiT-side peak is the memory target's figure).
                tasks.append({**ours, "paths": ["ours-fp8"], "scenarios": scenarios[:1]})
        if "diffusers" in paths:
            tasks += [{**base, "kind": "first", "paths": ["diffusers"], "scenarios": [s], "cache": "warm"}
                      for s in scenarios]
    if warm:
        warm_paths = list(paths) + (["ours-fp8"] if fp8 and "ours" in paths else [])
        tasks.append({**base, "kind": "warm", "paths": warm_paths, "scenarios": scenarios, "repeats": repeats,
                      "cache": "warm"})
    return tasks


def fp8_precision(option: str) -> str | None:
    """`--e2e-precisions`: "bf16" alone, or "bf16," and one FP8 precision (fp8, fp8-attn, fp8-no-out)."""
    from graph_runtime.fp8 import PRECISIONS

    precisions = [p.strip() for p in option.split(",") if p.strip()]
    fp8 = [p for p in precisions if p != "bf16"]
    if "bf16" not in precisions or len(fp8) > 1 or any(p not in PRECISIONS for p in fp8):
        raise SystemExit(f"--e2e-precisions: {option!r}; bf16, or bf16 and one of "
                         f"{', '.join(p for p in PRECISIONS if p != 'bf16')} (bf16,fp8-attn)")
    return fp8[0] if fp8 else None


def describe_task(task: dict) -> str:
    many = {"warm": "warm", "fill": "cache fill (unmeasured)"}.get(task["kind"])
    if many:  # a child that runs every scenario on every path
        return f"{many}: {'+'.join(task['paths'])} x {','.join(task['scenarios'])}"
    warm_up = f", warm_up({task['warm_up']}) at load" if task.get("warm_up") else ""
    preload = {False: ", no preload", "triton": ", Triton preload only"}.get(task.get("preload"), "")
    return (f"{task['kind']}: {task['paths'][0]} {task['scenarios'][0]} "
            f"(kernel cache {task['cache']}{warm_up}{preload})")


def run_child(task: dict, workdir: Path, index: int, cache_dirs: dict, timeout: int) -> dict:
    """Run one task in a fresh interpreter; its output is streamed with a prefix. A failure (exit, timeout) becomes
    an `error` record, so one broken child does not lose the rest of the run."""
    task_path, out_path = workdir / f"task-{index}.json", workdir / f"result-{index}.json"
    task_path.write_text(json.dumps(task))
    root = str(Path(__file__).resolve().parents[1])  # the repository: the child imports `bench` from it
    env = dict(os.environ, **cache_dirs, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    label = describe_task(task)
    print(f"bench e2e: [{index}] {label}", flush=True)
    tail: list[str] = []
    env[SPAWNED_AT_ENV] = repr(time.time())
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(task_path), str(out_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-40]
            print(f"  [{index}] {line}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        tail.append(f"(killed after {timeout} s)")
    reader.join(timeout=10)
    wall = time.perf_counter() - started
    if code != 0 or not out_path.is_file():
        return {"task": task, "label": label, "wall_s": wall, "error": f"exit code {code}", "log_tail": tail[-20:]}
    result = json.loads(out_path.read_text())
    result.update(label=label, wall_s=wall)
    return result


def e2e_main(args) -> int:
    import torch

    device = args.device
    if device != "cpu" and not torch.cuda.is_available():
        print("bench --e2e: no CUDA device; run with --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    started = time.perf_counter()
    command = command_line(args)
    scenarios = [s.name for s in select(args.e2e_scenarios, args.tiny)]
    paths = [p.strip() for p in args.e2e_paths.split(",") if p.strip()]
    if not paths or any(p not in PATHS for p in paths):
        raise SystemExit(f"--e2e-paths: {args.e2e_paths!r}; choose from {', '.join(PATHS)}")
    first, warm = (args.e2e_first or not args.e2e_warm), (args.e2e_warm or not args.e2e_first)
    fp8 = fp8_precision(args.e2e_precisions)
    extras = [e.strip() for e in args.e2e_extras.split(",") if e.strip()]
    if any(e not in EXTRAS for e in extras):
        raise SystemExit(f"--e2e-extras: {args.e2e_extras!r}; a comma list of {', '.join(EXTRAS)}")
    tasks = plan_tasks(scenarios, paths, first, warm, device, args.tiny, args.e2e_repeats,
                       False if args.e2e_no_extras else extras, fp8=fp8)
    workdir = Path(tempfile.mkdtemp(prefix="kvgraph-e2e-"))
    # Empty: the first child of ours meets cold kernel caches, Triton's and the CUDA driver's JIT cache.
    cache_dirs = {"TRITON_CACHE_DIR": str(workdir / "triton-cache"), "CUDA_CACHE_PATH": str(workdir / "cuda-cache")}
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "device": device, "torch": torch.__version__, "triton": None, "tiny": args.tiny,
            "fp8_precision": fp8,
            "planned": [describe_task(t) for t in tasks]}
    results: list[dict] = []
    try:
        for i, task in enumerate(tasks):
            results.append(run_child(task, workdir, i, cache_dirs, args.e2e_timeout))
            env = next((r["env"] for r in results if "env" in r), None)
            if env:
                meta.update(device=env["device"], torch=env["torch"], triton=env["triton"])
            meta["wall_s"] = round(time.perf_counter() - started, 1)
            # Rewritten after every child: a run cut short still leaves the results it has.
            md, js = write_e2e_reports(Path(args.out_dir), meta, results)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    failed = [r["label"] for r in results if "error" in r]
    for line in summary_lines(results):
        print("bench e2e: " + line, flush=True)
    print(f"bench e2e: wrote {md} and {js} in {meta['wall_s']} s" + (f"; FAILED: {failed}" if failed else ""),
          flush=True)
    return 1 if failed else 0


def command_line(args) -> str:
    """The command that reproduces this run: `bench --e2e` and every option that differs from its default (read off
    the parsed options, so it is right however the benchmark was called)."""
    import argparse

    from .options import add_bench_arguments

    defaults = argparse.ArgumentParser()
    add_bench_arguments(defaults)
    parts = ["python -m bench --e2e"]
    for action in defaults._actions:
        if not action.option_strings or action.dest in ("help", "e2e"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        parts.append(flag if isinstance(value, bool) else f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


def warm_medians(results: list[dict]) -> dict:
    """{(path, scenario): median total ms of the measured warm runs}."""
    totals: dict = {}
    for result in results:
        if result.get("task", {}).get("kind") != "warm":
            continue
        for run in result.get("runs", []):
            if run["run"].startswith("warm "):
                totals.setdefault((run["path"], run["scenario"]), []).append(run["total_ms"])
    return {key: statistics.median(values) for key, values in totals.items()}


def summary_lines(results: list[dict]) -> list[str]:
    lines = []
    warm = warm_medians(results)
    for (path, scenario), ms in sorted(warm.items()):
        lines.append(f"warm {path} {scenario}: {ms / 1e3:.3f} s")
    for result in results:
        if result.get("task", {}).get("kind") in ("first", "profile") and "runs" in result:
            first = next(r for r in result["runs"] if r["run"].startswith("first"))
            second = next(r for r in result["runs"] if r["run"] == "second")
            lines.append(f"{result['label']}: first {first['total_ms'] / 1e3:.3f} s, second "
                         f"{second['total_ms'] / 1e3:.3f} s")
    return lines
