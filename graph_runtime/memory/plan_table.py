"""The table of plans for common cards in docs/memory.md, computed by the planner so the page cannot drift from it
(tests/test_memory_plan.py compares them). `python -m graph_runtime.memory.plan_table` prints it."""

from __future__ import annotations

from .plan import ModelSizes, plan_memory, request_shape
from .sizes import GiB

BEGIN = "<!-- plan table: python -m graph_runtime.memory.plan_table -->"
END = "<!-- end of plan table -->"

CARDS_GB = (8, 12, 16, 24, 48)
# (label, request_shape arguments), all at 1024x1024 with a 128-token prompt.
REQUESTS = (
    ("text to image", {}),
    ("1 reference", {"references": 1}),
    ("2 references, CFG", {"references": 2, "cfg": True}),
    ("10 references", {"references": 10}),
)
HOST_GB = 64


def rows() -> list[list[str]]:
    sizes = {p: ModelSizes.standard(p) for p in ("bf16", "int8")}
    out = []
    for precision in ("bf16", "int8"):
        for label, arguments in REQUESTS:
            for card in CARDS_GB:
                # The plans as designed: streamed blocks inside the graph, every prefix placement.
                plan = plan_memory(sizes[precision], request_shape(1024, 1024, **arguments), card * GiB,
                                   HOST_GB * GiB, streamed_graphs=True)
                if not plan.fits:
                    out.append([precision, label, str(card), "refused", "", "", "", f"{plan.gpu_bytes / GiB:.1f}",
                                "", ""])
                    continue
                blocks = ("all" if not plan.streamed_blocks
                          else f"{plan.resident_blocks} + {plan.streamed_blocks} streamed")
                out.append([precision, label, str(card), blocks, plan.prefix_placement, plan.text_encoder,
                            plan.vae_decode, f"{plan.gpu_bytes / GiB:.1f}", f"{plan.host_bytes / GiB:.1f}",
                            f"{plan.step_ms:.0f}"])
    return out


def markdown() -> str:
    header = ["weights", "request (1024x1024)", "card GiB", "blocks resident", "prefix", "text encoder",
              "VAE decode", "GPU GiB", "host GiB", "step ms (estimate)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(BEGIN)
    print(markdown())
    print(END)
