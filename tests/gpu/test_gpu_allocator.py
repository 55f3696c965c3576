"""The CUDA allocator a process runs under (run on the GPU: `pytest -m gpu tests/gpu/test_gpu_allocator.py`).

Under cudaMallocAsync (ComfyUI's default unless the pack's prestartup script turns it off) a capture that launches
Triton kernels on memory allocated inside it fails, and freeing that aborted capture's memory faults the process.
Each case is a fresh process (the allocator is chosen when torch loads) running the command line's generate on the
tiny model in bf16 with int8 Linears, whose steps run the pack's Triton kernels.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graph_runtime.decode import eligibility as why

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _generate(tmp_path, conf, name):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    done = subprocess.run([sys.executable, "-m", "graph_runtime", "generate", "--out", str(tmp_path / name),
                           "--steps", "4", "--width", "128", "--height", "128", "--dtype", "bf16", "--precision",
                           "int8", "--repeat", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("graph manager: "))
    return json.loads(line[len("graph manager: "):])


def test_steps_stay_eager_under_cuda_malloc_async_and_replay_under_the_native_allocator(tmp_path):
    """cudaMallocAsync: both runs finish (no capture tried, so no fault), every step eager for the allocator's reason.
    Native: the same command captures once and the second run replays (what the prestartup script buys)."""
    under_async = _generate(tmp_path, "backend:cudaMallocAsync", "async.png")
    assert under_async["captures"] == 0 and under_async["prefill_captures"] == 0
    assert under_async["eager_steps"] == {why.ASYNC_ALLOCATOR: 8}
    native = _generate(tmp_path, "", "native.png")
    assert native["captures"] >= 1 and native["replays"] >= 4 and not native["eager_steps"]
