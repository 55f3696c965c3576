"""(1) The SwiGLU product `silu(gate) * up` at the decode shapes: inductor's kernel against ours (silu_mul_triton.py)
at several block sizes;
(2) the MLP residual handed to the next block's norm (one pass) against adding it in its own kernel, the decode step
through the compiled engine at 512x512 and 1024x1024, alternated in one process; (3) where a replayed step's host
time and a sampler's prefill go on this host (per-call timers and a cProfile of the prefill).

Run: python bench/scripts/residual_handoff_and_swiglu.py (full-size random weights on the GPU)."""
import cProfile, gc, io, json, pstats, statistics, time
import torch
import torch.nn.functional as F
import triton
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.runner import _prefixes
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import device_ms, host_ms, timed_calls
from graph_runtime.decode import step as step_mod
from graph_runtime.kernels.norm_modulate import norm_modulate, residual_norm_modulate
from graph_runtime.kernels.qk_norm_rope import qk_norm_rope_write
from graph_runtime.kernels.silu_mul_triton import silu_mul_kernel

dev = "cuda"
T0 = time.time()
def log(*a): print(*a, flush=True)


def hand_silu_mul(g, u, block, warps):
    out = torch.empty_like(g)
    n = g.numel()
    silu_mul_kernel[(triton.cdiv(n, block),)](g, u, out, n, BLOCK=block, num_warps=warps)
    return out


# 1. SwiGLU product
compiled = torch.compile(lambda g, u: F.silu(g) * u)
for m in (1024, 4096, 8192):
    g = torch.randn(m, 12288, device=dev, dtype=torch.bfloat16)
    u = torch.randn_like(g)
    gb = 3 * g.numel() * 2 / 1e9
    row = {"tokens": m, "eager_ms": device_ms(lambda: F.silu(g) * u, dev, iters=50, warmup=5),
           "inductor_ms": device_ms(lambda: compiled(g, u), dev, iters=50, warmup=5)}
    ref = compiled(g, u)
    for block, warps in ((1024, 4), (2048, 8), (4096, 8), (8192, 16)):
        row[f"triton_{block}_{warps}w_ms"] = device_ms(lambda: hand_silu_mul(g, u, block, warps), dev, iters=50, warmup=5)
        row[f"triton_{block}_maxabs_vs_inductor"] = (hand_silu_mul(g, u, block, warps) - ref).abs().max().item()
    row["inductor_TBps"] = gb / row["inductor_ms"]
    log(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    del g, u, ref

# 2. the MLP residual handed on (the code as it is) vs added at the end of each block (as before)
tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels


class AddInBlock(step_mod.TargetDecodeBlock):
    def forward(self, x, modulation, cos, sin, k_cache, v_cache, prefix_len, static_kv, attn_mask):
        block, attn = self.block, self.block.attn
        scale1, gate1, scale2, gate2 = modulation[:, None].chunk(4, dim=-1)
        h = norm_modulate(x, scale1[:, 0], block.img_norm1.eps)
        head_dim = attn.inner_dim // attn.heads
        q, k, v = (lin(h).unflatten(-1, (-1, head_dim)) for lin in (attn.to_q, attn.to_k, attn.to_v))
        if static_kv:
            q = qk_norm_rope_write(q, k, v, attn.norm_q.weight, attn.norm_k.weight, cos, sin, k_cache, v_cache,
                                   prefix_len, attn.norm_q.eps)
        else:  # the eager fallback (no graph entry): concatenate, as the step does
            q, k = (step_mod.apply_rope(n(t).to(v.dtype), cos, sin) for n, t in ((attn.norm_q, q), (attn.norm_k, k)))
            k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                             attn_mask=attn_mask)
        out = attn.to_out[0](out.transpose(1, 2).flatten(2).type_as(q))
        x, h = residual_norm_modulate(x, out, gate1[:, 0], scale2[:, 0], block.img_norm2.eps)
        return x + gate2.tanh() * self.mlp(h)  # the same MLP code as the block: only the residual add differs


class AddInBlockStep(step_mod.DecodeStep):
    def __init__(self, transformer):
        super().__init__(transformer)
        self.blocks = torch.nn.ModuleList(AddInBlock(b) for b in transformer.transformer_blocks)

    def variant(self):
        return "add-in-block-" + super().variant()

    def forward(self, inputs):
        model = self.model
        x = model.img_in(inputs.hidden)
        batch = x.shape[0]
        timestep = torch.cat([inputs.timestep.to(x.dtype), inputs.timestep.new_zeros(1, dtype=x.dtype)])
        temb = model.time_text_embed(timestep, x)
        modulation = model.modulation(temb)[:batch]
        for i, block in enumerate(self.blocks):
            x = block(x, modulation, inputs.cos, inputs.sin, inputs.k[i], inputs.v[i], inputs.prefix_len,
                      inputs.static_kv, inputs.attn_mask)
        norm_out = model.norm_out
        scale = norm_out.linear(norm_out.silu(temb).to(x.dtype))[:batch]
        return model.proj_out(norm_out.norm(x) * (1 + scale[:, None]))


def kernels_per_step(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return len([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])


handed = OursPath(PathSpec("handed-on", compile=True), tr)
added = OursPath(PathSpec("added-in-block", compile=True), tr)
added.engine.step = AddInBlockStep(tr)
added.engine.step.compile_blocks()
for size in (512, 1024):
    inputs = build_inputs(Scenario(f"s{size}", size), C, CH, dev, torch.bfloat16)
    with torch.no_grad():
        prefixes = _prefixes(tr, inputs, with_target=False)
        steps = {"handed-on": handed.step(inputs, prefixes)}
        outs = {"handed-on": steps["handed-on"]()}
        steps["added-in-block"] = added.step(inputs, prefixes)  # rekeys the shared prefixes for its engine
        outs["added-in-block"] = steps["added-in-block"]()
        times = {name: [] for name in steps}
        for _ in range(3):  # alternated, so clock and power drift fall on both alike
            for name, fn in steps.items():
                for p in prefixes.values():
                    p.graph_key = None
                fn()
                times[name].append(device_ms(fn, dev, iters=10, warmup=1))
        row = {"size": size, **{f"{n}_ms": [round(t, 2) for t in v] for n, v in times.items()},
               **{f"{n}_median_ms": round(statistics.median(v), 2) for n, v in times.items()},
               "max_abs_between": (outs["handed-on"][0].float() - outs["added-in-block"][0].float()).abs().max().item(),
               "output_scale": outs["added-in-block"][0].float().abs().max().item()}
        for name, path in (("handed-on", handed), ("added-in-block", added)):
            for p in prefixes.values():
                p.graph_key = None
            steps[name]()
            entry = next(e for e in path.engine.manager.entries.values()
                         if getattr(e, "graph", None) is not None and e.inputs.hidden.shape[1] == inputs.latents.shape[1])
            row[f"{name}_kernels"] = kernels_per_step(entry.graph.replay)
            row[f"{name}_host_ms"] = round(host_ms(steps[name], dev, iters=20), 3)
        log(json.dumps(row))
        for p in prefixes.values():
            p.release()
    handed.engine.release(); added.engine.release()
    del inputs, prefixes, outs
    gc.collect(); torch.cuda.empty_cache()
del added
gc.collect(); torch.cuda.empty_cache()

# 3. host time of a replayed step, split per call; and the sampler's prefill under cProfile
for size in (512, 1024):
    inputs = build_inputs(Scenario(f"h{size}", size), C, CH, dev, torch.bfloat16)
    with torch.no_grad():
        prefixes = _prefixes(tr, inputs, with_target=False)
        st = handed.step(inputs, prefixes)
        st(); st()
        mgr = handed.engine.manager
        entry = mgr.entries[prefixes["cond"].graph_key]
        with timed_calls(*[(mgr, n) for n in ("_fingerprint", "_blocker", "_replay")],
                         *[(entry, n) for n in ("load_inputs", "refresh_prefix")], (mgr.backend, "replay")) as acc:
            acc["decode"] = []
            for _ in range(30):
                torch.cuda.synchronize(); t0 = time.perf_counter(); st(); acc["decode"].append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        idle = []
        for _ in range(30):
            torch.cuda.synchronize(); t0 = time.perf_counter(); entry.graph.replay(); idle.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        log(json.dumps({"host_size": size, **{n: round(statistics.median(v), 3) for n, v in acc.items() if v},
                        "graph_replay_alone": round(statistics.median(idle), 3)}))
        for p in prefixes.values():
            p.release()
    handed.engine.release()
    del inputs, prefixes
handed.engine.release()
del handed
gc.collect(); torch.cuda.empty_cache()

from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.registry import engine_for
from graph_runtime.sampling.sampler import SamplingRequest, sample

engine = engine_for(tr)
inputs = build_inputs(Scenario("turbo", 1024), C, CH, dev, torch.bfloat16)
branch = inputs.branches[0]
embeds = PromptEmbeds(branch.embeds[:1], branch.vlm_mask.bool())
request = SamplingRequest(positive=embeds, latent_height=64, latent_width=64, steps=8, sigma_preset="turbo",
                          decode_mode="auto", seed=0)
runs = [sample(engine, request).timings for _ in range(3)]
log(json.dumps({"turbo_runs": [{k: round(v, 2) for k, v in t.items()} for t in runs]}))
real_prefill = engine.prefill
profiler = cProfile.Profile()
def profiled_prefill(*a, **k):
    torch.cuda.synchronize()
    profiler.enable()
    try:
        return real_prefill(*a, **k)
    finally:
        torch.cuda.synchronize()
        profiler.disable()
engine.prefill = profiled_prefill
t = sample(engine, request).timings
log(json.dumps({"profiled_turbo_run": {k: round(v, 2) for k, v in t.items()}}))
text = io.StringIO()
pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
log(text.getvalue())
text = io.StringIO()
pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
log(text.getvalue())
log("wall s", round(time.time() - T0, 1))
