"""Runs a driver script (tests/*_driver.py) in a real ComfyUI's Python and returns what it measured.

The drivers print one `KVGRAPH-RESULT <json>` line; they need COMFYUI_DIR (a ComfyUI checkout) and COMFYUI_PYTHON
(its Python, with diffusers), the same variables as the end-to-end tests, and the test is skipped without them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_driver(script: str, timeout: float = 900) -> dict:
    comfyui, python = os.environ.get("COMFYUI_DIR"), os.environ.get("COMFYUI_PYTHON")
    if not comfyui or not python:
        pytest.skip("needs a real ComfyUI: set COMFYUI_DIR to its checkout and COMFYUI_PYTHON to its Python (with "
                    "diffusers installed)")
    env = dict(os.environ, COMFYUI_DIR=comfyui, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([python, str(REPO / "tests" / script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("KVGRAPH-RESULT ")]
    assert done.returncode == 0 and lines, f"the driver failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])
