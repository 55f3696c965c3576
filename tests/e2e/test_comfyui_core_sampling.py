"""ComfyUI's own samplers on the pack's MODEL in a real ComfyUI (CPU, tiny models, the classic cache), over HTTP.

The four core-sampling examples run in test_comfyui_classic.py; here: SamplerCustomAdvanced over KV-Graph Sigmas
gives the KV-Graph Sampler's latents (saved with core's SaveLatent), a KSampler run reports its progress and leaves
nothing behind when interrupted, and bad combinations (core's LoRA loader on the MODEL, a core VAE wired into a
KV-Graph node) fail with a message saying what to use instead while the next prompt runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import error_message, load_api_workflow, node_of, start_server  # noqa: E402

pytestmark = pytest.mark.comfyui

CUSTOM = "qwen_image_2.1_edit_custom_sampler"
KSAMPLER = "qwen_image_2.1_ksampler"
STEPS = 4
# Both runs compute in fp32 on the CPU (the transformer loaded as fp32) from the same noise and sigmas; core's Euler
# writes the update through the denoised prediction (a few float32 ulps of latents of magnitude ~5 over 4 steps, x4
# for CFG). In bf16 the KV-Graph Sampler rounds its latents to bf16 after every step, as the pipeline does, and core
# keeps them in fp32: the two then differ by bf16 rounding, which is not what this compares.
LATENT_ATOL = 1e-4


@pytest.fixture(scope="module")
def server(comfyui_install, comfy_base):
    """A server of its own: the parity test loads the transformer as fp32 too, which the shared server's other
    modules would see as a second loaded model."""
    srv = start_server(comfyui_install, comfy_base)
    yield srv
    srv.stop()


def saved_latent(server, entry):
    """The latent core's SaveLatent wrote for this prompt."""
    from safetensors.torch import load_file

    for output in entry["outputs"].values():
        for item in output.get("latents", []):
            path = server.base / "output" / item.get("subfolder", "") / item["filename"]
            return load_file(str(path))["latent_tensor"]
    raise AssertionError(f"no latent saved: {entry['outputs']}")


def with_save_latent(prompt: dict, source: str, prefix: str) -> dict:
    """`prompt` with its transformer loaded as fp32 and the latent of node `source` saved."""
    node_of(prompt, "KVGraphLoadTransformer")["inputs"].update(dtype="fp32", int8_weights="dequantize")
    prompt["90"] = {"class_type": "SaveLatent", "inputs": {"samples": [source, 0], "filename_prefix": prefix}}
    return prompt


def test_sampler_custom_advanced_over_kvgraph_sigmas_equals_the_kvgraph_sampler(server):
    """The edit example (SamplerCustomAdvanced: RandomNoise, CFGGuider at cfg 4 with a negative prompt, euler, KV-Graph
    Sigmas) and the same graph with the KV-Graph Sampler in its place give the same latents for the same seed."""
    core = load_api_workflow(CUSTOM, seed=5)
    node_of(core, "KVGraphSigmas")["inputs"]["steps"] = STEPS
    cfg = node_of(core, "CFGGuider")["inputs"]["cfg"]
    assert cfg > 1 and node_of(core, "KSamplerSelect")["inputs"]["sampler_name"] == "euler"
    ours = load_api_workflow(CUSTOM, seed=5)
    sampler_id = next(k for k, n in ours.items() if n["class_type"] == "SamplerCustomAdvanced")
    for node_id in [k for k, n in ours.items() if n["class_type"] in ("SamplerCustomAdvanced", "KVGraphSigmas",
                                                                          "RandomNoise", "KSamplerSelect",
                                                                          "CFGGuider")]:
        del ours[node_id]
    ours[sampler_id] = {"class_type": "KVGraphSampler", "inputs": {
        "model": ["1", 0], "positive": ["4", 0], "negative": ["4", 1], "latent": ["4", 2], "seed": 5,
        "steps": STEPS, "cfg": cfg, "sigma_preset": "auto", "denoise": 1.0, "decode_mode": "auto",
        "compile": "off"}}
    a = saved_latent(server, server.run(with_save_latent(core, sampler_id, "kvgraph_e2e/core")))
    b = saved_latent(server, server.run(with_save_latent(ours, sampler_id, "kvgraph_e2e/ours")))
    assert a.shape == b.shape and float(a.abs().max()) > 1.0
    assert float((a - b).abs().max()) <= LATENT_ATOL
    # ComfyUI logs the MODEL's type as it builds it: flow matching, which it is, not FLUX.
    log = server.log_path.read_text()
    assert "model_type FLOW" in log and "model_type FLUX" not in log


def test_interrupting_a_ksampler_run_leaves_nothing_behind(server):
    """A long KSampler run shows its step in the pack's status; interrupted, it ends as ComfyUI's interrupted prompt,
    its run is gone (not running, the model not busy) and the next prompt runs."""
    prompt = load_api_workflow(KSAMPLER, seed=7)
    node_of(prompt, "KSampler")["inputs"]["steps"] = 1000
    prompt_id = server.queue_ok(prompt)
    running = server.wait_for_step(2)
    assert running["prompt_id"] == prompt_id and running["total"] == 1000
    assert server.post("/interrupt").ok
    entry = server.wait(prompt_id)
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]]
    assert server.status()["running"] == []
    assert not any(m.get("busy") for m in server.status()["models"])  # one entry per loaded transformer
    server.run(load_api_workflow(KSAMPLER, seed=8))


def test_a_lora_cores_loader_cannot_map_is_refused_naming_the_kvgraph_node(server, comfy_base):
    """LoraLoaderModelOnly on the MODEL with a PEFT-layout file (`transformer.` keys, which core's loader maps onto
    no weight of this MODEL) fails that prompt at the LoRA node, naming KV-Graph Load LoRA; the next prompt on the
    same model runs. (Files it maps run: tests/e2e/test_comfyui_core_lora.py.)"""
    import torch
    from safetensors.torch import save_file

    stem = "transformer.transformer_blocks.0.attn.to_q"
    save_file({f"{stem}.lora_A.weight": torch.zeros(4, 32), f"{stem}.lora_B.weight": torch.zeros(32, 4)},
              str(comfy_base / "models" / "loras" / "kvgraph_peft_only.safetensors"))
    prompt = load_api_workflow(KSAMPLER, seed=9)
    prompt["80"] = {"class_type": "LoraLoaderModelOnly",
                    "inputs": {"model": ["1", 1], "lora_name": "kvgraph_peft_only.safetensors", "strength_model": 1.0}}
    node_of(prompt, "KSampler")["inputs"]["model"] = ["80", 0]
    entry = server.wait(server.queue_ok(prompt))
    assert entry["status"]["status_str"] == "error"
    assert "matched none" in error_message(entry) and "KV-Graph Load LoRA" in error_message(entry)
    server.run(load_api_workflow(KSAMPLER, seed=10))


def test_a_core_vae_wired_into_a_kvgraph_node_is_refused_when_queued(server):
    """A core VAE (ComfyUI's pixel-space VAE: no file needed) in the KV-Graph VAE Decode's socket is refused when the
    prompt is queued, naming the mismatched types; nothing runs, and the next prompt does."""
    prompt = load_api_workflow(KSAMPLER, seed=11)
    prompt["81"] = {"class_type": "VAELoader", "inputs": {"vae_name": "pixel_space"}}
    node_of(prompt, "KVGraphVAEDecode")["inputs"]["vae"] = ["81", 0]
    response = server.queue(prompt)
    assert response.status_code == 400
    assert "KVGRAPH_VAE" in response.text and "VAE" in response.text
    server.run(load_api_workflow(KSAMPLER, seed=12))
