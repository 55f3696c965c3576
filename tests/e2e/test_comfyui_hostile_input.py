"""What an adversarial user sends a real ComfyUI (CPU, tiny models): names holding lone surrogates or bytes that are
not UTF-8, damaged safetensors headers, wrong types through core's Switch node, reference sockets that do not exist,
and release requests from other web pages.

One server started with `--cache-none`, so every node of every prompt runs. Each refused prompt is followed by the
same good prompt, which must run and give the image it gave first: before, a name ComfyUI could not write to its log
killed the prompt worker, and every later prompt waited forever. tests/test_nodes_hostile_input.py checks each
refusal's words at the node level (CPU, the fake ComfyUI).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import (  # noqa: E402
    LORA_FILE, REFERENCE_IMAGES, load_api_workflow, node_of, prepare_base, with_diffusers_loader,
)
from test_comfyui_robustness import ENCODE, SAMPLER, DECODE, execution_error, good_prompt  # noqa: E402

pytestmark = pytest.mark.comfyui

EDIT, LORA_EXAMPLE = "qwen_image_2.1_edit_one_reference", "qwen_image_2.1_lora"
STEPS = 2  # the LoRA and edit prompts only need to run
SURROGATE = "x\ud800.safetensors"  # sent as the JSON escape "x\\ud800.safetensors"
ODD_BYTES = b"kvgraph_\xff.safetensors"  # a file name that is not UTF-8
ODD = os.fsdecode(ODD_BYTES)  # as ComfyUI lists it, and as the JSON escape "kvgraph_\\udcff.safetensors" sends it
DAMAGED_ODD_BYTES = b"kvgraph_damaged_\xfe.safetensors"
FLOAT_SHAPE, STRING_OFFSETS = "kvgraph_float_shape.safetensors", "kvgraph_string_offsets.safetensors"
# (loader class, input name, model folder, the example's file in it)
LOADERS = [("KVGraphLoadTransformer", "transformer_name", "diffusion_models", "qwen_image_2.1_int8_convrot.safetensors"),
           ("KVGraphLoadTextEncoder", "text_encoder_name", "text_encoders", "qwen3vl_8b_int8_convrot.safetensors"),
           ("KVGraphLoadVAE", "vae_name", "vae", "qwen_image_2.1_vae_bf16.safetensors")]


def rewrite_header(source: Path, target, change) -> None:
    data = source.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    entry = header[next(k for k in sorted(header) if k != "__metadata__" and header[k]["shape"])]
    change(entry)
    raw = json.dumps(header).encode()
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def float_shape(entry):
    entry["shape"] = [float(s) for s in entry["shape"]]


def string_offsets(entry):
    entry["data_offsets"] = [str(o) for o in entry["data_offsets"]]


@pytest.fixture(scope="module")
def base(comfyui_install, tmp_path_factory):
    """The usual base, plus in each model folder a copy of the example's file under a non-UTF-8 name, files whose
    header has a float shape or string offsets, a damaged file under a non-UTF-8 name, and a diffusers folder with
    a damaged transformer."""
    base = prepare_base(tmp_path_factory.mktemp("comfyui-hostile"))
    models = base / "models"
    for _, _, folder, name in [*LOADERS, (None, None, "loras", LORA_FILE)]:
        source = models / folder / name
        shutil.copyfile(source, os.path.join(os.fsencode(models / folder), ODD_BYTES))
        rewrite_header(source, models / folder / FLOAT_SHAPE, float_shape)
        rewrite_header(source, models / folder / STRING_OFFSETS, string_offsets)
        with open(os.path.join(os.fsencode(models / folder), DAMAGED_ODD_BYTES), "wb") as f:
            f.write(b"\x00" * 64)
    pipeline = models / "diffusers" / "kvgraph-damaged"
    shutil.copytree(models / "diffusers" / "qwen-image-2.1-tiny", pipeline)
    weights = pipeline / "transformer" / "diffusion_pytorch_model.safetensors"
    rewrite_header(weights, weights, float_shape)
    return base


@pytest.fixture(scope="module")
def server(uncached_server):
    return uncached_server


@pytest.fixture(scope="module")
def reference(server):
    return server.output_pixels(server.run(good_prompt()))


def assert_server_runs_the_good_prompt(server, reference) -> None:
    """The same server runs the next valid prompt (its worker lives: a dead one never answers) and gives the first
    image again."""
    entry = server.run(good_prompt(), timeout=90)
    assert server.output_pixels(entry) == reference


def run_to_error(server, prompt: dict) -> dict:
    return execution_error(server.wait(server.queue_ok(prompt), timeout=90))


def switched(prompt: dict, value) -> list:
    """`value` reaching an input through core's Switch node, whose output takes any type: ComfyUI checks neither
    the type nor a combo's list for it."""
    prompt["90"] = ({"class_type": "PrimitiveString", "inputs": {"value": value}} if isinstance(value, str)
                    else {"class_type": "PrimitiveInt", "inputs": {"value": value}})
    prompt["91"] = {"class_type": "ComfySwitchNode", "inputs": {"switch": True, "on_true": ["90", 0],
                                                                 "on_false": ["90", 0]}}
    return ["91", 0]


def switched_link(prompt: dict, link: list) -> list:
    prompt["92"] = {"class_type": "ComfySwitchNode", "inputs": {"switch": True, "on_true": link, "on_false": link}}
    return ["92", 0]


def lora_prompt(name) -> dict:
    prompt = load_api_workflow(LORA_EXAMPLE, seed=2024, steps=STEPS)
    node_of(prompt, "KVGraphLoadLoRA")["inputs"]["lora_name"] = name
    return prompt


def loader_prompt(node_type: str, input_name: str, name) -> dict:
    prompt = good_prompt()
    node_of(prompt, node_type)["inputs"][input_name] = name
    return prompt


ALL_LOADERS = [(node_type, input_name) for node_type, input_name, _, _ in LOADERS] + [
    ("KVGraphLoadDiffusers", "folder"), ("KVGraphLoadLoRA", "lora_name")]


def prompt_for(node_type: str, input_name: str, name) -> dict:
    if node_type == "KVGraphLoadDiffusers":
        return with_diffusers_loader(good_prompt(), name, placement="cpu")
    if node_type == "KVGraphLoadLoRA":
        return lora_prompt(name)
    return loader_prompt(node_type, input_name, name)


# -- names ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("node_type, input_name", ALL_LOADERS)
def test_a_lone_surrogate_in_a_loaders_list_is_refused_when_queued(server, reference, node_type, input_name):
    """As core's loaders: a name not in the list is refused by ComfyUI's own check before anything runs."""
    response = server.queue(prompt_for(node_type, input_name, SURROGATE))
    assert response.status_code == 400
    errors = [e for node in response.json()["node_errors"].values() for e in node["errors"]]
    assert [e["type"] for e in errors] == ["value_not_in_list"] and errors[0]["extra_info"]["input_name"] == input_name
    assert_server_runs_the_good_prompt(server, reference)


@pytest.mark.parametrize("node_type, input_name", ALL_LOADERS)
def test_a_lone_surrogate_reaching_a_loader_through_a_switch_leaves_the_server_running(server, reference, node_type,
                                                                                        input_name):
    """Before: the loader's error repeated the name, ComfyUI could not write it to its log (`lost sys.stderr`) and
    the prompt worker died; the good prompt after it never ran."""
    prompt = prompt_for(node_type, input_name, None)
    node_of(prompt, node_type)["inputs"][input_name] = switched(prompt, SURROGATE)
    error = run_to_error(server, prompt)
    assert error["node_type"] == node_type
    assert "x\\ud800.safetensors" in error["exception_message"]
    assert_server_runs_the_good_prompt(server, reference)


@pytest.mark.parametrize("node_type, input_name, folder, _", LOADERS)
def test_a_file_with_a_non_utf8_name_loads(server, reference, node_type, input_name, folder, _):
    """Before: `SafetensorError: Path ... is not valid UTF-8`. A copy of the example's file under a name holding the
    byte 0xff is listed, loads, and gives the same image."""
    options = server.get(f"/object_info/{node_type}")[node_type]["input"]["required"][input_name][1]["options"]
    assert ODD in options
    entry = server.run(loader_prompt(node_type, input_name, ODD), timeout=90)
    assert server.output_pixels(entry) == reference
    assert_server_runs_the_good_prompt(server, reference)


def test_a_lora_with_a_non_utf8_name_gives_the_same_image_as_its_copy(server, reference):
    first = server.output_pixels(server.run(lora_prompt(LORA_FILE), timeout=90))
    assert server.output_pixels(server.run(lora_prompt(ODD), timeout=90)) == first
    assert_server_runs_the_good_prompt(server, reference)


@pytest.mark.parametrize("node_type, input_name", ALL_LOADERS[:3] + ALL_LOADERS[4:])
def test_a_damaged_file_with_a_non_utf8_name_is_refused_and_the_server_runs_on(server, reference, node_type,
                                                                               input_name):
    error = run_to_error(server, prompt_for(node_type, input_name, os.fsdecode(DAMAGED_ODD_BYTES)))
    assert error["node_type"] == node_type
    assert "kvgraph_damaged_\\xfe.safetensors" in error["exception_message"]
    assert "not a safetensors file" in error["exception_message"]
    assert_server_runs_the_good_prompt(server, reference)


# -- damaged headers -----------------------------------------------------------------------------------------------


DAMAGED_HEADERS = [(*loader, name, words) for loader in ALL_LOADERS if loader[0] != "KVGraphLoadDiffusers"
                   for name, words in ((FLOAT_SHAPE, "whose shape"), (STRING_OFFSETS, "whose data_offsets"))]
DAMAGED_HEADERS.append(("KVGraphLoadDiffusers", "folder", "kvgraph-damaged", "whose shape"))  # its transformer's


@pytest.mark.parametrize("node_type, input_name, name, words", DAMAGED_HEADERS)
def test_a_header_with_a_float_shape_or_string_offsets_is_refused_by_name(server, reference, node_type, input_name,
                                                                          name, words):
    """Before: `SafetensorError: invalid JSON in header`, naming neither the file nor the entry."""
    error = run_to_error(server, prompt_for(node_type, input_name, name))
    assert error["node_type"] == node_type and error["exception_type"].endswith("CheckpointError")
    assert words in error["exception_message"] and "a damaged file" in error["exception_message"]
    assert_server_runs_the_good_prompt(server, reference)


# -- wrong types through a Switch node ---------------------------------------------------------------------------


def text_into(node_id: str, input_name: str):
    def change(prompt):
        prompt[node_id]["inputs"][input_name] = switched(prompt, "a text")
    return change


def model_output_into_sampler(prompt):
    prompt[SAMPLER]["inputs"]["model"] = switched_link(prompt, ["1", 1])  # the loader's MODEL, not its transformer


def text_into_reference(prompt):
    prompt[ENCODE]["inputs"]["images.image1"] = switched(prompt, "a text")


@pytest.mark.parametrize("change, node_type, start", [
    (text_into(SAMPLER, "model"), "KVGraphSampler", "model='a STRING' is invalid: expected a KV-Graph transformer"),
    (model_output_into_sampler, "KVGraphSampler", "model='a MODEL ("),
    (text_into(ENCODE, "text_encoder"), "KVGraphTextEncode", "text_encoder='a STRING' is invalid: expected a "
                                                             "KV-Graph text encoder"),
    (text_into(DECODE, "vae"), "KVGraphVAEDecode", "vae='a STRING' is invalid: expected a KV-Graph VAE"),
    (text_into_reference, "KVGraphTextEncode", "images.image1='a STRING' is invalid: expected an IMAGE"),
])
def test_a_wrong_type_through_a_switch_is_refused_by_name(server, reference, change, node_type, start):
    """Before: `AttributeError: 'str' object has no attribute ...` from inside the node."""
    prompt = good_prompt()
    change(prompt)
    error = run_to_error(server, prompt)
    assert error["node_type"] == node_type and error["exception_message"].startswith(start), error
    assert_server_runs_the_good_prompt(server, reference)


def test_a_text_into_the_encode_nodes_vae_is_refused_by_name(server, reference):
    prompt = load_api_workflow(EDIT, seed=2024, steps=STEPS)
    prompt[ENCODE]["inputs"]["vae"] = switched(prompt, "a text")
    error = run_to_error(server, prompt)
    assert error["exception_message"].startswith("vae='a STRING' is invalid: expected a KV-Graph VAE")
    assert_server_runs_the_good_prompt(server, reference)


# -- reference sockets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("socket", ["image0", "image11", "imagefoo"])
def test_an_unknown_reference_socket_is_refused_when_queued_with_the_limit(server, reference, socket):
    """Before: `TypeError: ... unexpected keyword argument 'images.image11'` once the loaders had run. Now ComfyUI
    answers POST /prompt with the limit, before anything runs."""
    prompt = load_api_workflow(EDIT, seed=2024, steps=STEPS)
    prompt[ENCODE]["inputs"][f"images.{socket}"] = prompt[ENCODE]["inputs"].pop("images.image1")
    response = server.queue(prompt)
    assert response.status_code == 400, response.text
    details = [e["details"] for e in response.json()["node_errors"][ENCODE]["errors"]]
    assert any(f"images=['{socket}'] is invalid: expected at most 10 reference images" in d for d in details), details
    assert_server_runs_the_good_prompt(server, reference)


def test_eleven_references_are_refused_when_queued_and_ten_run(server, reference):
    prompt = load_api_workflow(EDIT, seed=2024, steps=STEPS)
    image = prompt[ENCODE]["inputs"]["images.image1"]
    for i in range(1, 12):
        prompt[ENCODE]["inputs"][f"images.image{i}"] = image
    response = server.queue(prompt)
    assert response.status_code == 400
    assert "images=['image11'] is invalid: expected at most 10" in response.text
    del prompt[ENCODE]["inputs"]["images.image11"]
    prompt[ENCODE]["inputs"]["reference_resolution"] = 64
    assert server.run(prompt, timeout=180)["status"]["status_str"] == "success"
    assert REFERENCE_IMAGES  # the edit example's inputs are in the base's input folder


# -- the release route ---------------------------------------------------------------------------------------------


def release(server, headers: dict) -> requests.Response:
    return requests.post(f"{server.url}/kvgraph/release", data=b"{}", timeout=30,
                         headers={"Content-Type": "application/json", **headers})


def test_the_release_route_refuses_origin_null_and_other_pages(server):
    """Before: a request with `Origin: null` (a sandboxed frame, a file:// page; ComfyUI's own origin check lets it
    through) released the models. Refused with a 403 saying why. Another origin is refused too: by ComfyUI's check
    where the server listens on a loopback address (an empty 403), else by the pack's (its body)."""
    response = release(server, {"Origin": "null"})
    assert response.status_code == 403
    assert response.json()["error"].startswith("refused: this request comes from another web page")
    assert release(server, {"Origin": "http://evil.example"}).status_code == 403
    assert release(server, {"Origin": f"http://127.0.0.1:{server.port + 1}"}).status_code == 403


def test_the_release_route_answers_its_own_page_and_clients_without_an_origin(server, reference):
    assert release(server, {}).status_code == 200
    assert release(server, {"Origin": server.url}).status_code == 200
    assert release(server, {"Origin": f"http://localhost:{server.port}",
                            "Host": f"localhost:{server.port}"}).status_code == 200
    assert_server_runs_the_good_prompt(server, reference)
