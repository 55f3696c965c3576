"""`python -m bench.gguf`: GGUF transformers at full size against the bf16 file, for the targets of the GGUF work.

The bench model's random bf16 weights (`model.py`) are written into a temporary folder as a bf16 safetensors file
and as ComfyUI-GGUF files (Q8_0, and Q4_K_M-like: Q6_K for `attn.to_v` / `img_mlp.out`, Q4_K for the other block
Linears; quantized on the GPU by graph_runtime/tiny_gguf.py), then, in one process:

- load: each file from nothing to the INT8 fast path on the GPU (the bf16 file read onto the GPU, then
  `apply_precision(int8)` there; a GGUF file dequantized on the GPU tensor by tensor and made int8 block by block
  while it is read, as the loader node does), the best of two; the Q4_K_M file also dequantized on the CPU (the
  torch port on the host's cores), to show what the GPU saves. Per load: the peak host memory (anonymous RSS above
  the start, sampled every 5 ms; the file's page cache is not counted) and the peak GPU memory (allocated, above the
  start), each over the final model's size;
- step: the 1024x1024 decode step (graph replay, int8) of each loaded model, ms, and each GGUF's over the bf16
  file's (alternated: bf16, GGUFs, bf16 again; the bf16 figure is the median of its rounds);
- reference: the GGUF way of ComfyUI-GGUF: block Linears that keep the file's quantized bytes on the GPU and
  dequantize them on every call (the torch port), bf16 compute, the whole prompt every step (no prefix cache): one
  step's forward of every branch, ms, and ours over it.

Results go to `bench/results/gguf-<time>.md` and `.json` with the command. `--tiny --device cpu` is a smoke run of
this script (eager steps; no GPU figures). `--keep DIR` keeps the written files, for
`python -m bench.gguf_quality DIR/transformer-Q4_K_M.gguf --original DIR/transformer_bf16.safetensors --device cuda`
(the per-block error of the loaded weights against the file's own and the original ones).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from graph_runtime.loading import gguf_torch, load_transformer
from graph_runtime.tiny_gguf import QUANTIZE, q4_k_m, write_k_quant_transformer

from .model import build_transformer
from .options import standalone_start
from .paths import OursPath, PathSpec, _reference_kwargs
from .runner import _prefixes, _select_scenarios
from .scenarios import build_inputs
from .timing import device_ms

TYPES = {"Q8_0": lambda name, value: "Q8_0", "Q4_K_M": q4_k_m}


class HostPeak:
    """The largest anonymous resident memory of this process (RssAnon: the heap, not the files' page cache) while
    inside, sampled every 5 ms, above its value on entry."""

    def __init__(self):
        self.peak = self.start = 0
        self._stop = threading.Event()

    @staticmethod
    def anon_bytes() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.anon_bytes())

    def __enter__(self):
        self.start = self.peak = self.anon_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.anon_bytes())
        return False

    @property
    def above_start(self) -> int:
        return self.peak - self.start


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def timed_load(path, device, dequantize_device=None, dtype=torch.bfloat16):
    """(model, row): `path` loaded to the int8 fast path on `device` as the loader node does it."""
    from graph_runtime.fp8 import apply_precision
    from graph_runtime.loading.gguf_files import is_gguf

    gc.collect()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    gpu_start = torch.cuda.memory_allocated(device) if cuda else 0
    with HostPeak() as host:
        start = time.perf_counter()
        gguf = is_gguf(path)
        model = load_transformer(path, dtype=dtype, device=device, gguf_int8_on=device if gguf else None,
                                 dequantize_device=dequantize_device)
        if not gguf:
            apply_precision(model, "int8", device=device)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    final = model_bytes(model)
    row = {"file": Path(path).name, "dequantized_on": str(dequantize_device or device), "load_s": round(seconds, 2),
           "final_gib": round(final / 2**30, 3), "host_peak_gib": round(host.above_start / 2**30, 3),
           "host_peak_over_final": round(host.above_start / final, 3)}
    if cuda:
        gpu_peak = torch.cuda.max_memory_allocated(device) - gpu_start
        row.update(gpu_peak_gib=round(gpu_peak / 2**30, 3), gpu_peak_over_final=round(gpu_peak / final, 3))
    return model, row


def best_load(path, device, repeats: int, dtype):
    """The fastest of `repeats` loads (the first of the process also pays for imports and CUDA's start); the model of
    the last one."""
    rows, model = [], None
    for _ in range(repeats):
        del model
        model, row = timed_load(path, device, dtype=dtype)
        rows.append(row)
        print(json.dumps(row), flush=True)
    best = min(rows, key=lambda r: r["load_s"])
    return model, {**best, "load_s_all": [r["load_s"] for r in rows]}


def our_step_ms(model, inputs, device, iters: int) -> float:
    spec = PathSpec("graph") if torch.device(device).type == "cuda" else PathSpec("eager", mode="eager")
    path = OursPath(spec, model)
    with torch.no_grad():
        prefixes = _prefixes(path.engine, inputs, with_target=False)
        ms = device_ms(path.step(inputs, prefixes), device, iters=iters, warmup=3)
        path.engine.release()
        for prefix in prefixes.values():
            prefix.release()
    return ms


class DequantizingLinear(torch.nn.Module):
    """A Linear that keeps a GGUF tensor's bytes and dequantizes them on every call (ComfyUI-GGUF's way)."""

    def __init__(self, raw: torch.Tensor, type_name: str, shape, bias, dtype):
        super().__init__()
        self.register_buffer("raw", raw)
        self.type_name, self.shape, self.bias, self.dtype = type_name, tuple(shape), bias, dtype

    def forward(self, x):
        weight = gguf_torch.dequantize(self.raw, self.type_name, self.shape).to(self.dtype)
        return torch.nn.functional.linear(x, weight, self.bias)


def gguf_reference(model, types):
    """`model` (consumed) with every block Linear a DequantizingLinear over the bytes `types` gives it, made by the
    same quantizer as the file's, from the same weights: the file's bytes (the blocks of a row never span rows, so
    the fused gate_up's bytes are its two halves')."""
    for block in model.transformer_blocks:
        for name, module in list(block.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            qtype = types(name + ".weight", module.weight)
            raw = QUANTIZE[qtype](module.weight.detach().reshape(-1, 256)).reshape(-1)
            parent, _, child = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, child,
                    DequantizingLinear(raw, qtype, module.weight.shape, module.bias, module.weight.dtype))
    return model


def reference_step_ms(model, inputs, device, iters: int) -> float:
    """One step the ComfyUI way: the whole sequence (prompt and image) through the forward, every branch."""
    def step():
        return [model(**_reference_kwargs(inputs, branch))[0] for branch in inputs.branches]

    with torch.no_grad():
        return device_ms(step, device, iters=iters, warmup=2)


def markdown(meta, loads, steps, references) -> str:
    lines = [f"# GGUF transformers, {meta['date']}", "",
             f"- device: {meta['device']}; torch {meta['torch']}; {meta['layers']} blocks, random bf16 weights "
             f"written as {', '.join(meta['files'])}; scenario {meta['scenario']}",
             f"- command: `{meta['command']}` ({meta['wall_s']} s)", "",
             "## Load to the int8 fast path", "",
             "| file | dequantized on | load s (best) | over bf16 file | final GiB | host peak GiB (/ final) "
             "| GPU peak GiB (/ final) |", "|---|---|---|---|---|---|---|"]
    bf16 = next(r["load_s"] for r in loads if r["file"].endswith(".safetensors"))
    for r in loads:
        gpu = f"{r['gpu_peak_gib']:.2f} ({r['gpu_peak_over_final']:.2f})" if "gpu_peak_gib" in r else "-"
        lines.append(f"| {r['file']} | {r['dequantized_on']} | {r['load_s']:.1f} | {r['load_s'] / bf16:.2f} | "
                     f"{r['final_gib']:.2f} | {r['host_peak_gib']:.2f} ({r['host_peak_over_final']:.2f}) | {gpu} |")
    lines += ["", "## Step (int8, graph replay)", "", "| file | ms/step | over the bf16 file's int8 step | "
              "ComfyUI-GGUF way ms/step | ours faster by |", "|---|---|---|---|---|"]
    base = steps["bf16"]
    lines.append(f"| bf16 file | {base:.2f} | 1.000 | - | - |")
    for name, ms in steps.items():
        if name != "bf16":
            ref = references.get(name)
            lines.append(f"| {name} | {ms:.2f} | {ms / base:.3f} | {ref:.2f} | {ref / ms:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gguf", description=__doc__.split("\n")[0])
    parser.add_argument("--types", default="Q8_0,Q4_K_M", help="comma list of Q8_0, Q4_K_M")
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks (32 = the real model)")
    parser.add_argument("--scenario", default="t2i-1024")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per round (median reported)")
    parser.add_argument("--loads", type=int, default=2, help="loads per file (the best is reported)")
    parser.add_argument("--no-cpu-dequant", action="store_true", help="skip the Q4_K_M load dequantized on the CPU")
    parser.add_argument("--tmp", default=None, help="folder for the written files (default: the system's temp)")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="write the files into DIR and keep them (for bench.gguf_quality FILE --original ...)")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny 2-block model (a CPU smoke run)")
    args = parser.parse_args(argv)
    start = standalone_start("bench.gguf", args.device, argv)
    if start is None:
        return 2
    command, dtype = start
    started = time.perf_counter()
    types = [t for t in args.types.split(",") if t]
    scenario = _select_scenarios("tiny-t2i" if args.tiny else args.scenario, args.tiny)[0]
    keep = contextlib.nullcontext(args.keep) if args.keep else None
    with keep or tempfile.TemporaryDirectory(dir=args.tmp) as folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        from graph_runtime.tiny import save_safetensors

        model = build_transformer(tiny=args.tiny, layers=args.layers, device=args.device, dtype=dtype)
        config = model.config
        inputs = build_inputs(scenario, config.context_in_dim, config.in_channels, args.device, dtype)
        files = {"bf16": Path(folder) / "transformer_bf16.safetensors"}
        save_safetensors({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, files["bf16"])
        for name in types:
            files[name] = write_k_quant_transformer(model.state_dict(), Path(folder) / f"transformer-{name}.gguf",
                                                    TYPES[name])
            print(f"bench.gguf: wrote {files[name]} ({files[name].stat().st_size / 2**30:.2f} GiB)", flush=True)
        references = {}
        for name in types:  # one reference model at a time beside the bench model
            import copy

            reference = gguf_reference(copy.deepcopy(model), TYPES[name])
            references[name] = reference_step_ms(reference, inputs, args.device, max(3, args.iters // 4))
            print(json.dumps({"reference": name, "ms": round(references[name], 2)}), flush=True)
            del reference
        del model
        gc.collect()

        loads, models = [], {}
        for name, path in files.items():  # each peak is measured above what the models before it hold
            models[name], row = best_load(path, args.device, args.loads, dtype)
            loads.append(row)
        if "Q4_K_M" in files and not args.no_cpu_dequant and args.device != "cpu":
            cpu_model, row = timed_load(files["Q4_K_M"], args.device, dequantize_device="cpu")
            loads.append(row)
            print(json.dumps(row), flush=True)
            del cpu_model
        rounds = {name: [] for name in files}
        for name in ["bf16", *types, "bf16"]:
            rounds[name].append(our_step_ms(models[name], inputs, args.device, args.iters))
            print(json.dumps({"step": name, "ms": round(rounds[name][-1], 3)}), flush=True)
        steps = {name: statistics.median(ms) for name, ms in rounds.items()}
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "device": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor() or "cpu",
            "torch": torch.__version__, "layers": config.num_layers, "scenario": scenario.name,
            "files": ["bf16 safetensors", *types], "wall_s": round(time.perf_counter() - started, 1)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    md, js = out / f"gguf-{stamp}.md", out / f"gguf-{stamp}.json"
    md.write_text(markdown(meta, loads, steps, references))
    js.write_text(json.dumps({"meta": meta, "loads": loads, "steps": steps, "step_rounds": rounds,
                              "references": references}, indent=1) + "\n")
    print(f"bench.gguf: wrote {md} and {js}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
