"""The decode step's attention kernels: time per block and error against an fp32 attention.

    python -m bench.attention8 [--out-dir DIR]

The decode step's attention: every target query (4096 at 1024x1024, 16384 at 2048x2048) attends to the cached prefix
and the target keys (32 heads x 128, bf16), in the step's `[B, S, H, D]` layout. Two tables:

- **the kernel alone**, on ready q/k/v: PyTorch SDPA (cuDNN's flash kernel), FlashAttention-3 bf16 (the `fa3` extra),
  FlashAttention-3 FP8 e4m3 with per-head scales (q/k/v quantized beforehand, untimed: the kernel's own speed), the
  same with the quantization as a separate pass (timed), comfy-kitchen's `int8_attention` and SageAttention 1.0.6's
  Triton kernel where installed.
- **with its producer**, the q/k RMSNorm + RoPE + K/V write kernel that feeds attention in the step, timed together
  with the attention: bf16 into SDPA, bf16 into FA3, and that kernel writing e4m3 itself (q/k scaled by the static
  bound of their norm weights, v by a per-head scale calibrated on the whole cache, saturating) into FA3's FP8
  forward, so no quantization pass runs.

Error is relative (Frobenius) against fp32 attention on the same (bf16) inputs; SDPA bf16's own error is the
yardstick. Results go to `bench/results/attention8-<stamp>.{md,json}` (or `--out-dir`) with the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from graph_runtime.decode import attention
from graph_runtime.kernels.qk_norm_rope import (E4M3_MAX, norm_bound_scale, qk_norm_rope_write,
                                                qk_norm_rope_write_fp8)

from .int8_gemm import time_graph

ROOT = Path(__file__).resolve().parents[1]

CASES = [("t2i 1024", 4096, 128), ("edit one ref 1024", 4096, 4096 + 128), ("t2i 2048", 16384, 128)]
HEADS, HEAD_DIM = 32, 128
EPS = 1e-6


def exact_attention(q, k, v):
    """fp32 attention one head at a time over `[1, S, H, D]` (the whole score matrix of a 2048x2048 step would not
    fit), TF32 off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v = (t.float()[0].transpose(0, 1) for t in (q, k, v))
    out = torch.empty_like(q)
    for h in range(q.shape[0]):
        scores = (q[h] @ k[h].t()) / q.shape[-1] ** 0.5
        out[h] = scores.softmax(dim=-1) @ v[h]
    return out.transpose(0, 1)[None]


def head_scales(x):
    """Per-head e4m3 scales `[H]` (amax / 448) of `[B, S, H, D]`."""
    return (x.float().abs().amax(dim=(0, 1, 3)) / E4M3_MAX).clamp_min(1e-12)


def quantize(x, scale):
    return (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _descale(scale, batch=1):
    return scale[None].expand(batch, -1).contiguous()


def kernel_candidates(forward):
    """`{name: fn(q, k, v)}` over `[B, S, H, D]` bf16."""
    found = {"sdpa": lambda q, k, v: attention.sdpa(q, k, v, None)}
    if forward is not None:
        found["fa3"] = lambda q, k, v: forward(q, k, v)[0]

        def fp8_with_pass(q, k, v):
            scales = [head_scales(t) for t in (q, k, v)]
            q8, k8, v8 = (quantize(t, s) for t, s in zip((q, k, v), scales))
            return forward(q8, k8, v8, q_descale=_descale(scales[0]), k_descale=_descale(scales[1]),
                           v_descale=_descale(scales[2]))[0]

        found["fa3_fp8+quant_pass"] = fp8_with_pass
    try:
        from comfy_kitchen.sage_attention import int8_attention

        found["ck_int8"] = lambda q, k, v: int8_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                          v.transpose(1, 2)).transpose(1, 2)
    except Exception as exc:  # noqa: BLE001
        print("comfy-kitchen int8_attention unavailable:", repr(exc)[:200])
    try:
        from sageattention import sageattn

        found["sage_1.0.6"] = lambda q, k, v: sageattn(q, k, v, tensor_layout="NHD", is_causal=False)
    except Exception as exc:  # noqa: BLE001
        print("sageattention unavailable:", repr(exc)[:200])
    return found


def _measure(fn, exact, flop):
    try:
        out = fn()
        err = ((out.float() - exact).norm() / exact.norm()).item()
        ms = time_graph(fn)
        return {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9), "rel_err": round(err, 5)}
    except Exception as exc:  # noqa: BLE001 - one candidate failing is a row, not a crash
        return {"error": repr(exc)[:300]}


def kernel_rows(queries, prefix, forward, device):
    keys = queries + prefix
    g = torch.Generator(device).manual_seed(0)
    # LayerNorm'd, RMS-normed q/k have unit-scale entries; a few large channels, as real q/k have.
    q = torch.randn(1, queries, HEADS, HEAD_DIM, device=device, generator=g)
    k = torch.randn(1, keys, HEADS, HEAD_DIM, device=device, generator=g)
    k[..., :4] *= 8
    v = torch.randn(1, keys, HEADS, HEAD_DIM, device=device, generator=g)
    exact = exact_attention(q, k, v)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    flop = 4.0 * HEADS * queries * keys * HEAD_DIM
    row = {label: _measure(lambda fn=fn: fn(qb, kb, vb), exact, flop)
           for label, fn in kernel_candidates(forward).items()}
    if forward is not None:
        scales = [head_scales(t) for t in (qb, kb, vb)]
        q8, k8, v8 = (quantize(t, s) for t, s in zip((qb, kb, vb), scales))
        descales = [_descale(s) for s in scales]
        row["fa3_fp8 (kernel alone)"] = _measure(
            lambda: forward(q8, k8, v8, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])[0],
            exact, flop)
    return row


def producer_rows(queries, prefix, forward, device):
    """The q/k norm + RoPE + K/V write kernel and the attention after it, timed together."""
    keys = queries + prefix
    g = torch.Generator(device).manual_seed(1)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).bfloat16()

    q_raw, k_raw, v_raw = (randn(1, queries, HEADS, HEAD_DIM) for _ in range(3))
    k_raw[..., :4] *= 8
    q_weight, k_weight = (1 + randn(HEAD_DIM, scale=0.2) for _ in range(2))
    angles = torch.rand(queries, 1, HEAD_DIM // 2, device=device, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    k_cache = randn(1, keys, HEADS, HEAD_DIM)
    v_cache = randn(1, keys, HEADS, HEAD_DIM)

    def bf16_producer():
        return qk_norm_rope_write(q_raw, k_raw, v_raw, q_weight, k_weight, cos, sin, k_cache, v_cache, prefix, EPS)

    q_bf = bf16_producer()
    exact = exact_attention(q_bf, k_cache, v_cache)
    flop = 4.0 * HEADS * queries * keys * HEAD_DIM
    rows = {"norm-rope + sdpa": _measure(lambda: attention.sdpa(bf16_producer(), k_cache, v_cache, None), exact,
                                         flop)}
    if forward is None:
        return rows
    rows["norm-rope + fa3"] = _measure(lambda: forward(bf16_producer(), k_cache, v_cache)[0], exact, flop)
    q_scale = torch.full((HEADS,), norm_bound_scale(q_weight, HEAD_DIM), device=device)
    k_scale = torch.full((HEADS,), norm_bound_scale(k_weight, HEAD_DIM), device=device)
    v_scale = head_scales(v_cache)
    k8, v8 = quantize(k_cache, k_scale), quantize(v_cache, v_scale)  # the prefix rows, as a prefill would write
    inverse = [1 / s for s in (q_scale, k_scale, v_scale)]
    descales = [_descale(s) for s in (q_scale, k_scale, v_scale)]

    def fp8_fused():
        q8 = qk_norm_rope_write_fp8(q_raw, k_raw, v_raw, q_weight, k_weight, cos, sin, k8, v8, prefix, EPS,
                                    *inverse)
        return forward(q8, k8, v8, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])[0]

    rows["norm-rope e4m3 (fused) + fa3_fp8"] = _measure(fp8_fused, exact, flop)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention8", description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    forward, reason = attention._load_fa3()
    if forward is None:
        print("FlashAttention-3 unavailable:", reason)
    rows = []
    for name, queries, prefix in CASES:
        row = {"case": name, "queries": queries, "keys": queries + prefix,
               "kernel": kernel_rows(queries, prefix, forward, device),
               "with producer": producer_rows(queries, prefix, forward, device)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m bench.attention8", *(sys.argv[1:] if argv is None else argv)])
    meta = {"command": command, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "fa3": None if forward is not None else reason}
    (out / f"attention8-{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# The decode step's attention kernels ({meta['device']}, torch {meta['torch']})", "",
             f"Command: `{command}`", ""]
    for table in ("kernel", "with producer"):
        lines += [f"## {table}", "", "| case | queries | keys | candidate | ms per block | TFLOP/s | rel. error vs fp32 |",
                  "|---|---:|---:|---|---:|---:|---:|"]
        for row in rows:
            for label, value in row[table].items():
                cells = (f"{value['ms']:.3f} | {value['tflops']} | {value['rel_err']}" if "ms" in value
                         else f"error: {value['error'][:80]} | | ")
                lines.append(f"| {row['case']} | {row['queries']} | {row['keys']} | {label} | {cells} |")
        lines.append("")
    (out / f"attention8-{stamp}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
