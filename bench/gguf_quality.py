"""What loading a GGUF transformer costs in quality and in time.

    python -m bench.gguf_quality FILE.gguf [--original BF16.safetensors] [--precision int8|bf16] [--device cuda]
    python -m bench.gguf_quality --tiny             # the tiny model, every type make-tiny writes
    python -m bench.gguf_quality --dequant-speed    # gguf's numpy dequantizer, seconds per GiB of file
    python -m bench.gguf_quality FILE.gguf --load-time BF16.safetensors --device cuda   # load to int8, both files

Quality, per block (the block's Linear weights taken together, relative Frobenius norm `||A - B|| / ||B||`):
- `loaded`: the weights as loaded (bf16, or INT8 ConvRot quantized from them at load for `int8`) against the file's own
  dequantized weights: the second rounding the load adds;
- with the original float weights: `gguf` (the file's own error against them), `int8 bound` (INT8 ConvRot of the
  original weights against them: ComfyUI's INT8 file's error, the pack's quality bound) and `total` (loaded against
  the original).
"""

from __future__ import annotations

import argparse
import re
import time

import numpy as np
import torch

from graph_runtime.fp8 import apply_precision
from graph_runtime.loading import load_transformer, transformer_from_comfy_state_dict
from graph_runtime.loading.gguf_files import GGUFFile
from graph_runtime.quantized import ConvRotInt8Linear, dequantize_weight, quantize_weight

BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.(.+)\.weight$")


def file_weights(path) -> dict[str, torch.Tensor]:
    """The file's block Linear weights, dequantized by gguf (fp32), in diffusers' names."""
    file = GGUFFile(path, "a GGUF transformer")
    keys = [k for k in file.tensors if BLOCK.match(k) and len(file.tensors[k].shape) == 2]
    return transformer_from_comfy_state_dict({k: torch.from_numpy(np.array(file.dequantized(k), np.float32))
                                              for k in keys})


def loaded_weights(path, precision: str, device) -> dict[str, torch.Tensor]:
    """The block Linear weights the loader gives for `precision` (int8: as the int8 layers compute with), fp32."""
    model = load_transformer(path, dtype=torch.bfloat16, device=device)
    if precision == "int8":
        apply_precision(model, "int8", device=device)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ConvRotInt8Linear):
            out[name + ".weight"] = module.dequantized_weight(torch.float32).cpu()
        elif isinstance(module, torch.nn.Linear):
            out[name + ".weight"] = module.weight.detach().float().cpu()
    return out


def int8_rounded(weight: torch.Tensor, group: int) -> torch.Tensor:
    q, scale = quantize_weight(weight.to(torch.bfloat16), group)
    return dequantize_weight(q, scale, group).float()


def _by_block(keys):
    blocks: dict[int, list[str]] = {}
    for key in keys:
        if m := BLOCK.match(key):
            blocks.setdefault(int(m.group(1)), []).append(key)
    return dict(sorted(blocks.items()))


def _relative(a: dict, b: dict, keys) -> float:
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in keys)
    den = sum(float(b[k].float().pow(2).sum()) for k in keys)
    return (num / den) ** 0.5 if den else 0.0


def block_errors(path, precision: str = "int8", device="cpu", original: dict | None = None) -> list[dict]:
    """One row per block: `loaded` always; `gguf`, `int8_bound`, `total` when `original` (diffusers-named float
    weights) is given."""
    from graph_runtime.fp8.convert import int8_group

    ours, theirs = loaded_weights(path, precision, device), file_weights(path)
    rows = []
    for block, keys in _by_block(theirs).items():
        row = {"block": block, "loaded": _relative(ours, theirs, keys)}
        if original is not None:
            bound = {k: int8_rounded(original[k], int8_group(original[k].shape[-1])) for k in keys}
            row.update(gguf=_relative(theirs, original, keys), int8_bound=_relative(bound, original, keys),
                       total=_relative(ours, original, keys))
        rows.append(row)
    return rows


def dequant_speed(types=("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "BF16", "F16"), rows: int = 4096,
                  cols: int = 4096, repeat: int = 2) -> list[dict]:
    """gguf's numpy dequantizer on a [rows, cols] tensor of each type (random bytes for the types gguf cannot write:
    the speed does not depend on the values). Seconds per GiB of file data and per billion weights."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    out = []
    for name in types:
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            data = quantize(rng.standard_normal((rows, cols), dtype=np.float32), qtype)
        except NotImplementedError:
            data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            with np.errstate(all="ignore"):  # random bytes make NaN scales
                dequantize(data, qtype)
            best = min(best, time.perf_counter() - start)
        out.append({"type": name, "s_per_gib": best / (data.nbytes / 2**30), "s_per_gweights": best / (rows * cols / 1e9)})
    return out


def load_seconds(path, device, precision: str = "int8") -> float:
    """Seconds from nothing to the model on `device` at `precision` (the loader's bf16 read, then the conversion)."""
    from graph_runtime.loading.gguf_files import is_gguf

    start = time.perf_counter()
    early = precision == "int8" and is_gguf(path)  # as the loader node does: int8 block by block while reading
    model = load_transformer(path, dtype=torch.bfloat16, device=device, gguf_int8_on=device if early else None)
    if precision == "int8" and not early:
        apply_precision(model, "int8", device=device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del model
    return seconds


def tiny_rows(precision: str) -> dict[str, list[dict]]:
    import tempfile
    from pathlib import Path

    from graph_runtime.tiny import build_tiny_components
    from graph_runtime.tiny_gguf import GGUF_TYPES, write_gguf_transformer

    original = {k: v.float() for k, v in build_tiny_components(0)["transformer"].state_dict().items()}
    with tempfile.TemporaryDirectory() as folder:
        return {t: block_errors(write_gguf_transformer(original, Path(folder) / f"{t}.gguf", t), precision,
                                original=original) for t in GGUF_TYPES}


def _print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    columns = [c for c in ("loaded", "gguf", "int8_bound", "total") if c in rows[0]]
    print("| block | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row['block']} | " + " | ".join(f"{row[c]:.2e}" for c in columns) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gguf_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?")
    parser.add_argument("--original", help="the float transformer the GGUF was made from (any file the loader reads)")
    parser.add_argument("--precision", default="int8", choices=("int8", "bf16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--dequant-speed", action="store_true")
    parser.add_argument("--load-time", metavar="FLOAT_FILE",
                        help="time loading FILE and this float file to --precision on --device (ratio: target 1.5)")
    args = parser.parse_args(argv)
    if args.dequant_speed:
        print("| type | s per GiB of file | s per 10^9 weights |\n|---|---|---|")
        for row in dequant_speed():
            print(f"| {row['type']} | {row['s_per_gib']:.2f} | {row['s_per_gweights']:.2f} |")
    if args.tiny:
        for qtype, rows in tiny_rows(args.precision).items():
            _print_rows(f"{qtype} -> {args.precision}", rows)
    if args.file and args.load_time:
        # the best of two each: the first load of the process also pays for imports and CUDA's start
        ours, theirs = (min(load_seconds(f, args.device, args.precision) for _ in range(2))
                        for f in (args.file, args.load_time))
        print(f"load to {args.precision} on {args.device}: {args.file} {ours:.1f} s, {args.load_time} {theirs:.1f} s, "
              f"ratio {ours / theirs:.2f}")
    elif args.file:
        original = None
        if args.original:
            original = {k: v.float() for k, v in load_transformer(args.original, dtype=torch.bfloat16)
                        .state_dict().items() if BLOCK.match(k)}
        _print_rows(f"{args.file} -> {args.precision}", block_errors(args.file, args.precision, args.device, original))
    if not (args.dequant_speed or args.tiny or args.file):
        parser.error("name a FILE, --tiny or --dequant-speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
