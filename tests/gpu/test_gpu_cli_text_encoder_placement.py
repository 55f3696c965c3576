"""The command line's text encoder placements on a real GPU
(`pytest -m gpu tests/gpu/test_gpu_cli_text_encoder_placement.py -s`): each one encodes the same prompt to the same
image as the encoder kept on the GPU, and leaves the encoder where the placement says between encodes."""

import copy
import types

import pytest
import torch

from graph_runtime.memory import plan as plans
from tests.owners import forget, generator_for

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tiny_parts):
    """The tiny fp32 models, the transformer and VAE on the GPU, the text encoder on the host (as the command line
    loads it for every placement but `gpu`)."""
    parts = {k: (copy.deepcopy(v) if isinstance(v, torch.nn.Module) else v) for k, v in tiny_parts.items()}
    found = types.SimpleNamespace(transformer=parts["transformer"].to("cuda"), vae=parts["vae"].to("cuda"),
                                  text_encoder=parts["text_encoder"], processor=parts["processor"],
                                  scheduler_config=dict(parts["scheduler"].config), sources={"model": "tiny"})
    yield found
    forget(found.transformer)


def _run(models, placement):
    generator = generator_for(models, text_encoder_placement=placement)
    result = generator.generate("a red cube on a table", width=128, height=128, steps=2, seed=3)
    return result, generator


@pytest.mark.parametrize("placement", [plans.TE_OFFLOAD, plans.TE_STREAMED, plans.TE_CPU, plans.TE_AUTO])
def test_each_placement_gives_the_always_gpu_image_and_leaves_the_encoder_where_it_says(models, placement):
    """fp32: the streamed encode runs the same kernels on the same values as the whole one (bit-equal, tolerance 0);
    the CPU encode runs other kernels, so its image is compared within 1e-3 of the pixel range (fp32 rounding through
    two steps). After the encode the encoder's weights are on the host for every placement but `always gpu`, which
    is what `auto` runs for the tiny models on a large card (the encoder fits beside the sampling)."""
    reference, _ = _run(models, plans.TE_GPU)
    assert all(p.device.type == "cuda" for p in models.text_encoder.parameters())
    result, generator = _run(models, placement)
    assert generator.placed.last in plans.TE_PLACEMENTS
    if placement in (plans.TE_STREAMED, plans.TE_AUTO):
        assert generator.placed.last == (plans.TE_GPU if placement == plans.TE_AUTO else placement)
    left_on = "cuda" if generator.placed.last == plans.TE_GPU else "cpu"
    assert all(p.device.type == left_on for p in models.text_encoder.parameters())
    if placement == plans.TE_CPU:
        assert (result.latents - reference.latents).abs().max().item() <= 1e-3 * reference.latents.abs().max().item()
    else:
        assert torch.equal(result.latents, reference.latents)
