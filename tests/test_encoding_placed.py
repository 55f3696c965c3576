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


def test_auto_keeps_the_encoder_on_the_device_where_it_fits_beside_the_sampling(encoder, monkeypatch):
    """Given the request's sampling bytes and what of them the models already hold there, `auto` keeps the encoder on
    the device (`always gpu`: no move to the host after each prompt) exactly when the encoder and the sampling fit
    together in what is free plus held; one byte short, it encodes alone and leaves (`gpu while encoding, then
    offload`), as it does with no sampling figure."""
    size = plans.TextEncoderSize.of(encoder)
    sampling, held = 10 << 30, 8 << 30
    placed = PlacedTextEncoder(encoder, torch.device("cuda"), plans.TE_AUTO)
    for free, expected in ((sampling - held + size.bytes, plans.TE_GPU),
                           (sampling - held + size.bytes - 1, plans.TE_OFFLOAD)):
        monkeypatch.setattr(free_memory, "device_free_bytes", lambda device, exclude=0, free=free: free)
        assert placed.resolve(TOKENS, beside=(sampling, held)) == expected, free
        assert placed.resolve(TOKENS) == plans.TE_OFFLOAD


def test_the_generator_plans_the_sampling_beside_the_encoder_only_on_a_device(tiny_models, monkeypatch):
    """The generator's figure for `auto`: None on the CPU (the host is the device) or for a placement set by hand; on
    a CUDA device the request's planned sampling bytes, which count the transformer's weights it already holds."""
    from graph_runtime.generate import QwenImageGenerator
    from graph_runtime.sampling.sampler import SamplingRequest

    request = SamplingRequest(positive=None, latent_height=16, latent_width=16)
    generator = QwenImageGenerator(tiny_models)
    assert generator._sampling_beside(request, 0, TOKENS) is None  # noqa: SLF001
    monkeypatch.setattr(free_memory, "device_free_bytes", lambda device, exclude=0: 1 << 30)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.nn.Parameter, "device", property(lambda self: cuda), raising=False)
    sampling, held = generator._sampling_beside(request, 0, TOKENS)  # noqa: SLF001
    weights = sum(p.numel() * p.element_size() for p in tiny_models.transformer.parameters())
    assert held >= weights and sampling > weights
    by_hand = QwenImageGenerator(tiny_models, text_encoder_placement=plans.TE_GPU)
    assert by_hand._sampling_beside(request, 0, TOKENS) is None  # noqa: SLF001
