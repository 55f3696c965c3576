"""8-bit attention for the decode step against SDPA: time per block and error against an fp32 attention.

    python -m bench.attention8

The decode step's attention: every target query (4096 at 1024x1024, 16384 at 2048x2048) attends to the cached prefix
and the target keys (32 heads x 128, bf16). Candidates: PyTorch SDPA (what the step runs), comfy-kitchen's
`int8_attention` (INT8 Q.K^T and P.V with a Hadamard rotation of Q and K) and SageAttention 1.0.6's Triton kernel
(`sageattn`: INT8 Q.K^T with per-block scales, fp16 P.V), where installed. Error is relative (Frobenius) against
fp32 SDPA on the same inputs; SDPA bf16's own error is the yardstick. Results go to
`bench/results/attention8-<stamp>.{md,json}` with the command.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .int8_gemm import time_graph

ROOT = Path(__file__).resolve().parents[1]

CASES = [("t2i 1024", 4096, 128), ("edit one ref 1024", 4096, 4096 + 128), ("t2i 2048", 16384, 128)]
HEADS, HEAD_DIM = 32, 128


def exact_attention(q, k, v):
    """fp32 attention one head at a time (the whole score matrix of a 2048x2048 step would not fit), TF32 off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        scores = (q[0, h] @ k[0, h].t()) / q.shape[-1] ** 0.5
        out[0, h] = scores.softmax(dim=-1) @ v[0, h]
    return out


def candidates():
    found = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v)}
    try:
        from comfy_kitchen.sage_attention import int8_attention

        found["ck_int8"] = lambda q, k, v: int8_attention(q, k, v)
    except Exception as exc:  # noqa: BLE001
        print("comfy-kitchen int8_attention unavailable:", repr(exc)[:200])
    try:
        from sageattention import sageattn

        found["sage_1.0.6"] = lambda q, k, v: sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    except Exception as exc:  # noqa: BLE001
        print("sageattention unavailable:", repr(exc)[:200])
    return found


def main(argv=None) -> int:
    device = torch.device("cuda")
    rows = []
    for name, queries, prefix in CASES:
        torch.manual_seed(0)
        keys = queries + prefix
        # LayerNorm'd, RMS-normed q/k have unit-scale entries; a few large channels, as real q/k have.
        q = torch.randn(1, HEADS, queries, HEAD_DIM, device=device)
        k = torch.randn(1, HEADS, keys, HEAD_DIM, device=device)
        k[..., :4] *= 8
        v = torch.randn(1, HEADS, keys, HEAD_DIM, device=device)
        exact = exact_attention(q, k, v)
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        flop = 4.0 * HEADS * queries * keys * HEAD_DIM
        row = {"case": name, "queries": queries, "keys": keys}
        for label, fn in candidates().items():
            try:
                out = fn(qb, kb, vb)
                err = ((out.float() - exact).norm() / exact.norm()).item()
                ms = time_graph(lambda: fn(qb, kb, vb))
                row[label] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9), "rel_err": round(err, 5)}
            except Exception as exc:  # noqa: BLE001 - one candidate failing is a row, not a crash
                row[label] = {"error": repr(exc)[:300]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    out = ROOT / "bench" / "results"
    command = "python -m bench.attention8"
    meta = {"command": command, "device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    (out / f"attention8-{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# 8-bit attention on the decode step's shapes ({meta['device']})", "", f"Command: `{command}`", "",
             "| case | queries | keys | candidate | ms per block | TFLOP/s | rel. error vs fp32 |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        for label, value in row.items():
            if isinstance(value, dict):
                cells = (f"{value['ms']:.3f} | {value['tflops']} | {value['rel_err']}" if "ms" in value
                         else f"error: {value['error'][:80]} | | ")
                lines.append(f"| {row['case']} | {row['queries']} | {row['keys']} | {label} | {cells} |")
    (out / f"attention8-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
