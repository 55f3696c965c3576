"""First prefill at a new prompt length with SDPA's own backend choice (cuDNN for the masked attention) vs the
memory-efficient kernel forced, for the eager prefix pass; and the pass's device time at a 4224-token prefix.

Run: python bench/scripts/prefix_attention_backend.py (full-size random weights on the GPU)."""
import contextlib, json, time, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from graph_runtime.bench.model import build_transformer
from graph_runtime.bench.scenarios import Scenario, build_inputs
from graph_runtime.decode.engine import DecodeEngine
from graph_runtime.decode.layout import TokenLayout
from graph_runtime.decode import prefix_pass
from graph_runtime.decode.prefill import run_prefill

prefix_pass.SHORT_PREFIX_TOKENS = 0  # "default" below is SDPA's own choice for every prefix
tr = build_transformer()
C, CH = tr.config.context_in_dim, tr.config.in_channels
base = build_inputs(Scenario("t2i", 1024), C, CH, "cuda", torch.bfloat16)
b = base.branches[0]

def ctx(kind):
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) if kind == "efficient" else contextlib.nullcontext()

def eager_prefill(n, kind):
    layout = TokenLayout.build(torch.zeros(1, n, dtype=torch.bool), [(1, 64, 64)], "cuda")
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with torch.no_grad(), ctx(kind):
        run_prefill(tr, layout, base.hidden_all, b.embeds[:, :n], base.timestep, with_target=False)
    torch.cuda.synchronize(); return round((time.perf_counter() - t0) * 1e3, 1)

eager_prefill(128, "default"); eager_prefill(128, "efficient")
for kind, lengths in [("default", [111, 113, 115]), ("efficient", [117, 119, 121]), ("default", [123]), ("efficient", [125])]:
    for n in lengths:
        first = eager_prefill(n, kind); again = eager_prefill(n, kind)
        print(json.dumps({"backend": kind, "prompt_tokens": n, "first_ms": first, "again_ms": again}), flush=True)

# edit1 (4224-token prefix): device time of the eager prefix pass under each backend
edit = build_inputs(Scenario("edit1", 1024, references=1), C, CH, "cuda", torch.bfloat16)
eb = edit.branches[0]
for kind in ("default", "efficient", "default", "efficient"):
    with torch.no_grad(), ctx(kind):
        run_prefill(tr, eb.layout, edit.hidden_all, eb.embeds, edit.timestep, with_target=False)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record(); run_prefill(tr, eb.layout, edit.hidden_all, eb.embeds, edit.timestep, with_target=False); e1.record()
        e1.synchronize()
    print(json.dumps({"edit1 prefix pass": kind, "ms": round(e0.elapsed_time(e1), 1)}), flush=True)
