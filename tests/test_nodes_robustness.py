"""Bad input at the node level (CPU, the fake ComfyUI): model names that would leave their model folder, release
bodies the JSON parser chokes on, sizes off the 16 px grid at queue time; and the cache nodes' pass-through, their
text on the node, and the web routes for a pack folder whose name needs URL quoting.

tests/e2e/test_comfyui_robustness.py checks the same against a real ComfyUI, with the next good prompt after each.
"""

import importlib
import asyncio
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake import PACK_ROOT  # noqa: E402
from comfy_fake.fixtures import close_env, comfy_env, make_env  # noqa: E402,F401

T_FILE, VAE_FILE = "qwen_image_2.1_bf16.safetensors", "qwen_image_2.1_vae_bf16.safetensors"
TINY_PIPELINE = "qwen-image-2.1-tiny"
DIFFUSERS_INPUTS = {"dtype": "fp32", "text_encoder_placement": "cpu"}


def run(env, node_id, **inputs):
    return env.nodes[node_id].execute(**inputs).args


def from_pack(env, module: str):
    """A module of the pack as loaded in `env` (its classes are not the test process's graph_runtime ones)."""
    return importlib.import_module(f"{env.pack.__name__}.graph_runtime.{module}")


def refusal(env, node_id, **inputs) -> str:
    with pytest.raises(from_pack(env, "loading.paths").OutsideModelFolder) as info:
        run(env, node_id, **inputs)
    assert isinstance(info.value, from_pack(env, "errors").InputError)
    return str(info.value)


# -- model paths ---------------------------------------------------------------------------------------------------


def test_diffusers_folder_outside_models_diffusers_is_refused_alike(comfy_env, tmp_path):
    models = comfy_env.models
    pipeline = models / "diffusers" / TINY_PIPELINE  # a real, loadable pipeline, named by a path that escapes
    names = [str(pipeline), f"../diffusers/{TINY_PIPELINE}", "../../", str(tmp_path / "missing"), "../../missing"]
    messages = {refusal(comfy_env, "KVGraphLoadDiffusers", folder=name, **DIFFUSERS_INPUTS) for name in names}
    assert len(messages) == 1, messages  # one message whether the outside path exists or not
    message, = messages
    assert message.startswith("folder:") and "models/diffusers" in message
    assert str(models) not in message and TINY_PIPELINE not in message and "missing" not in message


@pytest.mark.parametrize("node_id, input_name, name", [
    ("KVGraphLoadTransformer", "transformer_name", f"../vae/{VAE_FILE}"),
    ("KVGraphLoadTransformer", "transformer_name", "{models}/diffusion_models/" + T_FILE),
    ("KVGraphLoadVAE", "vae_name", f"sub/../../vae/{VAE_FILE}"),
    ("KVGraphLoadTextEncoder", "text_encoder_name", "/etc/passwd"),
])
def test_single_file_outside_its_folder_is_refused(comfy_env, node_id, input_name, name):
    inputs = {input_name: name.format(models=comfy_env.models), "dtype": "fp32"}
    if node_id == "KVGraphLoadTextEncoder":
        inputs["text_encoder_placement"] = "cpu"
    message = refusal(comfy_env, node_id, **inputs)
    assert message.startswith(f"{input_name}:") and str(comfy_env.models) not in message
    # The loader's change check refuses nothing loudly: it only decides whether to run the node again.
    fingerprint = comfy_env.nodes[node_id].fingerprint_inputs(**inputs)
    assert fingerprint[0] == inputs[input_name]


def test_a_symlink_inside_models_diffusers_is_followed(comfy_env, tmp_path, monkeypatch):
    """As in ComfyUI: a pipeline folder linked into models/diffusers from elsewhere loads; after the refusals above,
    loading works as before."""
    diffusers = tmp_path / "diffusers"
    diffusers.mkdir()
    (diffusers / "linked").symlink_to(comfy_env.models / "diffusers" / TINY_PIPELINE, target_is_directory=True)
    folder_paths = comfy_env.fake.modules["folder_paths"]
    monkeypatch.setattr(folder_paths, "get_folder_paths",
                        lambda folder: [str(diffusers)] if folder == "diffusers" else [str(comfy_env.models / folder)])
    transformer, text_encoder, vae, _ = run(comfy_env, "KVGraphLoadDiffusers", folder="linked", **DIFFUSERS_INPUTS)
    assert transformer.source == str(diffusers / "linked")
    assert type(transformer.module).__name__ == "QwenImage21Transformer2DModel" and vae.module.config.z_dim == 64
    message = refusal(comfy_env, "KVGraphLoadDiffusers", folder="linked/../linked", **DIFFUSERS_INPUTS)
    assert message.startswith("folder:")


def test_an_unknown_name_inside_the_folder_still_says_not_found(comfy_env):
    with pytest.raises(Exception) as info:
        run(comfy_env, "KVGraphLoadVAE", vae_name="qwen_image_2.1_vae_missing.safetensors", dtype="fp32")
    assert isinstance(info.value, from_pack(comfy_env, "errors").CheckpointError)
    assert "qwen_image_2.1_vae_missing.safetensors" in str(info.value) and "not found" in str(info.value)


# -- POST /kvgraph/release body -----------------------------------------------------------------------------------


class Request:
    def __init__(self, body: bytes | None, headers: dict | None = None):
        self.body, self.can_read_body = body, body is not None
        self.headers = headers or {}  # no Origin: a client such as curl

    async def read(self):
        return self.body


def post_release(env, body: bytes | None, headers: dict | None = None):
    response = asyncio.run(env.fake.routes[("POST", "/kvgraph/release")](Request(body, headers)))
    if hasattr(response, "data"):  # the fake aiohttp
        return response.status, response.data
    return response.status, json.loads(response.text)


@pytest.mark.parametrize("body, fragment", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[1]", "not a JSON object"),
    (b'{"models": "yes"}', "'models' must be true or false"),
])
def test_release_route_answers_400_for_a_bad_body(comfy_env, body, fragment):
    code, payload = post_release(comfy_env, body)
    assert code == 400 and fragment in payload["error"]
    assert set(payload) == {"error"}
    assert comfy_env.pack.nodes.comfyui.server_routes.parse_release_body(body) == (400, payload)  # the parser alone


@pytest.mark.parametrize("body", [None, b"", b"  ", b"null", b"{}", b'{"models": false}'])
def test_release_route_accepts_an_empty_or_plain_body(comfy_env, body):
    code, payload = post_release(comfy_env, body)
    assert code == 200 and set(payload) == {"graphs", "models"} and payload["models"] == []


# -- queue-time size check ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("inputs, name, fragment", [
    ({"width": 100, "height": 96}, "width", "width=100 is invalid"),
    ({"width": 128, "height": 8}, "height", "height=8 is invalid"),
    ({"width": 0, "height": 96}, "width", "width=0 is invalid"),
    ({"width": 128, "height": 8208}, "height", "height=8208 is invalid"),
])
def test_encode_validates_the_size_when_queued(comfy_env, inputs, name, fragment):
    """Every refusal states the node's own range, 16 to 8192 (before: "16 to 32768", the runtime's)."""
    result = comfy_env.nodes["KVGraphTextEncode"].validate_inputs(**inputs)
    assert isinstance(result, str) and fragment in result and result.startswith(f"{name}=")
    assert "from 16 to 8192" in result and "32768" not in result


def test_encode_accepts_good_and_linked_sizes_when_queued(comfy_env):
    validate = comfy_env.nodes["KVGraphTextEncode"].validate_inputs
    assert validate(width=128, height=96) is True
    assert validate(width=8192, height=16) is True
    assert validate() is True  # both linked from other nodes: checked when the node runs


# -- issue 29: the decode's output, sizes and prompts the nodes refuse by name ------------------------------------


OFFLOAD = "gpu while encoding, then offload"


@pytest.fixture(scope="module")
def text_encoder(comfy_env):
    handle, = run(comfy_env, "KVGraphLoadTextEncoder", text_encoder_name="qwen3vl_8b_bf16.safetensors", dtype="fp32",
                  text_encoder_placement=OFFLOAD)
    return handle


def encode(env, text_encoder, **overrides):
    inputs = dict(text_encoder=text_encoder, prompt="a red cube", negative_prompt="", width=64, height=48,
                  size_from_reference=True, reference_resolution=64)
    return run(env, "KVGraphTextEncode", **dict(inputs, **overrides))


def damaged_vae(env, tmp_path, monkeypatch, name, damage):
    """A VAE handle loaded by the node from a copy of the tiny VAE file whose tensors went through `damage`, in a
    models/vae folder of its own (the shared one stays as other tests list it)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "vae"
    folder.mkdir(exist_ok=True)
    tensors = load_file(env.models / "vae" / VAE_FILE)
    save_file({k: damage(v) for k, v in tensors.items()}, str(folder / name))
    folder_paths = env.fake.modules["folder_paths"]
    monkeypatch.setattr(folder_paths, "get_folder_paths",
                        lambda kind: [str(folder)] if kind == "vae" else [str(env.models / kind)])
    vae, = run(env, "KVGraphLoadVAE", vae_name=name, dtype="fp32")
    return vae


@pytest.fixture(scope="module")
def good_vae(comfy_env):
    vae, = run(comfy_env, "KVGraphLoadVAE", vae_name=VAE_FILE, dtype="fp32")
    return vae


LATENT = {"samples": torch.randn(1, 64, 3, 4, generator=torch.Generator().manual_seed(0))}


def test_vae_decode_refuses_a_nan_latent_naming_its_origin(comfy_env, good_vae):
    """Before: a latent holding NaN/inf (core Load Latent) decoded to an all-zero image and the prompt succeeded."""
    first, _ = run(comfy_env, "KVGraphVAEDecode", vae=good_vae, latent=LATENT)
    for bad in (float("nan"), float("inf")):
        samples = LATENT["samples"].clone()
        samples[0, 3, 1, 2] = bad
        with pytest.raises(from_pack(comfy_env, "errors").InputError,
                           match="latent='a tensor with NaN or infinite values' is invalid: .*Load Latent"):
            run(comfy_env, "KVGraphVAEDecode", vae=good_vae, latent={"samples": samples})
    again, _ = run(comfy_env, "KVGraphVAEDecode", vae=good_vae, latent=LATENT)
    assert torch.equal(again, first)


@pytest.mark.parametrize("name, damage, error, words", [
    ("kvgraph_nan_vae.safetensors", lambda t: torch.full_like(t, float("nan")), "NonFiniteError", "holds NaN"),
    ("kvgraph_zero_vae.safetensors", torch.zeros_like, "FlatOutputError", "is one flat colour"),
])
def test_vae_decode_with_damaged_vae_weights_fails_naming_the_vae_file(comfy_env, good_vae, tmp_path, monkeypatch,
                                                                       name, damage, error, words):
    """Before: NaN weights gave an all-zero image and all-zero weights a flat grey one, both "success". The check
    is the command line's (graph_runtime.vae_decode.check_decoded), and names the file."""
    first, _ = run(comfy_env, "KVGraphVAEDecode", vae=good_vae, latent=LATENT)
    vae = damaged_vae(comfy_env, tmp_path, monkeypatch, name, damage)
    with pytest.raises(getattr(from_pack(comfy_env, "errors"), error)) as info:
        run(comfy_env, "KVGraphVAEDecode", vae=vae, latent=LATENT)
    assert words in str(info.value) and f"VAE's weights ({tmp_path / 'vae' / name})" in str(info.value)
    again, _ = run(comfy_env, "KVGraphVAEDecode", vae=good_vae, latent=LATENT)
    assert torch.equal(again, first)


@pytest.mark.parametrize("shape", [(1, 64, 0, 4), (1, 64, 4, 0), (0, 64, 4, 4)])
def test_vae_decode_refuses_an_empty_latent_by_name(comfy_env, good_vae, shape):
    """Before: a [1, 64, 0, 4] latent failed inside a convolution ("Calculated padded input size ...")."""
    with pytest.raises(from_pack(comfy_env, "errors").InputError,
                       match=rf"latent='samples of shape \[{', '.join(map(str, shape))}\]' is invalid"):
        run(comfy_env, "KVGraphVAEDecode", vae=good_vae, latent={"samples": torch.zeros(shape)})


def test_encode_refuses_a_linked_size_with_the_nodes_own_limit(comfy_env, text_encoder):
    """A size linked from another node is checked when the node runs: 16384 was accepted there (the runtime's limit
    is 32768) and the message said "16 to 32768"; the node's range is 16 to 8192."""
    with pytest.raises(from_pack(comfy_env, "errors").InputError,
                       match=r"width=16384 is invalid: expected a multiple of 16 pixels from 16 to 8192"):
        encode(comfy_env, text_encoder, width=16384)


def test_sampler_names_a_size_too_large_for_the_schedule_before_anything_loads(comfy_env, text_encoder,
                                                                               monkeypatch):
    """Before: a 16384x16384 latent from core nodes was refused as `sigmas=[1.0, ...] is invalid`. It is refused
    naming its size, before the memory budget is worked out and before the transformer is loaded."""
    transformer = run(comfy_env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32")[0]
    positive, _, _ = encode(comfy_env, text_encoder)
    budget = comfy_env.pack.nodes.comfyui.memory
    monkeypatch.setattr(budget, "check_request", lambda *a: pytest.fail("the budget was worked out first"))
    with pytest.raises(from_pack(comfy_env, "errors").InputError,
                       match=r"^image size='16384x16384 px \(1048576 latent tokens\)' is invalid: expected at most"):
        run(comfy_env, "KVGraphSampler", model=transformer, positive=positive,
            latent={"samples": torch.zeros(1, 64, 1024, 1024)}, seed=0, steps=4, cfg=1.0, sigma_preset="dynamic",
            denoise=1.0, decode_mode="auto", compile="off")


def test_encode_names_the_negative_prompt_when_it_is_too_long(comfy_env, text_encoder):
    """Before: a too-long negative prompt was reported as `prompt=`. Both texts are checked before the text encoder
    is loaded onto its device."""
    with pytest.raises(from_pack(comfy_env, "errors").InputError, match=r"^negative_prompt='\d+ characters"):
        encode(comfy_env, text_encoder, negative_prompt="blurry " * 10_000)


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_encode_refuses_a_lone_surrogate_by_name(comfy_env, text_encoder, field):
    with pytest.raises(from_pack(comfy_env, "errors").InputError,
                       match=rf"^{field}='text with a lone surrogate U\+DC00 at character 1'"):
        encode(comfy_env, text_encoder, **{field: "a\udc00"})


def test_encode_reads_control_token_text_in_a_prompt_as_text(comfy_env, text_encoder):
    """Before: transformers' ValueError ("Found 1 <|image_pad|> tokens in the text but no images were passed")."""
    positive, negative, latent = encode(comfy_env, text_encoder, prompt="a <|image_pad|> and a <|video_pad|>",
                                        negative_prompt="<|im_end|>")
    plain, _, _ = encode(comfy_env, text_encoder, prompt="a cat")
    assert positive[0][0].shape[1] > plain[0][0].shape[1]  # the control-token text became several text tokens
    assert torch.isfinite(positive[0][0]).all() and torch.isfinite(negative[0][0]).all()


def test_a_very_long_model_name_is_not_echoed_whole(comfy_env):
    """Before: a 5,000-character model name came back whole in the error."""
    name = "x" * 4990 + ".safetensors"
    with pytest.raises(from_pack(comfy_env, "errors").CheckpointError) as info:
        run(comfy_env, "KVGraphLoadVAE", vae_name=name, dtype="fp32")
    message = str(info.value)
    assert "was not found" in message and "(5002 characters)" in message and len(message) < 600


def test_the_seed_tooltip_states_the_range_that_reaches_the_noise(comfy_env):
    """Seeds above 2**32 repeat lower ones (torch's CPU generator keeps 32 bits, as in diffusers and core
    ComfyUI); the sampler says so where the seed is set (tests/test_robustness_runtime.py shows the behaviour)."""
    schema = comfy_env.nodes["KVGraphSampler"].define_schema()
    seed = next(i for i in schema.inputs if i.id == "seed")
    assert "2^32" in seed.tooltip and "low 32 bits" in seed.tooltip


# -- cache nodes: pass-through and the report ---------------------------------------------------------------------


@pytest.mark.parametrize("node_id, inputs", [("KVGraphCacheStatus", {}),
                                             ("KVGraphReleaseCaches", {"release_models": False})])
def test_cache_nodes_pass_their_input_on_and_show_their_report(comfy_env, node_id, inputs):
    """The pass-through hands on the very object it got; the report comes out as the STRING output and as the node's
    ui text (what the web extension shows on the node, and /history keeps), inside a running prompt or not."""
    latent = {"samples": torch.zeros(1, 64, 6, 8)}
    comfy_env.fake.set_context("prompt-7", "12")
    try:
        output = comfy_env.nodes[node_id].execute(passthrough=latent, **inputs)
    finally:
        comfy_env.fake.context = None
    report, passed = output.args
    assert passed is latent  # the very object: nothing is copied or changed
    assert output.ui == {"text": [report]} and report
    output = comfy_env.nodes[node_id].execute(**inputs)
    assert output.args[1] is None and output.ui == {"text": [output.args[0]]}


# -- web routes for a pack folder whose name needs URL quoting ------------------------------------------------------


def pack_regex(route: str) -> str:
    return re.fullmatch(r"/[a-z_]+/\{pack:(.+)\}/\{path:\.\+\}", route).group(1)


@pytest.mark.parametrize("folder, decoded", [
    ("kv graph", "kv graph"), ("ComfyUI KV-Graph (v1)", "ComfyUI KV-Graph (v1)"), ("kv{1,2}", "kv{1,2}"),
    ("grafik-über", "grafik-über"), ("50%", "50%25"),  # aiohttp leaves %25 undecoded in the path it matches
])
def test_route_for_a_quoted_folder_name_matches_only_that_name(comfy_env, folder, decoded):
    pack_files = comfy_env.pack.nodes.comfyui.server_routes
    assert pack_files.needs_own_routes(folder)
    route = pack_files.route_path("/extensions", folder)
    regex = pack_regex(route)
    assert "{" not in regex and "}" not in regex  # aiohttp's pattern syntax allows no braces inside a variable
    assert re.fullmatch(regex, decoded)
    assert not re.fullmatch(regex, decoded + "x") and not re.fullmatch(regex, "x" + decoded)


def test_plain_folder_names_need_no_routes(comfy_env):
    pack_files = comfy_env.pack.nodes.comfyui.server_routes
    for folder in ("comfyui-kv-graph", "kv_graph_e2e", "KVGraph.v1"):
        assert not pack_files.needs_own_routes(folder)
        assert pack_files.register_pack_files(None, f"/custom_nodes/{folder}") == []


def test_pack_under_a_folder_with_a_space_registers_its_file_routes(tmp_path):
    link = tmp_path / "kv graph"
    link.symlink_to(PACK_ROOT, target_is_directory=True)
    env = make_env(pack_root=link)
    try:
        added = {path for method, path in env.fake.routes if method == "GET" and "{pack:" in path}
        assert {p.split("/{")[0] for p in added} == {"/extensions", "/workflow_templates"}
        for path in added:
            assert re.fullmatch(pack_regex(path), "kv graph")
    finally:
        close_env(env)


@pytest.mark.parametrize("device, started", [("cpu", []), ("cuda:0", [torch.device("cuda:0")])])
def test_the_kernel_preload_starts_only_for_a_cuda_compute_device(comfy_env, monkeypatch, device, started):
    """At start-up and on a transformer load the pack starts Triton's and the CUDA libraries' set-up for the device
    ComfyUI computes on, and never touches a GPU when that is the CPU (`--cpu`)."""
    loaders = comfy_env.pack.nodes.loaders
    calls = []
    monkeypatch.setattr(loaders, "start_preload", calls.append)
    monkeypatch.setattr(comfy_env.fake, "device", torch.device(device))
    loaders.start_kernel_preload()
    assert calls == started


# -- a release of models while a prompt runs -------------------------------------------------------------------------


def test_a_release_mid_prompt_waits_for_the_models_the_prompt_is_using(monkeypatch):
    """POST /kvgraph/release {"models": true} while the text encoder encodes, the VAE decodes or the transformer
    samples drops each from the cache but leaves its weights where they are until that use ends (then they leave);
    the node's output equals the one a run without the release gives."""
    env = make_env()
    try:
        status = env.pack.nodes.comfyui.model_cache
        images = importlib.import_module(f"{env.pack.__name__}.graph_runtime.encoding.images")
        text_encoder, = run(env, "KVGraphLoadTextEncoder", text_encoder_name="qwen3vl_8b_bf16.safetensors",
                            dtype="fp32", text_encoder_placement="always gpu")
        vae, = run(env, "KVGraphLoadVAE", vae_name=VAE_FILE, dtype="fp32")
        transformer = run(env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32")[0]
        offloads, released = [], {}
        for handle in (text_encoder, vae, transformer):
            monkeypatch.setattr(handle, "offload", lambda kind=handle.kind: offloads.append(kind))

        def release_during(kind, call):
            def wrapped(*args, **kwargs):
                if kind not in released:
                    result = status.release(models=True)
                    released[kind] = ({m["kind"]: m["unloaded"] for m in result["models"]}, list(offloads))
                return call(*args, **kwargs)
            return wrapped

        encode_inputs = dict(text_encoder=text_encoder, prompt="a red cube", negative_prompt="", width=128,
                             height=96, size_from_reference=True, reference_resolution=128)
        expected = run(env, "KVGraphTextEncode", **encode_inputs)[0][0][0]
        encoder = text_encoder.encoder
        monkeypatch.setattr(encoder, "encode", release_during("text_encoder", encoder.encode))
        positive, _, latent = run(env, "KVGraphTextEncode", **encode_inputs)
        assert released["text_encoder"] == ({"text_encoder": False, "vae": True, "transformer": True}, ["vae",
                                                                                                       "transformer"])
        assert offloads == ["vae", "transformer", "text_encoder"]  # the text encoder left when its encode ended
        assert torch.equal(positive[0][0], expected)

        samples = {"samples": torch.randn(2, 64, 6, 8, generator=torch.Generator().manual_seed(0))}
        first, _ = run(env, "KVGraphVAEDecode", vae=vae, latent=samples)
        offloads.clear()
        monkeypatch.setattr(images, "vae_decode", release_during("vae", images.vae_decode))
        decoded, _ = run(env, "KVGraphVAEDecode", vae=vae, latent=samples)
        assert released["vae"] == ({"vae": False}, []) and offloads == ["vae"]
        assert torch.equal(decoded, first)

        sampled = env.nodes["KVGraphSampler"].execute
        inputs = dict(model=transformer, positive=positive, latent=latent, seed=1, steps=2, cfg=1.0,
                      sigma_preset="dynamic", denoise=1.0, decode_mode="auto", compile="off")
        reference = sampled(**inputs).args[0]["samples"]
        offloads.clear()
        engine = transformer.engine
        monkeypatch.setattr(engine, "decode_step", release_during("transformer", engine.decode_step))
        again = sampled(**inputs).args[0]["samples"]
        assert released["transformer"] == ({"transformer": False}, []) and offloads == ["transformer"]
        assert torch.equal(again, reference)
    finally:
        close_env(env)
