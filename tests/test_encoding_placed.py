"""The command line's text encoder placement (graph_runtime/encoding/placed.py) without a GPU: `auto` resolves by the
memory plan's own rule over what the device has free, and a placement set by hand runs as set."""

import pytest
import torch

from graph_runtime import free_memory
from graph_runtime.encoding.placed import PlacedTextEncoder
from graph_runtime.memory import plan as plans

TOKENS = 300


@pytest.fixture
def encoder(tiny_parts):
    return tiny_parts["text_encoder"]


def test_auto_runs_the_plans_placement_for_the_free_memory(encoder, monkeypatch):
    """On a CUDA device (its free memory given), `auto` resolves to what plan.text_encoder_placement picks for that
    room, at each placement's edge: the whole encoder where it fits with the encode, else two layers, else the CPU."""
    size = plans.TextEncoderSize.of(encoder)
    whole, streamed = (size.gpu_bytes(p, TOKENS) for p in (plans.TE_OFFLOAD, plans.TE_STREAMED))
    seen = set()
    for free in (0, streamed - 1, streamed, whole - 1, whole, 1 << 40):
        monkeypatch.setattr(free_memory, "device_free_bytes", lambda device, exclude=0, free=free: free)
        got = PlacedTextEncoder(encoder, torch.device("cuda"), plans.TE_AUTO).resolve(TOKENS)
        assert got == plans.text_encoder_placement(size, TOKENS, free), free
        seen.add(got)
    assert {plans.TE_OFFLOAD, plans.TE_CPU} <= seen


def test_a_placement_set_by_hand_runs_as_set_and_an_unknown_one_is_refused(encoder, monkeypatch):
    """`streamed by layer` runs as set even where the whole encoder would fit; a name outside the plan's placements
    is a ValueError naming it."""
    monkeypatch.setattr(free_memory, "device_free_bytes", lambda device, exclude=0: 1 << 40)
    assert PlacedTextEncoder(encoder, "cpu", plans.TE_STREAMED).resolve(TOKENS) == plans.TE_STREAMED
    with pytest.raises(ValueError, match="'layers'"):
        PlacedTextEncoder(encoder, "cpu", "layers")
