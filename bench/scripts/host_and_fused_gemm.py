"""(1) The prefix pass vs diffusers' joint forward as prefill (eager, device and host time); (2) where a replayed
step's host time goes (the manager's checks, input copies, graph launch idle / behind busy work / back to back) with
a kernel table at 512x512; (3) the same with q/k/v and gate/up fused into one GEMM each, the modules' weights
re-homed as views of the fused ones so no memory is added.

Run: python bench/scripts/host_and_fused_gemm.py (full-size random weights on the GPU)."""
import gc, json, statistics, sys, time
import torch
import torch.nn.functional as F
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.runner import _prefixes
from graph_runtime.bench.timing import device_ms, host_ms, timed_calls
from graph_runtime.bench.profile import kernel_table
from graph_runtime.decode import step as step_mod
from graph_runtime.decode.prefill import run_prefill
from graph_runtime.kernels.norm_modulate import norm_modulate, residual_norm_modulate
from graph_runtime.kernels.qk_norm_rope import qk_norm_rope_write

def log(*a): print(*a, flush=True)
T0 = time.time()
tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels
dev = "cuda"

# 1. prefill: joint (diffusers blocks) vs prefix pass
with torch.no_grad():
    for label, refs in [("t2i", 0), ("edit1", 1)]:
        inputs = build_inputs(Scenario(label, 1024, references=refs), C, CH, dev, torch.bfloat16)
        b = inputs.branches[0]
        joint = lambda: run_prefill(tr, b.layout, inputs.hidden_all, b.embeds, inputs.timestep)
        alone = lambda: run_prefill(tr, b.layout, inputs.hidden_all, b.embeds, inputs.timestep, with_target=False)
        row = dict(prefill=label, joint_ms=device_ms(joint, dev, iters=5, warmup=1),
                   prefix_pass_ms=device_ms(alone, dev, iters=5, warmup=1), prefix_pass_host_ms=host_ms(alone, dev, iters=5))
        log(json.dumps(row))
        del inputs
gc.collect(); torch.cuda.empty_cache()

def measure(path, size, label, table=False):
    inputs = build_inputs(Scenario(f"s{size}", size), C, CH, dev, torch.bfloat16)
    with torch.no_grad():
        prefixes = _prefixes(tr, inputs, with_target=False)
        st = path.step(inputs, prefixes)
        t0 = time.perf_counter(); out = st(); torch.cuda.synchronize(); first = time.perf_counter() - t0
        ms = device_ms(st, dev, iters=20, warmup=3)
        row = dict(variant=label, size=size, ms=round(ms, 2), first_s=round(first, 1), host_ms=round(host_ms(st, dev, iters=20), 3))
        mgr = path.engine.manager
        entry = next(e for e in mgr.entries.values() if getattr(e, "graph", None) is not None)
        ts = []
        for _ in range(20):
            torch.cuda.synchronize(); t0 = time.perf_counter(); entry.graph.replay(); ts.append((time.perf_counter() - t0) * 1e3)
        row["replay_idle_host_ms"] = round(statistics.median(ts), 3)
        ts = []
        for _ in range(10):
            torch.cuda.synchronize(); torch.cuda._sleep(100_000_000); t0 = time.perf_counter(); entry.graph.replay(); ts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        row["replay_busy_host_ms"] = round(statistics.median(ts), 3)
        ts = []
        torch.cuda.synchronize()
        for _ in range(12):
            t0 = time.perf_counter(); entry.graph.replay(); ts.append(round((time.perf_counter() - t0) * 1e3, 3))
        torch.cuda.synchronize()
        row["replay_back_to_back_host_ms"] = ts
        with timed_calls(*[(mgr, n) for n in ("_fingerprint", "_blocker", "_replay")],
                         *[(entry, n) for n in ("load_inputs", "refresh_prefix")], (mgr.backend, "replay")) as acc:
            for _ in range(20):
                torch.cuda.synchronize(); st()
            torch.cuda.synchronize()
        row["breakdown_ms"] = {n: round(statistics.median(v), 3) for n, v in acc.items() if v}
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3): entry.graph.replay()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        row["kernel_sum_ms_per_step"] = round(sum(e.time_range.elapsed_us() for e in evs) / 1e3 / 3, 2)
        row["kernels_per_step"] = len(evs) / 3
        if table:
            log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70))
        log(json.dumps(row))
        for p in prefixes.values(): p.release()
    return out

base = OursPath(PathSpec("compile+graph", compile=True), tr)
outs = {}
for size in (512, 1024):
    try:
        outs[size] = measure(base, size, "base", table=(size == 512))
    except Exception:
        import traceback; traceback.print_exc()
base.engine.release(); del base; gc.collect(); torch.cuda.empty_cache()

# 3. fused q/k/v and gate/up GEMMs over the same weights (the modules' weights become views of the fused ones)
for blk in tr.transformer_blocks:
    a, m = blk.attn, blk.img_mlp
    qkv = torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight])
    gu = torch.cat([m.gate_layer.weight, m.proj.weight])
    n, h = a.to_q.weight.shape[0], m.proj.weight.shape[0]
    a.to_q.weight, a.to_k.weight, a.to_v.weight = (torch.nn.Parameter(qkv[i * n:(i + 1) * n], requires_grad=False) for i in range(3))
    m.gate_layer.weight, m.proj.weight = (torch.nn.Parameter(gu[i * h:(i + 1) * h], requires_grad=False) for i in range(2))
    blk._qkv_w, blk._gu_w = qkv, gu
gc.collect(); torch.cuda.empty_cache()
log("memory after fusing GiB", torch.cuda.memory_allocated() / 2**30)

def fused_forward(self, x, modulation, cos, sin, k_cache, v_cache, prefix_len, static_kv, attn_mask):
    block, attn = self.block, self.block.attn
    scale1, gate1, scale2, gate2 = modulation[:, None].chunk(4, dim=-1)
    h = norm_modulate(x, scale1[:, 0], block.img_norm1.eps)
    head_dim = attn.inner_dim // attn.heads
    q, k, v = F.linear(h, block._qkv_w).unflatten(-1, (-1, head_dim)).chunk(3, dim=-2)
    q = qk_norm_rope_write(q, k, v, attn.norm_q.weight, attn.norm_k.weight, cos, sin, k_cache, v_cache, prefix_len, attn.norm_q.eps)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=attn_mask)
    out = attn.to_out[0](out.transpose(1, 2).flatten(2).type_as(q))
    x, h = residual_norm_modulate(x, out, gate1[:, 0], scale2[:, 0], block.img_norm2.eps)
    gate, up = F.linear(h, block._gu_w).chunk(2, dim=-1)
    x = x + gate2.tanh() * block.img_mlp.out(F.silu(gate) * up)
    return x

step_mod.TargetDecodeBlock.forward = fused_forward
torch._dynamo.reset()
fused = OursPath(PathSpec("fused", compile=True), tr)
for size in (512, 1024):
    try:
        o = measure(fused, size, "fused-qkv-gu", table=(size == 512))
    except Exception:
        import traceback; traceback.print_exc(); continue
    log("fused vs base max abs", size, (o[0].float() - outs[size][0].float()).abs().max().item(),
        "ref scale", outs[size][0].float().abs().max().item())
log("wall", time.time() - T0)
