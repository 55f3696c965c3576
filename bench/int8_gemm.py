"""The decode step's GEMMs per shape: bf16, FP8, cuBLAS int8, comfy-kitchen's INT8 and our Triton INT8 kernels.

    python -m bench.int8_gemm [--m 4096,16384] [--write-table] [--quick]

For each (N, K) of a Qwen-Image-2.1 block (q/k/v/out 4096x4096, q+k+v fused 12288x4096, gate or up 12288x4096,
gate+up fused 24576x4096, down 4096x12288) and each M (target tokens x batch: 4096 at 1024x1024, 16384 at
2048x2048), it times:

- `bf16`: `F.linear` (cuBLAS);
- `fp8`: `torch._scaled_mm` e4m3 with row-wise scales (the FP8 path's GEMM);
- `int_mm`: `torch._int_mm` (cuBLAS int8, int32 out) plus the scale epilogue in PyTorch;
- `ck`: comfy-kitchen's `int8_linear` from a bf16 input (its rotation and quantization included, as ComfyUI runs it);
- `ck_gemm`: comfy-kitchen's `int8_linear` without rotation from a bf16 input (its quantization included);
- `ours`: our INT8 GEMM from int8 rows (the kernels write the rows), every candidate tile config of both kernels;
- `quant`: our rotate + quantize pass over the input (what the standalone pass costs where no kernel fuses it).

Weights rotate over copies that together exceed the L2 cache, as consecutive Linears of a step do. Each time is the
median over CUDA-graph replays of 10 calls. Results go to `bench/results/int8-gemm-<stamp>.{md,json}`, with
the command. `--write-table` writes the fastest config per shape into `graph_runtime/kernels/int8_gemm_configs.py`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graph_runtime.kernels.int8_gemm import GemmConfig, launch, reference_int8_scaled_mm  # noqa: E402
from graph_runtime.kernels.int8_quant import quantize_rows_int8  # noqa: E402

SHAPES = [  # (name, N, K, uses per block)
    ("q/k/v/out", 4096, 4096, 4),
    ("qkv fused", 12288, 4096, 0),
    ("gate or up", 12288, 4096, 2),
    ("gate+up fused", 24576, 4096, 0),
    ("down", 4096, 12288, 1),
]
TILE_CONFIGS = [GemmConfig("tile", bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in [
    (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 256, 128, 8, 4),
    (256, 128, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 5), (64, 256, 128, 4, 4),
]]
TMA_CONFIGS = [GemmConfig("tma", bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in [
    (128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 256, 128, 8, 4),
    (256, 128, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 5), (256, 128, 64, 8, 4),
]]
L2_BYTES = 60 * 2**20


def time_graph(fn, calls: int = 10, replays: int = 7) -> float:
    """Median ms per call over CUDA-graph replays of `calls` calls (no launch overhead, as in a captured step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


class Rotating:
    """Cycles through `copies` weights per call, like the distinct Linears of a step (none stays in L2)."""

    def __init__(self, items):
        self.items, self.i = items, 0

    def next(self):
        item = self.items[self.i % len(self.items)]
        self.i += 1
        return item


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def measure_shape(name, n, k, m, configs, device, ck) -> dict:
    torch.manual_seed(0)
    copies = max(2, -(-2 * L2_BYTES // (n * k)))
    weights = [(torch.randn(n, k, device=device) * 0.02).bfloat16() for _ in range(copies)]
    x = torch.randn(m, k, device=device).bfloat16()
    ref = (x.float() @ weights[0].float().t())
    row = {"shape": name, "M": m, "N": n, "K": k, "weight_copies": copies}
    flop = 2.0 * m * n * k

    def record(key, ms, err=None, extra=None):
        row[f"{key}_ms"] = round(ms, 4)
        row[f"{key}_tflops"] = round(flop / ms / 1e9, 1)
        if err is not None:
            row[f"{key}_rel_err"] = round(err, 5)
        if extra:
            row.update(extra)

    w_bf16 = Rotating(weights)
    record("bf16", time_graph(lambda: F.linear(x, w_bf16.next())), rel_err(F.linear(x, weights[0]), ref))

    from graph_runtime.kernels.fp8_quant import reference_quantize_rows

    fp8 = [reference_quantize_rows(w) for w in weights]
    xq8, xs8 = reference_quantize_rows(x)
    w_fp8 = Rotating(fp8)

    def fp8_mm(pair=None):
        q, s = pair or w_fp8.next()
        return torch._scaled_mm(xq8, q.t(), scale_a=xs8, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)

    record("fp8", time_graph(fp8_mm), rel_err(fp8_mm(fp8[0]), ref))

    from graph_runtime.kernels.int8_quant import reference_quantize_rows_int8

    int8 = [reference_quantize_rows_int8(w) for w in weights]  # row-wise, unrotated: the GEMM does not care
    xq, xs = reference_quantize_rows_int8(x)
    w_int8 = Rotating(int8)
    int8_t = Rotating([(q.t(), s) for q, s in int8])  # _int_mm wants [K, N]; a transposed view is what it takes

    def int_mm(pair=None):
        q, s = pair or int8_t.next()
        return (torch._int_mm(xq, q).float() * xs * s.view(1, -1)).bfloat16()

    try:
        record("int_mm", time_graph(int_mm), rel_err(int_mm((int8[0][0].t(), int8[0][1])), ref))
    except Exception as exc:  # noqa: BLE001 - a shape cuBLAS refuses is a row of the table, not a crash
        row["int_mm_error"] = repr(exc)[:200]

    if ck is not None:
        from comfy_kitchen.tensor import TensorWiseINT8Layout

        ck_weights = []
        for w in weights:
            q, params = TensorWiseINT8Layout.quantize(w.float(), is_weight=True, per_channel=True, convrot=True,
                                                      convrot_groupsize=256)
            ck_weights.append((q, params.scale.float().reshape(-1, 1)))
        w_ck = Rotating(ck_weights)

        def ck_linear(pair=None, convrot=True):
            q, s = pair or w_ck.next()
            return torch.ops.comfy_kitchen.int8_linear(x, q, s, None, 2, convrot, 256)

        try:
            record("ck", time_graph(ck_linear), rel_err(ck_linear(ck_weights[0]), ref))
            record("ck_gemm", time_graph(lambda: ck_linear(w_int8.next(), convrot=False)))
        except Exception as exc:  # noqa: BLE001
            row["ck_error"] = repr(exc)[:200]

    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    exact = reference_int8_scaled_mm(xq, xs, int8[0][0], int8[0][1], out_dtype=torch.float32)
    best = None
    tried = []
    for config in configs:
        try:
            got = launch(xq, xs.reshape(-1), int8[0][0], int8[0][1].reshape(-1), None, out, config)
            err = (got.float() - exact).abs().max().item() / exact.abs().max().item()
            if err > 2 ** -7:  # bf16 output rounding is 2^-9 relative; more is a wrong kernel
                tried.append({"config": config._asdict(), "error": f"wrong result, max rel err {err:.3g}"})
                continue

            def ours():
                q, s = w_int8.next()
                return launch(xq, xs.reshape(-1), q, s.reshape(-1), None, out, config)

            ms = time_graph(ours)
            tried.append({"config": config._asdict(), "ms": round(ms, 4)})
            if best is None or ms < best[0]:
                best = (ms, config)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is reported
            tried.append({"config": config._asdict(), "error": repr(exc)[:300]})
    if best is not None:
        got = launch(xq, xs.reshape(-1), int8[0][0], int8[0][1].reshape(-1), None, out, best[1])
        record("ours", best[0], rel_err(got, ref), {"ours_config": best[1]._asdict()})
        row["ours_vs_bf16"] = round(row["bf16_ms"] / best[0], 3)
        row["ours_vs_fp8"] = round(row["fp8_ms"] / best[0], 3)
    row["tried"] = tried
    xs_in = x
    for rotate in (False, True):
        record(f"quant_rot{int(rotate)}", time_graph(lambda: quantize_rows_int8(xs_in, rotate)))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="4096,16384", help="token counts (comma-separated); default: %(default)s")
    parser.add_argument("--kernels", default="tile,tma", help="which of our kernels to sweep; default: %(default)s")
    parser.add_argument("--write-table", action="store_true", help="write the fastest configs into the kernel table")
    parser.add_argument("--quick", action="store_true", help="only the first two configs of each kernel")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder; default: %(default)s")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    configs = []
    if "tile" in args.kernels:
        configs += TILE_CONFIGS[:2] if args.quick else TILE_CONFIGS
    if "tma" in args.kernels:
        configs += TMA_CONFIGS[:2] if args.quick else TMA_CONFIGS
    try:
        import comfy_kitchen  # noqa: F401

        ck = True
    except ImportError:
        ck = None
    rows = []
    for m in (int(v) for v in args.m.split(",")):
        for name, n, k, _ in SHAPES:
            try:
                row = measure_shape(name, n, k, m, configs, device, ck)
            except Exception:  # noqa: BLE001
                row = {"shape": name, "M": m, "N": n, "K": k, "error": traceback.format_exc()[-800:]}
            print(json.dumps({key: v for key, v in row.items() if key != "tried"}), flush=True)
            rows.append(row)
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.int8_gemm " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"command": command, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "capability": list(torch.cuda.get_device_capability(device))}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    (out / f"int8-gemm-{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"int8-gemm-{stamp}.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    if args.write_table:
        write_table(meta["capability"], rows)
    return 0


def markdown(meta, rows) -> str:
    lines = [f"# INT8 GEMMs on the decode step's shapes ({meta['device']})", "", f"Command: `{meta['command']}`",
             f"torch {meta['torch']}, Triton {meta.get('triton', '?')}. ms per GEMM (median of CUDA-graph replays); "
             "TFLOP/s (TOP/s for int8) in brackets; `ours` is our INT8 kernel's best config from int8 rows.", "",
             "| shape | M | N | K | bf16 | fp8 `_scaled_mm` | `_int_mm` + scales | comfy-kitchen `int8_linear` "
             "| ck without rotation | ours | ours / bf16 | ours / fp8 | our quantize (+rotation) | ours config |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def cell(row, key):
        if f"{key}_ms" not in row:
            return "-"
        return f"{row[f'{key}_ms']:.3f} ({row[f'{key}_tflops']:.0f})"

    for row in rows:
        if "error" in row:
            lines.append(f"| {row['shape']} | {row['M']} | {row['N']} | {row['K']} | error | | | | | | | | | |")
            continue
        config = row.get("ours_config")
        config_text = (f"{config['kernel']} {config['block_m']}x{config['block_n']}x{config['block_k']} "
                       f"w{config['num_warps']} s{config['num_stages']}") if config else "-"
        quant = f"{row.get('quant_rot0_ms', 0):.3f} / {row.get('quant_rot1_ms', 0):.3f}"
        lines.append(f"| {row['shape']} | {row['M']} | {row['N']} | {row['K']} | {cell(row, 'bf16')} | "
                     f"{cell(row, 'fp8')} | {cell(row, 'int_mm')} | {cell(row, 'ck')} | {cell(row, 'ck_gemm')} | "
                     f"{cell(row, 'ours')} | {row.get('ours_vs_bf16', '-')} | {row.get('ours_vs_fp8', '-')} | "
                     f"{quant} | {config_text} |")
    return "\n".join(lines) + "\n"


def write_table(capability, rows) -> None:
    from graph_runtime.kernels.int8_gemm_configs import m_bucket

    path = ROOT / "graph_runtime" / "kernels" / "int8_gemm_configs.py"
    text = path.read_text()
    entries = {}
    for row in rows:
        if row.get("ours_config"):
            entries[(row["N"], row["K"], m_bucket(row["M"]))] = row["ours_config"]
    body = "\n".join(f"        {key!r}: {value!r}," for key, value in sorted(entries.items()))
    table = f"TABLE: dict[tuple[int, int], dict[tuple[int, int, int], dict]] = {{\n    {tuple(capability)!r}: {{\n{body}\n    }},\n}}"
    start = text.index("TABLE:")
    end = text.index("\n\n\n", start)
    path.write_text(text[:start] + table + text[end:])


if __name__ == "__main__":
    raise SystemExit(main())
