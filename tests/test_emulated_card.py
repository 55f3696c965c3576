"""An emulated card (`KVGRAPH_EMULATE_CARD_GB`, graph_runtime/free_memory.py): on a large GPU, every figure of free
device memory the pack plans with (the graph manager's, the memory budget's) is what a card of that size would have
left, so the plans of an 8-24 GB card run on the device lent. CUDA's figures are faked here: an 80 GB card with
70 GB free, this process holding 2 GB reserved of which 1.5 GB allocated."""

import pytest
import torch

from graph_runtime import free_memory
from graph_runtime.memory import sizes

GB = 10**9


@pytest.fixture()
def fake_cuda(monkeypatch):
    set_fraction = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (70 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: 2 * GB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index=None: 3 * GB // 2)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index=None: 1.0, raising=False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index=None: set_fraction.append((fraction, index)))
    return set_fraction


@pytest.mark.parametrize("card", [8, 12, 16, 24])
def test_the_cap_limits_what_the_budget_sees(fake_cuda, monkeypatch, card):
    """Unset, the whole card's free memory counts; set to a card size, what is free is that size less what the
    process has reserved, plus its allocator's unused cache, for the graph manager and the memory budget alike."""
    monkeypatch.delenv(free_memory.EMULATE_CARD_ENV, raising=False)
    whole = 70 * GB + 2 * GB - 3 * GB // 2
    assert free_memory.device_free_bytes("cuda") == whole
    monkeypatch.setenv(free_memory.EMULATE_CARD_ENV, str(card))
    capped = card * GB - 3 * GB // 2
    assert free_memory.device_free_bytes("cuda") == capped < whole
    assert sizes.available_bytes("cuda") == capped


def test_emulate_card_caps_the_allocator_and_refuses_bad_sizes(fake_cuda, monkeypatch):
    """`emulate_card` sets the allocator's fraction to the card's share of the real one; a value that is no card
    size, or larger than the device, is refused naming the variable or the device."""
    monkeypatch.setenv(free_memory.EMULATE_CARD_ENV, "12")
    assert free_memory.emulate_card("cuda") == 12 * GB
    assert fake_cuda == [(12 / 80, 0)]
    assert free_memory.emulate_card("cpu") is None
    monkeypatch.setenv(free_memory.EMULATE_CARD_ENV, "twelve")
    with pytest.raises(ValueError, match="KVGRAPH_EMULATE_CARD_GB='twelve' is invalid"):
        free_memory.device_free_bytes("cuda")
    with pytest.raises(ValueError, match="cannot emulate a 96 GB card"):
        free_memory.emulate_card("cuda", 96 * GB)
    monkeypatch.setenv(free_memory.EMULATE_CARD_ENV, "")
    assert free_memory.emulated_card_bytes() is None
