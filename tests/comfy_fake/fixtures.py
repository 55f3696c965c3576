"""Pytest fixtures for node tests: tiny model files in ComfyUI's layout, the fake ComfyUI, and the loaded pack.

Import with `from comfy_fake.fixtures import comfy_env` in a test module (after putting tests/ on sys.path).
"""

from __future__ import annotations

import pytest

from .env import close_env, make_env, tiny_model_dirs  # noqa: F401 - tests import them from here


@pytest.fixture(scope="module")
def comfy_env():
    env = make_env()
    yield env
    close_env(env)
