"""The compiled path without our kernels (`compile+graph-inductor-only`) at 1024x1024, batch 1 then batch 2, in a
fresh process: step time and kernel table. In the full benchmark this path meets batch 2 after five other shapes
(decode-20261202T160810.md: 272.8 ms); here it meets it second.

Run: python bench/scripts/inductor_only_batch2.py (full-size random weights on the GPU)."""
import json
import torch
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.paths import OursPath, PathSpec
from graph_runtime.bench.profile import kernel_table
from graph_runtime.bench.runner import _prefixes
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.bench.timing import device_ms

tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels
path = OursPath(PathSpec("compile+graph-inductor-only", compile=True, kernels=False), tr)
for batch in (1, 2):
    inputs = build_inputs(Scenario(f"b{batch}", 1024, batch=batch), C, CH, "cuda", torch.bfloat16)
    with torch.no_grad():
        prefixes = _prefixes(tr, inputs, with_target=False)
        step = path.step(inputs, prefixes)
        step()
        print(json.dumps({"batch": batch, "ms": device_ms(step, "cuda", iters=5),
                          "stats": path.engine.manager.stats.snapshot()}), flush=True)
        entry = path.engine.manager.entries[prefixes["cond"].graph_key]
        print(kernel_table(entry.graph.replay, "cuda", rows=12), flush=True)
        for p in prefixes.values():
            p.release()
    path.engine.release()
