"""End-to-end fixtures: a prepared ComfyUI base directory, and servers started from it.

These tests need a real ComfyUI: set COMFYUI_DIR (a ComfyUI checkout) and COMFYUI_PYTHON (the Python of its
environment, with diffusers installed). Without them every test here is skipped.
"""

from __future__ import annotations

import os
import sys
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
