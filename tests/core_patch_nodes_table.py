"""The table of core's model-patching nodes in docs/core-sampling.md: written from the measurements of
tests/core_patch_nodes_driver.py on each ComfyUI version, and read back by tests/test_core_patch_nodes_comfyui.py.

    python tests/core_patch_nodes_table.py result-0.8.0.json result-0.33.0.json   # prints the table

Each result file holds the driver's JSON (the line after `KVGRAPH-RESULT `). A cell that differs between versions
names each version's outcome (`0.8.0: unchanged; 0.33.0: changed`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "core-sampling.md"
BEGIN, END = "<!-- patch-nodes-table:begin -->", "<!-- patch-nodes-table:end -->"
HEADER = ("| node | ComfyUI | core's Qwen-Image | KV-Graph MODEL | KV-Graph steps |\n"
          "|---|---|---|---|---|")


def outcome(measured: dict) -> str:
    """One model's outcome in a few words: changed / unchanged / refused: <why>."""
    if measured["outcome"] != "refused":
        return measured["outcome"]
    message = measured["message"]
    for needle, short in (("UnsupportedPatch", "refused, naming the node"),
                          ("model merging nodes cannot patch", "refused: weight patching (use KV-Graph Load LoRA)"),
                          ("PatchFailed", "refused, naming the node")):
        if needle in message:
            return short
    return "fails: " + message.split(":", 1)[0]  # the exception's type; the node fails on core's model alike


def steps(measured: dict) -> str:
    """How the KV-Graph MODEL's steps ran: replayed graphs, eager (why), or none (refused)."""
    if measured["outcome"] == "refused":
        return "-"
    counted = measured["steps"]
    eager = counted.get("eager_steps") or {}
    if eager:
        return "eager: " + "; ".join(sorted(eager))
    extra = f" (+{counted['captures']} graph)" if counted.get("captures") else ""
    return "replayed" + extra if counted.get("replays") else "-"


def row_cells(row: dict) -> tuple[str, str, str]:
    if "skipped" in row:
        return ("not run: " + row["skipped"],) * 2 + ("-",)
    return outcome(row["core"]), outcome(row["kvgraph"]), steps(row["kvgraph"])


def merge(cells_by_version: dict[str, str]) -> str:
    values = set(cells_by_version.values())
    if len(values) == 1:
        return values.pop()
    return "; ".join(f"{version}: {cell}" for version, cell in cells_by_version.items())


def table(results: list[dict]) -> str:
    nodes = sorted({node for result in results for node in result["rows"]}, key=str.lower)
    lines = [HEADER]
    for node in nodes:
        if node.startswith("("):
            continue  # a module the environment could not import
        present = [r for r in results if node in r["rows"]]
        versions = [r["version"] for r in present]
        cells = [row_cells(r["rows"][node]) for r in present]
        merged = [merge(dict(zip(versions, column))) for column in zip(*cells)]
        lines.append(f"| `{node}` | {', '.join(versions)} | " + " | ".join(merged) + " |")
    return "\n".join(lines)


def documented(version: str, doc: Path = DOC) -> dict[str, tuple[str, str, str]]:
    """node -> (core, KV-Graph, steps) cells the docs give for `version`."""
    text = doc.read_text()
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        node, versions, rest = cells[0].strip("`"), [v.strip() for v in cells[1].split(",")], cells[2:]
        if version in versions:
            rows[node] = tuple(_for_version(cell, version) for cell in rest)
    return rows


def _for_version(cell: str, version: str) -> str:
    parts = re.findall(r"(\d+\.\d+\.\d+): ([^;]+)", cell)
    if parts and cell.startswith(parts[0][0]):
        return dict(parts)[version].strip()
    return cell


if __name__ == "__main__":
    print(table([json.loads(Path(p).read_text()) for p in sys.argv[1:]]))
