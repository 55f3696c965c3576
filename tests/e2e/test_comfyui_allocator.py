"""A real ComfyUI start with the pack installed: its prestartup script keeps the process on PyTorch's native CUDA
allocator (decode-step captures run Triton kernels, which fail under cudaMallocAsync), and an explicit choice keeps
cudaMallocAsync.

A second custom node, loaded after torch, writes what the process ended up with: the allocator setting torch read
and ComfyUI's own cuda_malloc flag. The variable is set to what ComfyUI's cuda_malloc.py writes on a CUDA build of
torch, so the test does not depend on this machine's torch; `--quick-test-for-ci` makes ComfyUI exit once its nodes
are loaded.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from comfy_server import PACK_FOLDER, REPO

PROBE = '''
import json, os, sys
from comfy.cli_args import args
with open(os.environ["KVGRAPH_ALLOCATOR_PROBE"], "w") as f:
    json.dump({"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "cuda_malloc": bool(args.cuda_malloc)}, f)
NODE_CLASS_MAPPINGS = {}
'''


def _start(comfyui_install, base, extra_env, *args):
    comfyui_dir, python = comfyui_install
    probe = base / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "KVGRAPH_KEEP_CUDA_MALLOC"}
    env.update(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,backend:cudaMallocAsync",
               KVGRAPH_ALLOCATOR_PROBE=str(probe), HF_HUB_OFFLINE="1", **extra_env)
    done = subprocess.run([python, "main.py", "--cpu", "--quick-test-for-ci", "--base-directory", str(base),
                           "--database-url", "sqlite:///:memory:", *args], cwd=comfyui_dir, env=env,
                          capture_output=True, text=True, timeout=180)
    log = done.stdout + done.stderr
    assert probe.is_file(), f"the probe node did not run (exit {done.returncode}):\n{log[-4000:]}"
    return json.loads(probe.read_text()), log


@pytest.fixture
def base(tmp_path):
    (tmp_path / "custom_nodes" / "allocator_probe").mkdir(parents=True)
    (tmp_path / "custom_nodes" / "allocator_probe" / "__init__.py").write_text(PROBE)
    (tmp_path / "custom_nodes" / PACK_FOLDER).symlink_to(REPO, target_is_directory=True)
    return tmp_path


def test_comfyui_starts_on_the_native_allocator_with_the_pack(comfyui_install, base):
    """The cudaMallocAsync entry is gone before torch reads it, the user's other setting stays, ComfyUI's flag
    follows, and the log says why and how to keep cudaMallocAsync."""
    seen, log = _start(comfyui_install, base, {})
    assert seen == {"conf": "expandable_segments:True", "cuda_malloc": False}, log[-4000:]
    assert "KV-Graph: the native CUDA allocator instead of cudaMallocAsync" in log


@pytest.mark.parametrize("extra_env,args", [({"KVGRAPH_KEEP_CUDA_MALLOC": "1"}, ()), ({}, ("--cuda-malloc",))],
                         ids=["environment", "command-line"])
def test_an_explicit_choice_keeps_cuda_malloc_async(comfyui_install, base, extra_env, args):
    seen, log = _start(comfyui_install, base, extra_env, *args)
    assert "backend:cudaMallocAsync" in seen["conf"] and seen["cuda_malloc"] is True, log[-4000:]
    assert "KV-Graph: the native CUDA allocator" not in log
