"""The background-removal example in a real ComfyUI (CPU, tiny models): KV-Graph VAE Decode's MASK through core's
own Join Image with Alpha and KV-Graph Save Image gives an RGBA PNG whose alpha is the VAE's alpha channel.

The VAE's alpha is computed here, independently of the server: the sampled latent is saved with core's SaveLatent
next to the PNG, and decoded in the test with the same VAE file and dtype (bf16, as the example's loader). Tolerance:
the PNG holds alpha as core's SaveImage converts it (255 x, truncated: under 1/255 below), and the two decodes run
the same bf16 code on CPU, possibly on other thread counts: 2/255 in all.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import load_api_workflow, node_of  # noqa: E402

pytestmark = pytest.mark.comfyui

EXAMPLE = "qwen_image_2.1_remove_background"
VAE_FILE = "qwen_image_2.1_vae_bf16.safetensors"


@pytest.fixture(scope="module")
def server(classic_server):
    return classic_server


def test_the_saved_png_has_the_vaes_alpha(server, comfy_base):
    from safetensors.torch import load_file

    from graph_runtime.encoding.images import vae_decode
    from graph_runtime.loading.vae import load_vae

    prompt = load_api_workflow(EXAMPLE, seed=5)
    sampler = next(k for k, v in prompt.items() if v["class_type"] == "KVGraphSampler")
    prompt["90"] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0],
                                                           "filename_prefix": "kvgraph_rgba/latent"}}
    assert node_of(prompt, "JoinImageWithAlpha") and node_of(prompt, "KVGraphSaveImage")
    entry = server.run(prompt)
    (png,) = server.output_images(entry)
    (latent,) = entry["outputs"]["90"]["latents"]
    raw = load_file(str(comfy_base / "output" / latent["subfolder"] / latent["filename"]))["latent_tensor"]

    with Image.open(png) as saved:
        assert saved.mode == "RGBA"
        alpha_png = np.asarray(saved)[..., 3].astype(np.float32) / 255.0
    vae = load_vae(comfy_base / "models" / "vae" / VAE_FILE, dtype=torch.bfloat16)
    decoded = vae_decode(vae, raw)
    alpha = ((decoded[0, 3].float() + 1) / 2).clamp(0, 1).numpy()
    assert alpha_png.shape == alpha.shape and alpha.std() > 1e-3
    assert np.abs(alpha_png - alpha).max() <= 2 / 255
