"""Fixtures of the GPU tests: the tiny models copied onto the GPU, once per test module."""

import copy
import types

import pytest
import torch


@pytest.fixture(scope="module")
def cuda_models(tiny_parts):
    parts = {k: (copy.deepcopy(v).to("cuda") if isinstance(v, torch.nn.Module) else v) for k, v in tiny_parts.items()}
    return types.SimpleNamespace(transformer=parts["transformer"], vae=parts["vae"],
                                 text_encoder=parts["text_encoder"], processor=parts["processor"],
                                 scheduler_config=dict(parts["scheduler"].config))
