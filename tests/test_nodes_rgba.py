"""A transparent PNG from the pack's nodes (CPU, the ComfyUI fake): KV-Graph VAE Decode's MASK joined to its IMAGE as
core's Join Image with Alpha joins them (alpha = 1 - mask, behind RGB), then KV-Graph Save Image. Against a real
ComfyUI with core's own Join Image with Alpha: the background-removal example in tests/e2e/test_comfyui_rgba.py.

Tolerance: the PNG holds 8-bit alpha, converted as core's SaveImage converts (255 x, truncated), so the saved alpha is
within 1/255 of the VAE's.
"""

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_execute import models, run  # noqa: E402,F401


def join_image_with_alpha(image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What core's Join Image with Alpha outputs for an IMAGE and a MASK of the same size: RGB, then 1 - mask."""
    return torch.cat([image[..., :3], (1.0 - mask).unsqueeze(-1)], dim=-1)


def test_decode_mask_joined_and_saved_is_a_png_with_the_vaes_alpha(comfy_env, models, monkeypatch):
    """The saved file is RGBA, its colour the decoded IMAGE's and its alpha the VAE's alpha channel (within 8-bit
    rounding); the alpha varies, so a file with an opaque or constant alpha would fail."""
    from graph_runtime.encoding.images import vae_decode

    vae = models[2]
    raw = torch.randn(1, 64, 6, 8, generator=torch.Generator().manual_seed(4))
    image, mask = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": raw})
    save = comfy_env.nodes["KVGraphSaveImage"]
    monkeypatch.setattr(save, "hidden", types.SimpleNamespace(prompt=None, extra_pnginfo=None), raising=False)
    output = save.execute(images=join_image_with_alpha(image, mask), filename_prefix="kvgraph_rgba")
    entry, = output.ui["images"]
    with Image.open(Path(comfy_env.fake.output_dir) / entry["subfolder"] / entry["filename"]) as saved:
        saved.load()
        assert saved.mode == "RGBA"
        pixels = np.asarray(saved).astype(np.float32) / 255.0
    alpha = ((vae_decode(vae.module, raw)[0, 3].float() + 1) / 2).clamp(0, 1).numpy()
    assert np.abs(pixels[..., 3] - alpha).max() <= 1 / 255 and alpha.std() > 1e-3
    assert np.abs(pixels[..., :3] - image[0].numpy()).max() <= 1 / 255


@pytest.mark.parametrize("channels, mode", [(3, "RGB"), (4, "RGBA")])
def test_save_image_writes_the_channels_it_is_given(comfy_env, monkeypatch, channels, mode):
    """KV-Graph Save Image writes an RGBA IMAGE as an RGBA PNG and an RGB one as RGB, as core's SaveImage does."""
    save = comfy_env.nodes["KVGraphSaveImage"]
    monkeypatch.setattr(save, "hidden", types.SimpleNamespace(prompt=None, extra_pnginfo=None), raising=False)
    images = torch.rand(1, 8, 12, channels, generator=torch.Generator().manual_seed(channels))
    entry, = save.execute(images=images, filename_prefix=f"kvgraph_channels_{channels}").ui["images"]
    with Image.open(Path(comfy_env.fake.output_dir) / entry["subfolder"] / entry["filename"]) as saved:
        saved.load()
        expected = np.clip(255.0 * images[0].numpy(), 0, 255).astype(np.uint8)
        assert saved.mode == mode and np.array_equal(np.asarray(saved), expected)
