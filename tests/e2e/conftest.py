"""End-to-end fixtures: a prepared ComfyUI base directory, and servers started from it.

These tests need a real ComfyUI: set COMFYUI_DIR (a ComfyUI checkout) and COMFYUI_PYTHON (the Python of its
environment, with diffusers installed). Without them every test here is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import prepare_base, start_server  # noqa: E402

SKIP_REASON = ("end-to-end tests need a real ComfyUI: set COMFYUI_DIR to its checkout and COMFYUI_PYTHON to its "
               "Python (with diffusers installed)")


@pytest.fixture(scope="session")
def comfyui_install():
    comfyui_dir, python = os.environ.get("COMFYUI_DIR"), os.environ.get("COMFYUI_PYTHON")
    if not comfyui_dir or not python:
        pytest.skip(SKIP_REASON)
    if not (Path(comfyui_dir) / "main.py").is_file():
        pytest.fail(f"COMFYUI_DIR={comfyui_dir} has no main.py: not a ComfyUI checkout")
    return comfyui_dir, python


@pytest.fixture(scope="session")
def comfy_base(comfyui_install, tmp_path_factory):
    return prepare_base(tmp_path_factory.mktemp("comfyui-base"))


@pytest.fixture(scope="session")
def classic_server(comfyui_install, comfy_base):
    """A server with ComfyUI's default (classic) cache, shared by the modules that need one."""
    server = start_server(comfyui_install, comfy_base)
    yield server
    server.stop()


@pytest.fixture
def websocket_log(server, comfyui_install, tmp_path):
    """Messages of the module's `server` websocket for its client id, recorded by a helper run with ComfyUI's
    Python; call it for the messages so far."""
    out = tmp_path / "ws.jsonl"
    url = f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}"
    listener = subprocess.Popen([comfyui_install[1], str(Path(__file__).parent / "ws_listen.py"), url, str(out)],
                                start_new_session=True)
    deadline = time.time() + 30
    while not (out.exists() and out.read_text()):
        assert listener.poll() is None and time.time() < deadline, "websocket listener did not connect"
        time.sleep(0.1)

    def read():
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]

    yield read
    os.killpg(listener.pid, signal.SIGTERM)
    listener.wait(timeout=10)


@pytest.fixture(scope="module")
def uncached_server(comfyui_install, base):
    """A server on the module's `base` fixture started with `--cache-none`, so every node of every prompt runs."""
    server = start_server(comfyui_install, base, "--cache-none")
    yield server
    server.stop()
