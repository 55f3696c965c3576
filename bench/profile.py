"""Where a decode step's time goes: a kernel table of one step, and the GEMM/attention rates at its shapes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .timing import device_ms


def _profiled(fn, device):
    """A CUDA profile of one call of `fn`, after one unprofiled call (lazy set-up stays out of it)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return prof


def kernel_table(fn, device, rows: int = 45) -> str:
    return _profiled(fn, device).key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                                      max_name_column_width=90)


def kernel_names(fn, device) -> list[str]:
    """The name of every CUDA kernel one call of `fn` runs (memsets included), in order."""
    return [e.name for e in _profiled(fn, device).events() if e.device_type == torch.autograd.DeviceType.CUDA]


def op_rates(transformer, tokens: int, keys: int, device) -> list[dict]:
    """TFLOP/s of each decode GEMM shape and of SDPA at this many target tokens and keys (batch 1, bf16)."""
    config = transformer.config
    d = config.num_attention_heads * config.attention_head_dim
    mlp = d * config.mlp_ratio
    x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
    rows = []
    for name, n, k in [("q, k, v or out", d, d), ("gate or up", mlp, d), ("down", d, mlp)]:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        a = x if k == d else torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        ms = device_ms(lambda: F.linear(a, w), device, iters=20, warmup=5)
        rows.append({"op": f"linear {name} [{tokens}x{k}]x[{k}x{n}]", "ms": ms, "tflops": 2 * tokens * n * k / ms / 1e9})
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    q = torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.randn(1, heads, keys, head_dim, device=device, dtype=torch.bfloat16)
    ms = device_ms(lambda: F.scaled_dot_product_attention(q, kv, kv), device, iters=20, warmup=5)
    rows.append({"op": f"sdpa {tokens} queries x {keys} keys", "ms": ms, "tflops": 4 * tokens * keys * d / ms / 1e9})
    return rows
