"""Does the weights' memory layout change the replayed step and the prefill? `step_breakdown.py` timed single GEMMs
faster with the weight stored as [in, out] (`x @ Wt`) than as PyTorch's [out, in] (`F.linear`): 568 vs 606 us for
the 4096-row down projection at the boost clock. Here every Linear of the blocks is re-homed in place to [in, out]
storage (the same values; the parameter becomes a transposed view, so `F.linear` hands cuBLAS the other operand
layout and no memory is added; commit e5ad9ae did this in the runtime, reverted after this measured no gain), and the
default path runs on either layout, alternated twice in one process: the step sustained (~3 s back to back, the card
at its power limit) and one step after 3 s idle, at 512x512, 1024x1024 and 1024x1024 with one reference; the
sampler's prefill (the captured prefix pass of a 128-token prompt, the eager pass of a 4224-token edit prefix); the
GEMM kernels each layout gets and the output's difference from the usual layout's.

Run: python bench/scripts/weight_layout.py (full-size random weights on the GPU)."""
import json, time
import torch

from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.profile import kernel_names
from graph_runtime.bench.runner import _prefixes, sampler_prefill
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import after_idle_ms, device_ms, sustained_ms


def rehome(model, transposed: bool):
    """Store each block Linear's weight as [in, out] (transposed=True) or [out, in], keeping its values."""
    for module in model.transformer_blocks.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight.data
            module.weight.data = w.t().contiguous().t() if transposed else w.contiguous()
    torch.cuda.empty_cache()


def measure(path, inputs, prefixes):
    step = path.step(inputs, prefixes)
    out = step()[0]
    entry = path.engine.manager.entries[prefixes["cond"].graph_key]
    kernels = {}
    for name in kernel_names(entry.graph.replay, "cuda"):
        if "nvjet" in name or "gemm" in name.lower():
            kernels[name[:48]] = kernels.get(name[:48], 0) + 1
    row = {"sustained_ms": round(sustained_ms(entry.graph.replay, "cuda"), 2),
           "after_idle_ms": round(after_idle_ms(step, "cuda"), 2), "gemm_kernels": kernels}
    path.engine.release()
    return row, out


T0 = time.time()
tr = build_transformer()
path = OursPath(PathSpec("graph"), tr)
with torch.no_grad():
    for name, size, refs in (("t2i-512", 512, 0), ("t2i-1024", 1024, 0), ("edit1-1024", 1024, 1)):
        inputs = build_inputs(Scenario(name, size, refs), tr.config.context_in_dim, tr.config.in_channels, "cuda",
                              torch.bfloat16)
        prefixes = _prefixes(tr, inputs, with_target=False)  # the same values on either layout
        reference = None
        for transposed in (False, True, False, True):
            rehome(tr, transposed)
            prefill_ms = device_ms(sampler_prefill(path.engine, inputs), "cuda", iters=5, warmup=2)
            row, out = measure(path, inputs, prefixes)
            if reference is None:
                reference = out
            diff = (out.float() - reference.float())
            row.update(max_abs_vs_usual=diff.abs().max().item(),
                       rel_l2_vs_usual=(diff.norm() / reference.float().norm()).item())
            print(json.dumps({"scenario": name, "layout": "[in, out]" if transposed else "[out, in]",
                              "sampler_prefill_ms": round(prefill_ms, 2), **row}), flush=True)
        rehome(tr, False)
        for p in prefixes.values():
            p.release()
print("wall s", round(time.time() - T0, 1), flush=True)
