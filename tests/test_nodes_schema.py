"""Node contract: the pack loads the way ComfyUI loads it, and every node's schema is what users and workflows rely on.

Runs without ComfyUI (a small fake of comfy_api.latest.io stands in; tests/e2e checks the same against a real server).
"""

import asyncio
import importlib.util
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake import PACK_ROOT, load_pack, unload_pack  # noqa: E402
from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

EXPECTED_NODES = {
    "KVGraphLoadDiffusers", "KVGraphLoadTransformer", "KVGraphLoadTextEncoder", "KVGraphLoadVAE", "KVGraphLoadLoRA",
    "KVGraphTextEncode", "KVGraphSampler", "KVGraphSigmas", "KVGraphVAEDecode", "KVGraphVAEEncode",
    "KVGraphSaveImage", "KVGraphCacheStatus", "KVGraphReleaseCaches", "KVGraphLoadControlNet",
    "KVGraphApplyControlNet", "KVGraphStepCache", "KVGraphPrefixCache",
}
# Node ids that core ComfyUI uses for Qwen-Image-2.1 and generic loaders/samplers: ours must never take them.
CORE_IDS = {"QwenImage21Cache", "TextEncodeQwenImage21", "KSampler", "VAEDecode", "VAEEncode", "UNETLoader",
            "CLIPLoader", "VAELoader", "DiffusersLoader"}


def schema(env, node_id):
    return env.nodes[node_id].define_schema()


def inputs_by_id(env, node_id):
    return {i.id: i for i in schema(env, node_id).inputs}


def test_pack_imports_outside_comfyui_without_node_code():
    assert importlib.util.find_spec("comfy_api") is None, "this test needs an environment without ComfyUI"
    pack = load_pack()
    try:
        assert pack.WEB_DIRECTORY == "./web"
        assert not hasattr(pack, "comfy_entrypoint")
        assert pack.__all__ == ["WEB_DIRECTORY"]
        assert f"{pack.__name__}.nodes" not in sys.modules  # nothing ComfyUI-specific was imported
    finally:
        unload_pack(pack)


def test_entrypoint_lists_every_node_under_any_folder_name(comfy_env):
    pack = comfy_env.pack
    assert pack.WEB_DIRECTORY == "./web" and "comfy_entrypoint" in pack.__all__
    extension = asyncio.run(pack.comfy_entrypoint())
    assert isinstance(extension, comfy_env.fake.modules["comfy_api.latest"].ComfyExtension)
    node_list = asyncio.run(extension.get_node_list())
    ids = [cls.define_schema().node_id for cls in node_list]
    assert set(ids) == EXPECTED_NODES and len(ids) == len(set(ids))
    # Relative imports only: the pack's node package is not the top-level `nodes` (ComfyUI's own module).
    assert "nodes" not in sys.modules or sys.modules["nodes"] is not pack.nodes
    assert pack.nodes.__name__ == f"{pack.__name__}.nodes"


def test_routes_are_registered_at_import(comfy_env):
    routes = comfy_env.fake.routes
    assert ("GET", "/kvgraph/status") in routes and ("POST", "/kvgraph/release") in routes


# A timing ("0.4 s", "108 ms") or a named card's result ("on an H200"): what a measurement, not a setting, says.
MEASURED_FIGURE = re.compile(r"\d(?:[\d.,-]*\d)? ?(?:ms|s)\b|\bH[12]00\b")


@pytest.mark.parametrize("node_id", sorted(EXPECTED_NODES))
def test_every_node_is_described_and_every_socket_has_a_tooltip(comfy_env, node_id):
    s = schema(comfy_env, node_id)
    assert s.node_id.startswith("KVGraph") and s.node_id not in CORE_IDS
    assert s.category == "KV-Graph" or s.category.startswith("KV-Graph/")
    assert s.display_name and len(s.description) > 40
    ids = [i.id for i in s.inputs]
    assert len(ids) == len(set(ids))
    for item in s.inputs:
        assert item.tooltip and len(item.tooltip) > 15, f"{node_id}.{item.id} has no useful tooltip"
    assert s.outputs, f"{node_id} has no output"
    for item in s.outputs:
        assert item.tooltip and len(item.tooltip) > 15, f"{node_id} output {item.display_name} has no useful tooltip"
    # Measured figures belong in the README and docs/performance.md, where they are dated and sourced; a tooltip
    # says what a setting does and points there.
    texts = [s.description] + [i.tooltip for i in s.inputs] + [o.tooltip for o in s.outputs]
    for text in texts:
        assert not MEASURED_FIGURE.search(text), f"{node_id}: a measured figure in {text!r}"


def test_sampler_schema(comfy_env):
    s = schema(comfy_env, "KVGraphSampler")
    inputs = {i.id: i for i in s.inputs}
    assert [i.id for i in s.inputs] == ["model", "positive", "negative", "latent", "seed", "steps", "cfg",
                                        "sigma_preset", "denoise", "decode_mode", "compile"]
    assert inputs["model"].io_type == "KVGRAPH_TRANSFORMER"
    assert inputs["positive"].io_type == "CONDITIONING" and not inputs["positive"].optional
    assert inputs["negative"].io_type == "CONDITIONING" and inputs["negative"].optional
    assert inputs["latent"].io_type == "LATENT"
    assert (inputs["steps"].default, inputs["steps"].min) == (40, 1)
    assert (inputs["cfg"].default, inputs["cfg"].min) == (1.0, 1.0)
    assert inputs["seed"].control_after_generate and inputs["seed"].max == 2**64 - 1
    assert inputs["sigma_preset"].options == ["auto", "dynamic", "turbo"] and inputs["sigma_preset"].default == "auto"
    assert (inputs["denoise"].default, inputs["denoise"].max) == (1.0, 1.0) and 0 < inputs["denoise"].min < 0.1
    assert inputs["decode_mode"].options == ["auto", "graph", "eager"] and inputs["decode_mode"].default == "auto"
    assert inputs["compile"].options == ["off", "blocks"] and inputs["compile"].default == "off"
    assert [o.io_type for o in s.outputs] == ["LATENT"]


def test_encode_schema(comfy_env):
    s = schema(comfy_env, "KVGraphTextEncode")
    inputs = {i.id: i for i in s.inputs}
    assert inputs["text_encoder"].io_type == "KVGRAPH_TEXT_ENCODER"
    assert [i.id for i in s.inputs] == ["text_encoder", "prompt", "negative_prompt", "width", "height",
                                        "size_from_reference", "reference_resolution", "vae", "images"]
    assert inputs["prompt"].multiline and inputs["negative_prompt"].multiline
    assert inputs["negative_prompt"].default == "" and not inputs["negative_prompt"].optional  # as core's node
    for side in ("width", "height"):
        assert (inputs[side].default, inputs[side].step, inputs[side].min) == (1024, 16, 16)
    assert inputs["vae"].io_type == "KVGRAPH_VAE" and inputs["vae"].optional
    # Up to 10 reference sockets that grow as they are connected (the model's limit), none of them required: min 0
    # (ComfyUI 0.33 requires the first `min`), and a template ComfyUI 0.8 can read (it reads only a required one).
    images = inputs["images"]
    assert images.io_type == "COMFY_AUTOGROW_V3" and images.optional
    assert images.template.names == [f"image{i}" for i in range(1, 11)] and images.template.min == 0
    assert images.template.input.io_type == "IMAGE" and not images.template.input.optional
    assert inputs["reference_resolution"].default == 1024
    assert [o.io_type for o in s.outputs] == ["CONDITIONING", "CONDITIONING", "LATENT"]
    assert [o.display_name for o in s.outputs] == ["positive", "negative", "latent"]


@pytest.mark.parametrize("node_id, name_input, folder_default, out_types", [
    ("KVGraphLoadTransformer", "transformer_name", "qwen_image_2.1_int8_convrot.safetensors",
     ["KVGRAPH_TRANSFORMER", "MODEL"]),
    ("KVGraphLoadTextEncoder", "text_encoder_name", "qwen3vl_8b_int8_convrot.safetensors", ["KVGRAPH_TEXT_ENCODER"]),
    ("KVGraphLoadVAE", "vae_name", "qwen_image_2.1_vae_bf16.safetensors", ["KVGRAPH_VAE"]),
])
def test_single_file_loader_schemas(comfy_env, node_id, name_input, folder_default, out_types):
    s = schema(comfy_env, node_id)
    inputs = {i.id: i for i in s.inputs}
    assert inputs[name_input].default == folder_default
    assert inputs[name_input].options[0] == folder_default  # offered even before the file is downloaded
    assert inputs["dtype"].options == ["bf16", "fp16", "fp32"] and inputs["dtype"].default == "bf16"
    assert [o.io_type for o in s.outputs] == out_types  # the transformer also as a core MODEL


@pytest.mark.parametrize("node_id", ["KVGraphLoadTransformer", "KVGraphLoadDiffusers"])
def test_attention_input_is_an_optional_combo_defaulting_to_auto(comfy_env, node_id):
    """Both loaders offer the four kernels, optional with `auto` as default (a workflow saved before the input
    existed validates and runs auto), and the tooltip says what each is and when `auto` attends in FP8."""
    attention = inputs_by_id(comfy_env, node_id)["attention"]
    assert attention.optional and attention.default == "auto"
    assert list(attention.options) == ["auto", "sdpa", "fa3", "fp8"]
    for words in ("SDPA", "FlashAttention-3", "Hopper", "[fa3]", "logged", "with INT8 Linears it attends in FP8",
                  "INT8 error"):
        assert words in attention.tooltip, words


def test_text_encoder_placement_options(comfy_env):
    """Both loaders offer auto (the default: the memory plan's placement) and streamed by layer beside the three
    placements workflows saved before them hold, which stay valid values."""
    for node_id in ("KVGraphLoadTextEncoder", "KVGraphLoadDiffusers"):
        placement = inputs_by_id(comfy_env, node_id)["text_encoder_placement"]
        assert placement.options == ["auto", "gpu while encoding, then offload", "always gpu", "streamed by layer",
                                     "cpu"]
        assert placement.default == "auto"


def test_diffusers_loader_lists_pipeline_folders(comfy_env):
    s = schema(comfy_env, "KVGraphLoadDiffusers")
    assert inputs_by_id(comfy_env, "KVGraphLoadDiffusers")["folder"].options == ["qwen-image-2.1-tiny"]
    assert [o.io_type for o in s.outputs] == ["KVGRAPH_TRANSFORMER", "KVGRAPH_TEXT_ENCODER", "KVGRAPH_VAE", "MODEL"]


def test_cache_nodes_are_output_nodes_that_always_run(comfy_env):
    for node_id in ("KVGraphCacheStatus", "KVGraphReleaseCaches"):
        s = schema(comfy_env, node_id)
        assert s.is_output_node and [o.io_type for o in s.outputs] == ["STRING", "COMFY_MATCHTYPE_V3"]
        # An optional input of any type, whose type the second output takes: it orders the node after another.
        passthrough = inputs_by_id(comfy_env, node_id)["passthrough"]
        assert passthrough.io_type == "COMFY_MATCHTYPE_V3" and passthrough.optional
        assert passthrough.template.template_id == s.outputs[1].template.template_id
        fingerprint = comfy_env.nodes[node_id].fingerprint_inputs(
            **({"release_models": False} if node_id == "KVGraphReleaseCaches" else {}))
        assert fingerprint != fingerprint  # NaN: ComfyUI never treats the node as unchanged
    release = inputs_by_id(comfy_env, "KVGraphReleaseCaches")["release_models"]
    assert release.io_type == "BOOLEAN" and release.default is False


def test_pack_root_is_the_repository_root():
    assert (PACK_ROOT / "__init__.py").is_file() and (PACK_ROOT / "nodes" / "__init__.py").is_file()
