"""Core's guidance nodes on the pack's MODEL in a real ComfyUI (CPU, tiny models, the classic cache), over HTTP.

The skip-layer-guidance example runs as shipped in test_comfyui_classic.py; here: it changes the sampled latents
against the same graph without the node (the node is not a silent no-op), and SelfAttentionGuidance, which no
Qwen-Image-2.1 model can run, fails its prompt with a message naming it while the next prompt runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import error_message, load_api_workflow, node_of  # noqa: E402

pytestmark = pytest.mark.comfyui

SLG = "qwen_image_2.1_skip_layer_guidance"
# The latents are of magnitude ~3 (bf16); the guidance term (scale 3 times the difference of two predictions) moves
# them by far more than bf16 rounding of the same run repeated (0: the runs are deterministic on the CPU).
CHANGED = 1e-2


@pytest.fixture(scope="module")
def server(classic_server):
    return classic_server


def saved_latent(server, entry):
    from safetensors.torch import load_file

    for output in entry["outputs"].values():
        for item in output.get("latents", []):
            return load_file(str(server.base / "output" / item.get("subfolder", "") / item["filename"]))["latent_tensor"]
    raise AssertionError(f"no latent saved: {entry['outputs']}")


def with_saved_latent(prompt: dict, prefix: str) -> dict:
    sampler = next(k for k, n in prompt.items() if n["class_type"] == "KSampler")
    prompt["90"] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": prefix}}
    return prompt


def test_skip_layer_guidance_changes_the_output(server):
    """The example with SkipLayerGuidanceDiT and the same graph with KSampler on the bare MODEL, same seed: the
    latents differ; the same guided prompt again gives the same latents."""
    guided = with_saved_latent(load_api_workflow(SLG, seed=3), "kvgraph_e2e/slg")
    assert node_of(guided, "SkipLayerGuidanceDiT")["inputs"]["single_layers"]
    plain = with_saved_latent(load_api_workflow(SLG, seed=3), "kvgraph_e2e/no_slg")
    slg_id = next(k for k, n in plain.items() if n["class_type"] == "SkipLayerGuidanceDiT")
    node_of(plain, "KSampler")["inputs"]["model"] = node_of(plain, "SkipLayerGuidanceDiT")["inputs"]["model"]
    del plain[slg_id]
    a = saved_latent(server, server.run(guided))
    b = saved_latent(server, server.run(plain))
    again = saved_latent(server, server.run(with_saved_latent(load_api_workflow(SLG, seed=3), "kvgraph_e2e/slg2")))
    assert float((a - b).abs().max()) > CHANGED
    assert float((a - again).abs().max()) == 0.0


def test_self_attention_guidance_is_refused_naming_it(server):
    """SelfAttentionGuidance on the MODEL (a UNet attention replace) fails the prompt with a message naming the node,
    not an AttributeError; the next prompt on the same model runs."""
    prompt = load_api_workflow("qwen_image_2.1_ksampler", seed=4)
    prompt["82"] = {"class_type": "SelfAttentionGuidance", "inputs": {"model": ["1", 1], "scale": 0.5,
                                                                     "blur_sigma": 2.0}}
    node_of(prompt, "KSampler")["inputs"]["model"] = ["82", 0]
    entry = server.wait(server.queue_ok(prompt))
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert "SelfAttentionGuidance" in message and "AttributeError" not in message
    server.run(load_api_workflow("qwen_image_2.1_ksampler", seed=5))
