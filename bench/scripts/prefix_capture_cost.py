"""Prefill cost per prompt through a compiled engine: eager, the first prefill of a key (which captures the prefix
pass), and later prefills of the key (replays), for three prompt lengths; plus each key's first decode step.

Run: python bench/scripts/prefix_capture_cost.py (full-size random weights on the GPU)."""
import gc, json, logging, time, torch
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.decode.engine import DecodeEngine
from graph_runtime.decode.layout import TokenLayout
logging.basicConfig(level=logging.INFO)
tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels
engine = DecodeEngine(tr)
engine.enable_compile()
base = build_inputs(Scenario("t2i", 1024), C, CH, "cuda", torch.bfloat16)
b = base.branches[0]

def prefill(text_tokens, mode="auto", decode=True):
    text = b.embeds[:, :text_tokens]
    layout = TokenLayout.build(torch.zeros(1, text_tokens, dtype=torch.bool), [(1, 64, 64)], "cuda")
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with torch.no_grad():
        _, prefix = engine.prefill(layout, base.hidden_all, text, base.timestep, mode=mode, with_target=False)
    torch.cuda.synchronize(); ms = (time.perf_counter() - t0) * 1e3
    dms = None
    if decode:
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with torch.no_grad():
            out = engine.decode(prefix, base.latents, base.timestep, mode)
        torch.cuda.synchronize(); dms = (time.perf_counter() - t0) * 1e3
    prefix.release(); gc.collect()
    return round(ms, 1), None if dms is None else round(dms, 1)

for label, n, mode in [("warm eager 128", 128, "eager"), ("first 128 (capture)", 128, "auto"), ("again 128 (replay)", 128, "auto"),
                       ("eager 120", 120, "eager"), ("new key 120 (capture)", 120, "auto"), ("again 120", 120, "auto"),
                       ("new key 100 (capture)", 100, "auto"), ("again 100", 100, "auto"), ("eager 100", 100, "eager")]:
    ms, dms = prefill(n, mode)
    print(json.dumps({"run": label, "prefill_ms": ms, "first_decode_ms": dms, "stats": engine.manager.stats.snapshot()}), flush=True)
