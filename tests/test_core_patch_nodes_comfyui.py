"""Every model-patching node of a real ComfyUI (comfy_extras: a node that takes a MODEL and returns one) on the pack's
MODEL and on core's own Qwen-Image model (CPU, tiny models), and the table in docs/core-sampling.md that lists them.

tests/core_patch_nodes_driver.py runs in ComfyUI's Python (COMFYUI_PYTHON, COMFYUI_DIR: the same variables as the
end-to-end tests; skipped without them) and measures; the assertions are here. "Changed" means the final latents
moved by more than 1e-3 (they are of magnitude ~3; another attention kernel or an eager step instead of a replayed
one moves them by up to ~2e-4).
"""

from __future__ import annotations

import pytest

from tests.comfyui_driver import run_driver
from tests.core_patch_nodes_table import documented, row_cells

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def measured():
    return run_driver("core_patch_nodes_driver.py", timeout=1800)


def test_no_node_is_silently_a_no_op_where_core_changes_the_output(measured):
    """Where a node changes what core's Qwen-Image samples, it changes the KV-Graph MODEL's result too, or the
    prompt is refused with a message."""
    silent = [node for node, row in measured["rows"].items() if "core" in row
              and row["core"]["outcome"] == "changed" and row["kvgraph"]["outcome"] == "unchanged"]
    assert not silent


def test_skip_layer_guidance_changes_the_output_and_replays_a_graph_of_its_own(measured):
    """SkipLayerGuidanceDiT and its Simple version change the result as on core's model; their skipped-block passes
    replay a graph captured for the skipped blocks (one more capture), nothing eager."""
    for node in ("SkipLayerGuidanceDiT", "SkipLayerGuidanceDiTSimple"):
        row = measured["rows"][node]
        assert row["core"]["outcome"] == "changed" and row["kvgraph"]["outcome"] == "changed", node
        counted = row["kvgraph"]["steps"]
        assert counted["captures"] == 1 and counted["replays"] > 0 and not counted["eager_steps"], node


def test_self_attention_guidance_is_refused_naming_the_node(measured):
    """SelfAttentionGuidance (a UNet attention replace) is refused with a message naming it, never a crash."""
    kv = measured["rows"]["SelfAttentionGuidance"]["kvgraph"]
    assert kv["outcome"] == "refused" and "UnsupportedPatch" in kv["message"]
    assert "SelfAttentionGuidance" in kv["message"]


def test_the_docs_table_says_what_each_node_does(measured):
    """docs/core-sampling.md lists every node measured here with this ComfyUI's outcome on both models and how the
    KV-Graph MODEL's steps ran."""
    docs = documented(measured["version"])
    rows = {node: row for node, row in measured["rows"].items() if not node.startswith("(")}
    assert set(docs) == set(rows), "nodes missing or extra in docs/core-sampling.md"
    for node, row in rows.items():
        assert docs[node] == row_cells(row), node
