"""Shared fixtures: tiny random Qwen-Image-2.1 models built offline, once per test session."""

from __future__ import annotations

import os
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_parts():
    from graph_runtime.tiny import build_tiny_components

    return build_tiny_components(seed=0)


@pytest.fixture(scope="session")
def tiny_models(tiny_parts):
    return types.SimpleNamespace(
        transformer=tiny_parts["transformer"], vae=tiny_parts["vae"], text_encoder=tiny_parts["text_encoder"],
        processor=tiny_parts["processor"], scheduler_config=dict(tiny_parts["scheduler"].config),
    )


@pytest.fixture(scope="session")
def reference_pipeline(tiny_parts):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline(**tiny_parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def generator(tiny_models):
    from tests.owners import generator_for

    return generator_for(tiny_models)


@pytest.fixture(scope="session")
def reference_image():
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(0).rand(96, 128, 3) * 255).astype("uint8"))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    from graph_runtime.tiny import write_diffusers_folder

    return write_diffusers_folder(tmp_path_factory.mktemp("tiny") / "qwen-image-2.1-tiny")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
