"""Input an adversarial user sends (CPU, the fake ComfyUI): names holding lone surrogates or bytes that are not
UTF-8, damaged safetensors headers, wrong types through a Switch-like node, reference sockets that do not exist, and
release requests from other web pages. Each is refused with a message naming the input and what was expected, a
message that ComfyUI's strict UTF-8 log can write (one it cannot write kills its prompt worker), or, for a valid
file with a non-UTF-8 name, loads.

tests/e2e/test_comfyui_hostile_input.py runs the same against real ComfyUI servers, with the next prompt after each.
"""

import io
import json
import logging
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_robustness import (  # noqa: E402
    DIFFUSERS_INPUTS, T_FILE, TINY_PIPELINE, VAE_FILE, encode, from_pack, good_vae, post_release, run, text_encoder,
)

assert good_vae and text_encoder  # module fixtures shared with test_nodes_robustness

TE_FILE = "qwen3vl_8b_bf16.safetensors"
LORA = "kvgraph_hostile_lora.safetensors"
SURROGATE = "x\ud800.safetensors"  # what json.loads makes of "x\\ud800.safetensors" in a POST /prompt body
NOT_UTF8 = os.fsdecode(b"kvgraph_\xff.safetensors")  # a file name with a byte that is not UTF-8, as os.listdir gives it


def writable(message: str) -> str:
    """`message` after checking that ComfyUI's log (a strict UTF-8 stream) can write it."""
    message.encode("utf-8")
    return message


def loader_inputs(node_id: str, name: str) -> dict:
    return {
        "KVGraphLoadTransformer": {"transformer_name": name, "dtype": "fp32"},
        "KVGraphLoadTextEncoder": {"text_encoder_name": name, "dtype": "fp32", "text_encoder_placement": "cpu"},
        "KVGraphLoadVAE": {"vae_name": name, "dtype": "fp32"},
        "KVGraphLoadDiffusers": {"folder": name, **DIFFUSERS_INPUTS},
    }[node_id]


FOLDERS = {"KVGraphLoadTransformer": ("diffusion_models", T_FILE), "KVGraphLoadTextEncoder": ("text_encoders", TE_FILE),
           "KVGraphLoadVAE": ("vae", VAE_FILE)}


@pytest.fixture(scope="module")
def transformer(comfy_env):
    handle, _ = run(comfy_env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32")
    return handle


def load_lora(env, model, name):
    return run(env, "KVGraphLoadLoRA", model=model, lora_name=name, strength=1.0)[0]


@pytest.fixture
def own_folders(comfy_env, tmp_path, monkeypatch):
    """Each model folder of the fake ComfyUI replaced by an empty one under tmp_path (the shared tiny files stay as
    the other tests list them); returns the folder of a kind."""
    folder_paths = comfy_env.fake.modules["folder_paths"]
    monkeypatch.setattr(folder_paths, "get_folder_paths", lambda kind: [str(tmp_path / kind)])
    monkeypatch.setattr(folder_paths, "get_filename_list", lambda kind: sorted(os.listdir(tmp_path / kind))
                        if (tmp_path / kind).is_dir() else [])

    def folder(kind: str) -> Path:
        (tmp_path / kind).mkdir(exist_ok=True)
        return tmp_path / kind

    return folder


# -- names ---------------------------------------------------------------------------------------------------------


def test_every_error_of_the_pack_escapes_what_it_echoes(comfy_env):
    """A lone surrogate (JSON's "\\ud800") or a non-UTF-8 byte of a file name is shown as an escape in every message
    of the pack, whichever error class carries it, so the message can be logged."""
    errors = from_pack(comfy_env, "errors")
    cases = [errors.CheckpointError(f"/models/{SURROGATE}", "was not found."),
             errors.CheckpointError(f"/models/{NOT_UTF8}", f"has a tensor {NOT_UTF8!r}."),
             errors.InputError("vae_name", SURROGATE, "a file"),
             errors.KVGraphError(f"a \ud800 b {NOT_UTF8}"), errors.OutputWriteError(NOT_UTF8, "full disk")]
    for error in cases:
        message = writable(str(error))
        assert "\\ud800" in message or "\\xff" in message, message
    assert errors.describe_name(os.fsencode(NOT_UTF8)) == "kvgraph_\\xff.safetensors"
    assert errors.printable("plain ascii and ünïcode") == "plain ascii and ünïcode"


def test_the_packs_log_lines_escape_what_they_echo(comfy_env):
    """A loaded file's path with non-UTF-8 bytes in the pack's log: before, the strict UTF-8 stream raised inside
    logging ("--- Logging error ---"); now the line is written with the bytes escaped."""
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    handler = logging.StreamHandler(stream)
    handler.handleError = lambda record: pytest.fail("the log line could not be written")
    logger = logging.getLogger("kvgraph")
    logger.addHandler(handler)
    try:
        logger.warning("KV-Graph: loaded vae from %s", f"/models/vae/{NOT_UTF8}")
    finally:
        logger.removeHandler(handler)
    assert stream.buffer.getvalue().decode() == "KV-Graph: loaded vae from /models/vae/kvgraph_\\xff.safetensors\n"


@pytest.mark.parametrize("node_id", ["KVGraphLoadTransformer", "KVGraphLoadTextEncoder", "KVGraphLoadVAE",
                                     "KVGraphLoadDiffusers", "KVGraphLoadLoRA"])
def test_a_linked_name_with_a_lone_surrogate_is_refused_in_words_the_log_can_write(comfy_env, transformer, node_id):
    """Before: "x\\ud800.safetensors" linked into a loader (a String through a Switch node: ComfyUI's list check only
    sees widget values) came back raw in the error, ComfyUI could not log it and its prompt worker died."""
    errors = from_pack(comfy_env, "errors")
    with pytest.raises(errors.KVGraphError) as info:
        if node_id == "KVGraphLoadLoRA":
            load_lora(comfy_env, transformer, SURROGATE)
        else:
            run(comfy_env, node_id, **loader_inputs(node_id, SURROGATE))
    message = writable(str(info.value))
    assert "x\\ud800.safetensors" in message and "not found" in message


@pytest.mark.parametrize("node_id", ["KVGraphLoadTransformer", "KVGraphLoadTextEncoder", "KVGraphLoadVAE"])
def test_a_file_with_a_non_utf8_name_loads_like_its_copy(comfy_env, own_folders, node_id):
    """Before: `SafetensorError: Path ... is not valid UTF-8` (the safetensors library takes only UTF-8 paths). A
    valid file whose name holds another byte loads, with the same weights as the file it was copied from."""
    kind, name = FOLDERS[node_id]
    folder = own_folders(kind)
    shutil.copyfile(comfy_env.models / kind / name, folder / name)
    shutil.copyfile(comfy_env.models / kind / name, os.path.join(os.fsencode(folder), os.fsencode(NOT_UTF8)))
    assert NOT_UTF8 in comfy_env.fake.modules["folder_paths"].get_filename_list(kind)  # offered in the list
    inputs = loader_inputs(node_id, name)
    key = next(k for k in inputs if k.endswith("_name"))
    plain = run(comfy_env, node_id, **inputs)[0]
    odd = run(comfy_env, node_id, **dict(inputs, **{key: NOT_UTF8}))[0]
    assert odd.source == os.path.join(str(folder), NOT_UTF8) and odd is not plain
    plain_state, odd_state = plain.module.state_dict(), odd.module.state_dict()
    assert plain_state.keys() == odd_state.keys()
    assert all(torch.equal(plain_state[k], odd_state[k]) for k in plain_state)  # exact: the same bytes were read


def test_a_lora_with_a_non_utf8_name_loads(comfy_env, transformer, own_folders):
    from graph_runtime.lora.tiny import write_tiny_lora

    path = write_tiny_lora(own_folders("loras") / LORA, seed=3)
    os.rename(path, os.path.join(os.fsencode(path.parent), os.fsencode(NOT_UTF8)))
    chained = load_lora(comfy_env, transformer, NOT_UTF8)
    assert len(chained.loras) == 1 and chained.loras[0].strength == 1.0


def test_a_damaged_file_with_a_non_utf8_name_is_refused_in_words_the_log_can_write(comfy_env, own_folders):
    folder = own_folders("vae")
    with open(os.path.join(os.fsencode(folder), os.fsencode(NOT_UTF8)), "wb") as f:
        f.write(b"\x00" * 64)
    with pytest.raises(from_pack(comfy_env, "errors").CheckpointError) as info:
        run(comfy_env, "KVGraphLoadVAE", vae_name=NOT_UTF8, dtype="fp32")
    message = writable(str(info.value))
    assert "kvgraph_\\xff.safetensors" in message and "not a safetensors file" in message


# -- damaged headers -----------------------------------------------------------------------------------------------


def rewrite_header(source: Path, target, change) -> None:
    """A copy of `source` whose header went through `change` (a function of the parsed header, the tensor data
    unchanged)."""
    data = Path(source).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    change(header)
    raw = json.dumps(header).encode()
    Path(os.fsdecode(target)).parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def first_tensor(header: dict) -> dict:
    """The first tensor entry with a shape of at least one side (a LoRA's alpha is a scalar)."""
    return header[next(k for k in sorted(header) if k != "__metadata__" and header[k]["shape"])]


def float_shape(header):
    first_tensor(header)["shape"] = [float(s) for s in first_tensor(header)["shape"]]


def string_offsets(header):
    first_tensor(header)["data_offsets"] = [str(o) for o in first_tensor(header)["data_offsets"]]


@pytest.mark.parametrize("change, words", [(float_shape, "whose shape"), (string_offsets, "whose data_offsets")])
@pytest.mark.parametrize("node_id", ["KVGraphLoadTransformer", "KVGraphLoadTextEncoder", "KVGraphLoadVAE",
                                     "KVGraphLoadDiffusers", "KVGraphLoadLoRA"])
def test_a_header_with_a_float_shape_or_string_offsets_is_refused_by_name(comfy_env, transformer, own_folders,
                                                                          node_id, change, words):
    """Before: the checked reader took 2.0 and "0" as numbers, and the safetensors library then failed with
    `SafetensorError: invalid JSON in header` naming nothing. Now every loader refuses the file, naming it, the
    tensor and the entry."""
    name = "kvgraph_damaged.safetensors"
    if node_id == "KVGraphLoadLoRA":
        from graph_runtime.lora.tiny import write_tiny_lora

        clean = write_tiny_lora(own_folders("tmp") / LORA, seed=4)
        path = own_folders("loras") / name
        rewrite_header(clean, path, change)
        run_it = lambda: load_lora(comfy_env, transformer, name)  # noqa: E731
    elif node_id == "KVGraphLoadDiffusers":
        pipeline = own_folders("diffusers") / "damaged"
        shutil.copytree(comfy_env.models / "diffusers" / TINY_PIPELINE, pipeline)
        path = pipeline / "transformer" / "diffusion_pytorch_model.safetensors"
        rewrite_header(path, path, change)
        run_it = lambda: run(comfy_env, node_id, **loader_inputs(node_id, "damaged"))  # noqa: E731
    else:
        kind, original = FOLDERS[node_id]
        path = own_folders(kind) / name
        rewrite_header(comfy_env.models / kind / original, path, change)
        run_it = lambda: run(comfy_env, node_id, **loader_inputs(node_id, name))  # noqa: E731
    with pytest.raises(from_pack(comfy_env, "errors").CheckpointError) as info:
        run_it()
    message = str(info.value)
    assert message.startswith(str(path)) and words in message and "a damaged file" in message


# -- wrong types ---------------------------------------------------------------------------------------------------


def sampler_inputs(model, positive, latent) -> dict:
    return dict(model=model, positive=positive, latent=latent, seed=0, steps=2, cfg=1.0, sigma_preset="auto",
                denoise=1.0, decode_mode="auto", compile="off")


@pytest.mark.parametrize("wrong", ["a text", "the MODEL"])
def test_the_sampler_names_a_wrong_model(comfy_env, text_encoder, wrong):
    """Before: `AttributeError: 'str' object has no attribute 'info'` (a STRING through a Switch node) or
    `'ModelPatcher' object has no attribute ...` (the loader's MODEL output instead of its transformer)."""
    positive, _, latent = encode(comfy_env, text_encoder)
    model = run(comfy_env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32")[1]
    with pytest.raises(from_pack(comfy_env, "errors").InputError) as info:
        run(comfy_env, "KVGraphSampler", **sampler_inputs("a text" if wrong == "a text" else model, positive, latent))
    message = str(info.value)
    assert message.startswith("model='a STRING'" if wrong == "a text" else "model='a MODEL (")
    assert "expected a KV-Graph transformer: the 'transformer' output of a KV-Graph loader" in message


@pytest.mark.parametrize("node_id, inputs, prefix, expected", [
    ("KVGraphTextEncode", {"text_encoder": "a text"}, "text_encoder='a STRING'", "a KV-Graph text encoder"),
    ("KVGraphTextEncode", {"vae": "a text"}, "vae='a STRING'", "a KV-Graph VAE"),
    ("KVGraphTextEncode", {"images": {"image1": "a text"}}, "images.image1='a STRING'", "an IMAGE [batch"),
    ("KVGraphTextEncode", {"images": {"image1": torch.rand(1, 32, 32)}}, "images.image1='a tensor of shape [1, 32, "
                                                                         "32]'", "an IMAGE [batch"),
    ("KVGraphVAEDecode", {"vae": "a text"}, "vae='a STRING'", "a KV-Graph VAE"),
    ("KVGraphVAEDecode", {"latent": "a text"}, "latent='a STRING'", "a LATENT dict"),
    ("KVGraphVAEEncode", {"vae": "a text"}, "vae='a STRING'", "a KV-Graph VAE"),
    ("KVGraphVAEEncode", {"image": 7}, "image='an INT'", "an IMAGE [batch"),
    ("KVGraphSaveImage", {"images": "a text"}, "images='a STRING'", "an IMAGE [batch"),
    ("KVGraphLoadLoRA", {"model": "a text"}, "model='a STRING'", "a KV-Graph MODEL"),
])
def test_a_wrong_type_at_an_input_is_refused_naming_it(comfy_env, text_encoder, good_vae, transformer, node_id, inputs,
                                                       prefix, expected):
    """What a Switch-like node (any output type) or the API can hand any input: refused naming the input, what
    arrived and what was expected, not an AttributeError from inside."""
    good = {
        "KVGraphTextEncode": dict(text_encoder=text_encoder, prompt="a cube", negative_prompt="", width=64, height=48,
                                  size_from_reference=True, reference_resolution=64, vae=good_vae),
        "KVGraphVAEDecode": dict(vae=good_vae, latent={"samples": torch.zeros(1, 64, 3, 4)}),
        "KVGraphVAEEncode": dict(vae=good_vae, image=torch.rand(1, 32, 32, 3)),
        "KVGraphSaveImage": dict(images=torch.rand(1, 32, 32, 3), filename_prefix="kvgraph_hostile"),
        "KVGraphLoadLoRA": dict(model=transformer, lora_name="missing.safetensors", strength=1.0),
    }[node_id]
    with pytest.raises(from_pack(comfy_env, "errors").InputError) as info:
        run(comfy_env, node_id, **dict(good, **inputs))
    assert str(info.value).startswith(prefix) and f"expected {expected}" in str(info.value)


# -- reference sockets ---------------------------------------------------------------------------------------------

LIMIT = "at most 10 reference images, at sockets image1 to image10"


@pytest.mark.parametrize("socket", ["image0", "image11", "imagefoo"])
def test_an_unknown_reference_socket_is_refused_when_queued_and_when_run(comfy_env, text_encoder, good_vae, socket):
    """Before: `TypeError: execute() got an unexpected keyword argument 'images.image11'`, after the loaders ran.
    ComfyUI hands a socket it does not know over under its prompt name; the encode node's queue-time check refuses
    it with the limit, and so does the node itself (ComfyUI 0.8 groups them as `images`)."""
    validate = comfy_env.nodes["KVGraphTextEncode"].validate_inputs
    answer = validate(width=64, height=48, **{f"images.{socket}": None, "images.image1": None})
    assert isinstance(answer, str) and answer.startswith(f"images=['{socket}'] is invalid") and LIMIT in answer
    assert validate(width=64, height=48, images={socket: None}) == answer
    assert validate(width=64, height=48, **{f"images.image{i}": None for i in range(1, 11)}) is True

    image = torch.rand(1, 32, 32, 3)
    for inputs in ({f"images.{socket}": image}, {"images": {socket: image}}):
        with pytest.raises(from_pack(comfy_env, "errors").InputError) as info:
            encode(comfy_env, text_encoder, vae=good_vae, **inputs)
        assert str(info.value) == answer


def test_conditioning_with_more_than_ten_references_is_refused_by_the_sampler(comfy_env, text_encoder, transformer):
    """Core's Reference Latent node chained eleven times: the sampler refuses the conditioning with the limit."""
    positive, _, latent = encode(comfy_env, text_encoder)
    entry = [positive[0][0], dict(positive[0][1], reference_latents=[torch.zeros(1, 64, 2, 2)] * 11)]
    with pytest.raises(from_pack(comfy_env, "errors").InputError) as info:
        run(comfy_env, "KVGraphSampler", **sampler_inputs(transformer, [entry], latent))
    assert str(info.value).startswith("positive reference_latents='11 reference images' is invalid: expected at "
                                      "most 10 reference images")


# -- the release route ---------------------------------------------------------------------------------------------

HOST = "127.0.0.1:8188"


@pytest.mark.parametrize("origin", ["null", "http://evil.example", "http://127.0.0.1:9999", "file://", "x"])
def test_the_release_route_refuses_other_web_pages(comfy_env, origin):
    """Before: `Origin: null` (a sandboxed frame, a file:// page) and other origins were answered: any page the user
    visited could release the user's models. Refused with 403, saying why; nothing is released."""
    code, payload = post_release(comfy_env, b'{"models": true}', {"Origin": origin, "Host": HOST})
    assert code == 403 and payload["error"].startswith("refused: this request comes from another web page")
    assert "--enable-cors-header" in payload["error"]


@pytest.mark.parametrize("headers", [{}, {"Host": HOST}, {"Origin": f"http://{HOST}", "Host": HOST},
                                     {"Origin": "https://comfy.example", "Host": "comfy.example"},
                                     {"Origin": "https://comfy.example", "Host": HOST,
                                      "X-Forwarded-Host": "comfy.example"}])
def test_the_release_route_answers_its_own_page_and_clients_without_an_origin(comfy_env, headers):
    code, payload = post_release(comfy_env, b"{}", headers)
    assert code == 200 and "graphs" in payload


def test_an_origin_comfyui_was_told_to_allow_is_answered(comfy_env, monkeypatch):
    args = comfy_env.fake.modules["comfy.cli_args"].args
    monkeypatch.setattr(args, "enable_cors_header", "http://studio.example", raising=False)
    assert post_release(comfy_env, b"{}", {"Origin": "http://studio.example", "Host": HOST})[0] == 200
    assert post_release(comfy_env, b"{}", {"Origin": "http://evil.example", "Host": HOST})[0] == 403
    assert post_release(comfy_env, b"{}", {"Origin": "null", "Host": HOST})[0] == 403


# -- what docs/robustness.md promises ----------------------------------------------------------------------------


def test_the_robustness_page_quotes_the_refusals_as_the_code_words_them(comfy_env, text_encoder, tmp_path):
    """docs/robustness.md quotes each new refusal; each quote is what the code says (whitespace aside)."""
    doc = " ".join((Path(__file__).parents[1] / "docs" / "robustness.md").read_text().split())
    errors, routes = from_pack(comfy_env, "errors"), comfy_env.pack.nodes.comfyui.server_routes

    def says(text: str) -> None:
        assert " ".join(text.split()) in doc, text

    says(routes.CROSS_ORIGIN.format(origin="'null'"))
    says(comfy_env.nodes["KVGraphTextEncode"].validate_inputs(**{"images.image11": None}))
    positive, _, latent = encode(comfy_env, text_encoder)
    entry = [positive[0][0], dict(positive[0][1], reference_latents=[torch.zeros(1, 64, 2, 2)] * 11)]
    for model, conditioning in (("a text", positive), (None, [entry])):
        with pytest.raises(errors.InputError) as info:
            model = model or run(comfy_env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32")[0]
            run(comfy_env, "KVGraphSampler", **sampler_inputs(model, conditioning, latent))
        says(str(info.value))

    from safetensors.torch import save_file

    clean = tmp_path / "clean.safetensors"
    save_file({"x.weight": torch.zeros(4, 8, dtype=torch.bfloat16)}, str(clean))
    for change in (float_shape, string_offsets):
        rewrite_header(clean, tmp_path / "damaged.safetensors", change)
        with pytest.raises(errors.CheckpointError) as info:
            from_pack(comfy_env, "safetensors_file").read_header(tmp_path / "damaged.safetensors")
        says(str(info.value).split(": ", 1)[1].split(" Expected")[0])

    # The refusal where the system has no /proc/self/fd or /dev/fd folder.
    safetensors_file = from_pack(comfy_env, "safetensors_file")
    odd = tmp_path / NOT_UTF8
    shutil.copyfile(clean, odd)
    real_isdir = os.path.isdir
    try:
        os.path.isdir = lambda path: False if path in ("/proc/self/fd", "/dev/fd") else real_isdir(path)
        with pytest.raises(errors.CheckpointError) as info:
            list(safetensors_file.iter_tensors([odd]))
    finally:
        os.path.isdir = real_isdir
    says(str(info.value).split(" Expected ")[1])
