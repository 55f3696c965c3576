"""The two step-cache examples as shipped, on a real ComfyUI over HTTP (CPU, tiny files): core's EasyCache with
KSampler on the MODEL, and the KV-Graph Step Cache with the KV-Graph Sampler. Each run skips steps (the pack's status
route counts them) and leaves nothing running; the skipped steps' numbers against a core model are compared in
tests/test_step_cache_comfyui.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import load_api_workflow, node_of  # noqa: E402

pytestmark = pytest.mark.comfyui

SKIPPED = re.compile(r"(EasyCache - skipped|KV-Graph Step Cache: skipped) (\d+)/(\d+) steps")


def skipped_total(server) -> int:
    return sum(m.get("skipped_steps", 0) for m in server.status()["models"])


def log(server) -> str:
    return server.log_path.read_text(errors="replace")


def logged_skips(server, since: int) -> list[tuple[int, int]]:
    return [(int(m.group(2)), int(m.group(3))) for m in SKIPPED.finditer(log(server)[since:])]


@pytest.mark.parametrize("name,sampler", [("qwen_image_2.1_easycache", "KSampler"),
                                          ("qwen_image_2.1_step_cache", "KVGraphSampler")])
def test_the_example_skips_steps_as_shipped(classic_server, name, sampler):
    """The example runs with its shipped settings (default threshold, 40 steps), skips some of its steps (logged by
    the cache and counted in the status route) and leaves no run in progress."""
    server = classic_server
    prompt = load_api_workflow(name, seed=17)
    steps = node_of(prompt, sampler)["inputs"]["steps"]
    log_start, before = len(log(server)), skipped_total(server)
    server.run(prompt, timeout=300)
    skips = logged_skips(server, log_start)
    assert len(skips) == 1 and skips[0][1] == steps and 0 < skips[0][0] < steps, skips
    assert skipped_total(server) - before == skips[0][0]
    assert server.status()["running"] == []
