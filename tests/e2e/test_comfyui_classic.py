"""The pack inside a real ComfyUI (CPU, tiny models, ComfyUI's default classic cache), driven over HTTP.

Every example workflow runs; the same loaded model and graph manager answer later prompts (also after another
workflow ran); interrupts and bad inputs fail only their own prompt; the status and release routes work.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import (  # noqa: E402
    REFERENCE_IMAGES, SMALL, error_message, load_api_workflow, node_of, with_diffusers_loader,
)

pytestmark = pytest.mark.comfyui

# Every shipped example, by its API twin's name: each one runs as shipped (at a CPU-sized width and height).
EXAMPLES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "example_workflows" / "api").glob("*.json"))
T_FILE = "qwen_image_2.1_int8_convrot.safetensors"  # the examples load the INT8 ConvRot files
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


@pytest.fixture(scope="module")
def server(classic_server):
    return classic_server


def transformer_status(server) -> dict:
    models = [m for m in server.status()["models"] if (m["source"] or "").endswith(T_FILE)]
    assert len(models) == 1, server.status()
    return models[0]


def expected_size(name: str, base: Path) -> tuple[int, int]:
    """The output size: the last reference's at the reference resolution for edits (the encode node's default), the
    inpainted image's cropped to 16 px, else the encode node's width and height."""
    from graph_runtime.encoding.images import reference_size

    last = {"edit_two": 1, "edit_one": 0, "edit_custom_sampler": 0, "edit_five": 4, "remove_background": 1}
    for key, index in last.items():
        if key in name:
            return reference_size(Image.open(base / "input" / REFERENCE_IMAGES[index]), SMALL)
    if "inpaint" in name and "controlnet" not in name:  # the ControlNet's inpainting samples the prompt's latent
        width, height = Image.open(base / "input" / REFERENCE_IMAGES[1]).size
        return width // 16 * 16, height // 16 * 16
    return SMALL, SMALL * 3 // 4


def test_real_server_schema_matches_the_examples(server):
    """The widget order ComfyUI reports (required, then optional) maps each UI example onto its API twin."""
    import json

    from comfy_server import REPO, ui_workflow_path

    info = server.get("/object_info")
    ours = {k for k, v in info.items() if v["category"].startswith("KV-Graph")}
    assert {"KVGraphSampler", "KVGraphSigmas", "KVGraphTextEncode", "KVGraphLoadTransformer",
            "KVGraphLoadTextEncoder", "KVGraphLoadVAE", "KVGraphLoadDiffusers", "KVGraphLoadLoRA", "KVGraphVAEDecode",
            "KVGraphVAEEncode", "KVGraphSaveImage", "KVGraphCacheStatus", "KVGraphReleaseCaches",
            "KVGraphLoadControlNet", "KVGraphApplyControlNet", "KVGraphStepCache", "KVGraphPrefixCache"} == ours
    sampler = info["KVGraphSampler"]["input"]
    assert sampler["required"]["steps"][1]["default"] == 40 and sampler["required"]["cfg"][1]["default"] == 1.0
    for name in EXAMPLES:
        ui = json.loads(ui_workflow_path(name).read_text())
        api = json.loads((REPO / "example_workflows" / "api" / f"{name}.json").read_text())
        for node in ui["nodes"]:
            if node["type"] not in info:  # a frontend-only note: not in the API twin either
                assert node["type"] == "MarkdownNote" and str(node["id"]) not in api, (name, node["type"])
                continue
            spec = info[node["type"]]
            widgets = []
            for section in ("required", "optional"):
                for input_name in spec["input_order"].get(section, []):
                    kind, options = spec["input"][section][input_name][0], spec["input"][section][input_name][1:]
                    if isinstance(kind, list) or kind in WIDGET_TYPES:
                        widgets.append(input_name)
                        opts = options[0] if options else {}
                        if opts.get("control_after_generate"):
                            widgets.append(None)
                        if opts.get("image_upload"):
                            widgets.append(None)
            values = dict((w, v) for w, v in zip(widgets, node["widgets_values"]) if w is not None)
            assert len(widgets) == len(node["widgets_values"]), (name, node["type"])
            twin = {k: v for k, v in api[str(node["id"])]["inputs"].items() if not isinstance(v, list)}
            assert values == twin, (name, node["type"])


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_workflow_runs(server, comfy_base, name):
    entry = server.run(load_api_workflow(name, seed=11))
    images = server.output_images(entry)
    assert len(images) == 1 and images[0].is_file()
    assert Image.open(images[0]).size == expected_size(name, comfy_base)


def test_queueing_again_reuses_the_loaded_model_and_its_manager(server):
    server.run(load_api_workflow(EXAMPLES[0], seed=101))
    first = transformer_status(server)
    steps = node_of(load_api_workflow(EXAMPLES[0]), "KVGraphSampler")["inputs"]["steps"]
    server.run(load_api_workflow(EXAMPLES[2], seed=102))  # another workflow, same files, in between
    server.run(load_api_workflow(EXAMPLES[0], seed=103))
    again = transformer_status(server)
    assert again["engine_id"] == first["engine_id"]  # the same graph manager answered
    assert again["loads"] == first["loads"] == 1  # the file was read once for the whole session
    # On CPU every decode step is eager, counted under its reason; nothing is captured.
    assert again["captures"] == 0 and again["entries"] == []
    assert again["eager_steps"]["no CUDA"] >= first["eager_steps"]["no CUDA"] + steps
    loaded = {item["kind"]: item["loads"] for item in server.status()["loaded"] if "diffusers" not in item["source"]}
    assert loaded == {"transformer": 1, "text_encoder": 1, "vae": 1}


def test_the_prefix_cache_node_places_the_prefix(server):
    """A KV-Graph Prefix Cache node between the loader and the sampler: the run keeps its prefix where the node says
    (a host prefix, then no cache), the status route counts each prefill under its placement, and recompute's eager
    steps are counted under their reason."""
    loaded = [m for m in server.status()["models"] if (m["source"] or "").endswith(T_FILE)]
    before = loaded[0]["prefix_placements"] if loaded else {}
    for placement, seed in (("host", 401), ("recompute", 402)):
        prompt = load_api_workflow(EXAMPLES[0], seed=seed)
        sampler = node_of(prompt, "KVGraphSampler")
        prompt["900"] = {"class_type": "KVGraphPrefixCache",
                         "inputs": {"model": sampler["inputs"]["model"], "placement": placement}}
        sampler["inputs"]["model"] = ["900", 0]
        entry = server.run(prompt)
        assert len(server.output_images(entry)) == 1
    status = transformer_status(server)
    placements = status["prefix_placements"]
    # One prefill per CFG branch of each run.
    assert placements["host"] - before.get("host", 0) == placements["recompute"] - before.get("recompute", 0) >= 1
    assert any("recompute" in reason for reason in status["eager_steps"])


def test_interrupt_during_sampling_then_the_next_prompt_runs(server):
    prompt = load_api_workflow(EXAMPLES[0], seed=201)
    node_of(prompt, "KVGraphSampler")["inputs"]["steps"] = 1000
    prompt_id = server.queue_ok(prompt)
    running = server.wait_for_step(2)
    assert running["prompt_id"] == prompt_id and running["total"] == 1000
    assert server.post("/interrupt").ok
    entry = server.wait(prompt_id)
    assert entry["status"]["status_str"] == "error"
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]]
    status = server.status()
    assert status["running"] == [] and not transformer_status(server)["busy"]
    server.run(load_api_workflow(EXAMPLES[0], seed=202))


def test_width_off_the_grid_is_refused_when_queued(server):
    response = server.queue(load_api_workflow(EXAMPLES[0], seed=301, width=100))
    # The encode node's validate_inputs answers before anything runs (test_comfyui_robustness has the details).
    assert response.status_code == 400
    assert "width=100 is invalid" in response.text and "multiple of 16" in response.text
    server.run(load_api_workflow(EXAMPLES[0], seed=302))


def test_unknown_model_file_is_rejected_with_its_name(server):
    bad = load_api_workflow(EXAMPLES[0], seed=401)
    node_of(bad, "KVGraphLoadTransformer")["inputs"]["transformer_name"] = "qwen_image_2.1_missing.safetensors"
    response = server.queue(bad)
    # ComfyUI validates combo values before running: the prompt is refused, naming the input and the value.
    assert response.status_code == 400
    assert "transformer_name" in response.text and "qwen_image_2.1_missing.safetensors" in response.text
    server.run(load_api_workflow(EXAMPLES[0], seed=402))


def test_broken_model_file_fails_with_a_message_naming_it(server):
    bad = load_api_workflow(EXAMPLES[0], seed=501)
    node_of(bad, "KVGraphLoadTransformer")["inputs"]["transformer_name"] = "kvgraph_broken.safetensors"
    entry = server.wait(server.queue_ok(bad))
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert "kvgraph_broken.safetensors" in message and "Expected" in message
    server.run(load_api_workflow(EXAMPLES[0], seed=502))


def test_diffusers_folder_workflow(server):
    prompt = with_diffusers_loader(load_api_workflow(EXAMPLES[0], seed=601), "qwen-image-2.1-tiny")
    entry = server.run(prompt)
    assert Image.open(server.output_images(entry)[0]).size == (SMALL, SMALL * 3 // 4)


def test_cache_status_node_and_release_route(server):
    prompt = {"1": {"class_type": "KVGraphCacheStatus", "inputs": {}}}
    entry = server.run(prompt)
    report = entry["outputs"]["1"]["text"][0]
    assert T_FILE in report and "no CUDA" in report

    assert server.post("/kvgraph/release", {"models": "yes"}).status_code == 400
    response = server.post("/kvgraph/release", {"models": False})
    assert response.ok and all(g["result"] == "released" for g in response.json()["graphs"])
    response = server.post("/kvgraph/release", {"models": True})
    assert response.ok and {m["kind"] for m in response.json()["models"]} >= {"transformer", "text_encoder", "vae"}
    assert server.status()["loaded"] == []
    server.run(load_api_workflow(EXAMPLES[0], seed=701))
    assert transformer_status(server)["loads"] == 2  # released, so read from disk once more


def test_the_transformer_loader_lists_gguf_files(server):
    """ComfyUI lists only its own extensions in diffusion_models; the loader's dropdown adds the .gguf files there
    (the GGUF example's, written by make-tiny), each once."""
    spec = server.get("/object_info/KVGraphLoadTransformer")["KVGraphLoadTransformer"]["input"]["required"][
        "transformer_name"]
    options = spec[0] if isinstance(spec[0], list) else spec[1]["options"]  # the old and the COMBO spelling
    assert "qwen_image_2.1-Q8_0.gguf" in options and "qwen_image_2.1-Q4_0.gguf" in options
    assert len(options) == len(set(options))


def test_a_gguf_language_tower_runs_in_the_text_to_image_example(server):
    """The text encoder loader lists make-tiny's GGUF language tower and, picked in the text-to-image example, it
    encodes with the vision tower of ComfyUI's Qwen3-VL file beside it; the image is made."""
    spec = server.get("/object_info/KVGraphLoadTextEncoder")["KVGraphLoadTextEncoder"]["input"]["required"][
        "text_encoder_name"]
    options = spec[0] if isinstance(spec[0], list) else spec[1]["options"]
    assert "qwen3vl_8b-Q8_0.gguf" in options
    prompt = load_api_workflow("qwen_image_2.1_text_to_image", seed=12)
    node_of(prompt, "KVGraphLoadTextEncoder")["inputs"]["text_encoder_name"] = "qwen3vl_8b-Q8_0.gguf"
    images = server.output_images(server.run(prompt))
    assert len(images) == 1 and images[0].is_file()


@pytest.mark.parametrize("name", ["qwen_image_2.1_fp8_scaled.safetensors", "qwen_image_2.1_awq_w4a16.safetensors",
                                  "qwen_image_2.1_nvfp4.safetensors", "qwen_image_2.1_mxfp8.safetensors"])
def test_a_mixed_precision_file_runs_in_the_text_to_image_example(server, name):
    """make-tiny's FP8 scaled, W4A16/AWQ, NVFP4 and MXFP8 transformers (ComfyUI comfy_quant files) are listed by the
    transformer loader and, picked in the text-to-image example, load dequantized by the comfy-kitchen of this
    ComfyUI's Python and make the image."""
    spec = server.get("/object_info/KVGraphLoadTransformer")["KVGraphLoadTransformer"]["input"]["required"][
        "transformer_name"]
    options = spec[0] if isinstance(spec[0], list) else spec[1]["options"]
    assert name in options
    prompt = load_api_workflow("qwen_image_2.1_text_to_image", seed=13)
    node_of(prompt, "KVGraphLoadTransformer")["inputs"]["transformer_name"] = name
    images = server.output_images(server.run(prompt))
    assert len(images) == 1 and images[0].is_file()
