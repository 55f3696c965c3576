"""Bad input in a real ComfyUI, and the pack installed under a folder name with a space.

One server (CPU, tiny models) with the pack linked in as custom_nodes/"kv graph e2e", started with `--cache-none` so
every node of every prompt runs. Each refused input (a model name outside the model folders, a size off the 16 px
grid at queue time, a release body the JSON parser chokes on, a NaN latent or a damaged VAE at the decode, a size too
large for the schedule, a lone surrogate in a prompt) is followed by the same good prompt, whose image must equal,
pixel for pixel, the one that prompt gave first: a refusal leaves nothing behind.
"""

from __future__ import annotations

import http.client
import json
import shutil
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import (  # noqa: E402
    REPO, SMALL, load_api_workflow, node_of, prepare_base, start_server, ui_workflow_path, with_diffusers_loader,
)

pytestmark = pytest.mark.comfyui

SPACE_FOLDER = "kv graph e2e"
QUOTED_FOLDER = urllib.parse.quote(SPACE_FOLDER)
T2I = "qwen_image_2.1_text_to_image"
# The files the example loads (its transformer is an INT8 ConvRot file; the e2e base holds both kinds).
T_FILE = node_of(load_api_workflow(T2I), "KVGraphLoadTransformer")["inputs"]["transformer_name"]
VAE_FILE = node_of(load_api_workflow(T2I), "KVGraphLoadVAE")["inputs"]["vae_name"]
PIPELINE = "qwen-image-2.1-tiny"
STEPS = 4
ENCODE, SAMPLER, DECODE = "4", "5", "6"  # node ids in the example API workflows


@pytest.fixture(scope="module")
def base(comfyui_install, tmp_path_factory):
    """The usual base, plus a real pipeline outside models/ (what a traversal would reach) and a link to it that
    lives inside models/diffusers (which, as in ComfyUI, is followed)."""
    from graph_runtime.tiny import write_diffusers_folder

    base = prepare_base(tmp_path_factory.mktemp("comfyui-space"), pack_folder=SPACE_FOLDER)
    write_diffusers_folder(base / "outside" / PIPELINE)
    (base / "models" / "diffusers" / "linked-tiny").symlink_to(base / "outside" / PIPELINE, target_is_directory=True)
    return base


@pytest.fixture(scope="module")
def server(comfyui_install, base):
    srv = start_server(comfyui_install, base, "--cache-none")
    yield srv
    srv.stop()


def good_prompt() -> dict:
    return load_api_workflow(T2I, seed=2024, steps=STEPS)


@pytest.fixture(scope="module")
def reference(server):
    """The good prompt's image from its first run on this server."""
    return server.output_pixels(server.run(good_prompt()))


def assert_next_good_prompt_matches(server, reference) -> None:
    entry = server.run(good_prompt())
    cached = [data["nodes"] for kind, data in entry["status"]["messages"] if kind == "execution_cached"]
    assert cached == [[]]  # every node ran again, the sampler included
    assert server.output_pixels(entry) == reference


def execution_error(entry) -> dict:
    assert entry["status"]["status_str"] == "error", entry["status"]
    return next(data for kind, data in entry["status"]["messages"] if kind == "execution_error")


def link_string(prompt: dict, value: str) -> list:
    """A string that reaches a combo input through a link: core's String primitive through core's Switch, whose
    output takes any type (so ComfyUI's combo check, which only sees widget values, never sees it)."""
    prompt["90"] = {"class_type": "PrimitiveString", "inputs": {"value": value}}
    prompt["91"] = {"class_type": "ComfySwitchNode", "inputs": {"switch": True, "on_true": ["90", 0],
                                                                 "on_false": ["90", 0]}}
    return ["91", 0]


def diffusers_prompt(folder) -> dict:
    return with_diffusers_loader(good_prompt(), folder, placement="cpu")


def raw_get(server, path: str) -> int:
    """GET a path exactly as written (no client-side normalising of `..` or percent escapes); returns the status."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


# -- the pack folder with a space ----------------------------------------------------------------------------------


def test_web_files_and_templates_are_served_under_a_folder_name_with_a_space(server):
    prefix = f"/extensions/{QUOTED_FOLDER}/"
    listed = sorted(u for u in server.get("/extensions") if u.startswith(prefix))
    assert listed == sorted(prefix + p.name for p in (REPO / "web").glob("*.js"))
    for url in listed:
        response = requests.get(server.url + url, timeout=30)
        assert response.status_code == 200, url
        assert "javascript" in response.headers["Content-Type"]
        assert response.content == (REPO / "web" / url[len(prefix):]).read_bytes()

    examples = sorted(p.stem for p in (REPO / "example_workflows").glob("*.json"))
    assert sorted(server.get("/workflow_templates")[SPACE_FOLDER]) == examples
    for name in examples:  # where the frontend's template browser fetches them
        response = requests.get(f"{server.url}/api/workflow_templates/{QUOTED_FOLDER}/{name}.json", timeout=30)
        assert response.status_code == 200, name
        assert response.json() == json.loads((REPO / "example_workflows" / f"{name}.json").read_text())

    for path in ("..%2F__init__.py", "%2E%2E/__init__.py", "../__init__.py", "%2Fetc%2Fpasswd", "/etc/passwd",
                 "", "missing.js"):
        assert raw_get(server, prefix + path) == 404, path
    assert raw_get(server, f"/api/workflow_templates/{QUOTED_FOLDER}/..%2Fweb%2Fkvgraph.js") == 404
    assert "needs URL quoting" in server.log_path.read_text()  # the start-up line saying what the pack does


# -- model names outside the model folders -------------------------------------------------------------------------


def test_model_names_outside_the_model_folders_are_refused_alike(server, base, reference):
    outside = base / "outside" / PIPELINE  # a valid pipeline: before the check, it loaded
    names = [str(outside), f"../../outside/{PIPELINE}", "../../outside/missing", "/nonexistent/pipeline"]
    messages = set()
    for name in names:
        prompt = diffusers_prompt(None)
        node_of(prompt, "KVGraphLoadDiffusers")["inputs"]["folder"] = link_string(prompt, name)
        error = execution_error(server.wait(server.queue_ok(prompt)))
        assert error["node_type"] == "KVGraphLoadDiffusers"
        messages.add(error["exception_message"].strip())
    assert len(messages) == 1, messages  # the same words whether the outside path exists or not
    message, = messages
    assert message.startswith("folder:") and "models/diffusers" in message
    assert str(base) not in message and "outside" not in message and "missing" not in message

    prompt = good_prompt()
    node_of(prompt, "KVGraphLoadTransformer")["inputs"]["transformer_name"] = link_string(prompt,
                                                                                          f"../vae/{VAE_FILE}")
    error = execution_error(server.wait(server.queue_ok(prompt)))
    assert error["exception_message"].startswith("transformer_name:") and VAE_FILE not in error["exception_message"]
    assert_next_good_prompt_matches(server, reference)


def test_a_pipeline_linked_into_models_diffusers_loads(server):
    options = server.get("/object_info/KVGraphLoadDiffusers")["KVGraphLoadDiffusers"]["input"]["required"]
    assert "linked-tiny" in options["folder"][1]["options"]
    entry = server.run(diffusers_prompt("linked-tiny"))
    assert server.output_pixels(entry)[0] == (SMALL, SMALL * 3 // 4)


# -- sizes checked when the prompt is queued -------------------------------------------------------------------------


@pytest.fixture
def nothing_loaded(server):
    response = server.post("/kvgraph/release", {"models": True})
    assert response.ok and server.status()["loaded"] == []


@pytest.mark.parametrize("side, value, fragment", [
    ("width", 100, "from 16 to 8192"), ("height", 8, "from 16 to 8192"), ("width", 0, "multiple of 16"),
    ("height", 8208, "from 16 to 8192"),
])
def test_a_size_off_the_grid_is_refused_when_queued(server, nothing_loaded, side, value, fragment):
    response = server.queue(load_api_workflow(T2I, seed=3, **{side: value}))
    assert response.status_code == 400
    body = response.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    errors = body["node_errors"][ENCODE]["errors"]
    ours = [e for e in errors if e["extra_info"]["input_name"] == side]
    assert ours and f"{side}={value} is invalid" in ours[0]["details"] and fragment in ours[0]["details"]
    # Refused before anything ran: no model was loaded and nothing is queued.
    assert server.status()["loaded"] == []
    assert server.get("/queue") == {"queue_running": [], "queue_pending": []}


def test_after_refused_sizes_the_good_prompt_loads_and_matches(server, nothing_loaded, reference):
    for side, value in (("width", 100), ("height", 8)):
        assert server.queue(load_api_workflow(T2I, seed=3, **{side: value})).status_code == 400
    assert_next_good_prompt_matches(server, reference)
    assert {item["kind"] for item in server.status()["loaded"]} == {"transformer", "text_encoder", "vae"}


# -- issue 29: decoded images, sizes and prompts refused by name ----------------------------------------------------

LOAD_LATENT, RESIZE = "80", "81"


def save_latent(base, name: str, samples) -> str:
    """A `.latent` file in ComfyUI's input folder, in the layout core's Load Latent reads (version 0: as stored)."""
    import torch
    from safetensors.torch import save_file

    save_file({"latent_tensor": samples, "latent_format_version_0": torch.tensor([])}, str(base / "input" / name))
    return name


def damaged_vae_file(base, name: str, damage) -> str:
    from safetensors.torch import load_file, save_file

    tensors = load_file(base / "models" / "vae" / VAE_FILE)
    save_file({k: damage(v) for k, v in tensors.items()}, str(base / "models" / "vae" / name))
    return name


def decode_only(prompt: dict, latent_file: str | None = None, vae_file: str | None = None) -> dict:
    """The good prompt with its decode fed by core's Load Latent and/or another VAE file."""
    if latent_file is not None:
        prompt[LOAD_LATENT] = {"class_type": "LoadLatent", "inputs": {"latent": latent_file}}
        prompt[DECODE]["inputs"]["latent"] = [LOAD_LATENT, 0]
    if vae_file is not None:
        node_of(prompt, "KVGraphLoadVAE")["inputs"]["vae_name"] = vae_file
    return prompt


def test_a_nan_latent_or_a_damaged_vae_fails_the_decode_by_name(server, base, reference):
    """Before: a latent holding NaN (core Load Latent) or a VAE file of NaN weights saved an all-black image, and an
    all-zero VAE a flat grey one, each prompt reported as a success. Each now fails at KV-Graph VAE Decode with the
    cause named; the good prompt after them gives the first image again."""
    import torch

    samples = torch.randn(1, 64, 6, 8, generator=torch.Generator().manual_seed(0))
    samples[0, 0, 1, 1] = float("nan")
    cases = [
        (decode_only(good_prompt(), latent_file=save_latent(base, "kvgraph_nan.latent", samples)),
         "latent='a tensor with NaN or infinite values' is invalid", "Load Latent"),
        (decode_only(good_prompt(), vae_file=damaged_vae_file(base, "kvgraph_e2e_nan_vae.safetensors",
                                                              lambda t: torch.full_like(t, float("nan")))),
         "the decoded image holds NaN", "kvgraph_e2e_nan_vae.safetensors"),
        (decode_only(good_prompt(), vae_file=damaged_vae_file(base, "kvgraph_e2e_zero_vae.safetensors",
                                                              torch.zeros_like)),
         "the decoded image is one flat colour", "kvgraph_e2e_zero_vae.safetensors"),
    ]
    for prompt, words, cause in cases:
        entry = server.wait(server.queue_ok(prompt))
        error = execution_error(entry)
        assert error["node_type"] == "KVGraphVAEDecode", error
        assert words in error["exception_message"] and cause in error["exception_message"]
        assert server.output_images(entry) == []  # no image saved
    assert_next_good_prompt_matches(server, reference)


def test_sizes_and_long_values_are_refused_with_the_limit_that_applies(server, reference):
    """Before: a 16384x16384 latent (core Upscale Latent into the sampler) was refused as `sigmas=[...] is invalid`
    though no sigmas were given; a width linked from a primitive passed up to 32768 and was refused as "16 to
    32768"; a too-long negative prompt was reported as `prompt=`; a 5,000-character model name came back whole."""
    prompt = good_prompt()
    prompt[RESIZE] = {"class_type": "LatentUpscale", "inputs": {"samples": [ENCODE, 2], "upscale_method":
                                                                "nearest-exact", "width": 8192, "height": 8192,
                                                                "crop": "disabled"}}  # core's 8x: 1024x1024 tokens
    prompt[SAMPLER]["inputs"]["latent"] = [RESIZE, 0]
    error = execution_error(server.wait(server.queue_ok(prompt)))
    assert error["node_type"] == "KVGraphSampler"
    assert error["exception_message"].startswith("image size='16384x16384 px (1048576 latent tokens)' is invalid")
    assert "sigmas=" not in error["exception_message"]

    prompt = good_prompt()
    prompt["92"] = {"class_type": "PrimitiveInt", "inputs": {"value": 16384}}
    prompt[ENCODE]["inputs"]["width"] = ["92", 0]
    error = execution_error(server.wait(server.queue_ok(prompt)))
    assert "width=16384 is invalid: expected a multiple of 16 pixels from 16 to 8192" in error["exception_message"]

    prompt = good_prompt()
    prompt[ENCODE]["inputs"]["negative_prompt"] = "blurry " * 10_000
    error = execution_error(server.wait(server.queue_ok(prompt)))
    assert error["exception_message"].startswith("negative_prompt='70000 characters")

    prompt = good_prompt()
    node_of(prompt, "KVGraphLoadVAE")["inputs"]["vae_name"] = link_string(prompt, "v" * 4988 + ".safetensors")
    error = execution_error(server.wait(server.queue_ok(prompt)))
    assert "was not found" in error["exception_message"] and "(5000 characters)" in error["exception_message"]
    assert len(error["exception_message"]) < 1000
    assert_next_good_prompt_matches(server, reference)


def test_prompt_text_is_text_and_a_lone_surrogate_is_refused(server, reference):
    """Before: `<|image_pad|>` in a prompt raised transformers' ValueError and `"\\ud800"` in the API JSON a tokenizers
    TypeError. Control-token text now runs as text; a lone surrogate is refused naming the prompt."""
    prompt = good_prompt()
    prompt[ENCODE]["inputs"]["prompt"] = "a <|image_pad|> beside a <|video_pad|>, <|im_end|>"
    entry = server.run(prompt)
    assert len(server.output_images(entry)) == 1

    prompt = good_prompt()
    prompt[ENCODE]["inputs"]["prompt"] = "a cat \ud800 on a mat"  # sent as the JSON escape "\\ud800"
    error = execution_error(server.wait(server.queue_ok(prompt)))
    assert error["node_type"] == "KVGraphTextEncode"
    assert error["exception_message"].startswith("prompt='text with a lone surrogate U+D800 at character 6'")
    assert_next_good_prompt_matches(server, reference)


# -- POST /kvgraph/release bodies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("body, fragment", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a":' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    ("{not json", "not valid JSON"),
])
def test_a_bad_release_body_is_a_400_and_the_next_prompt_matches(server, reference, body, fragment):
    response = requests.post(f"{server.url}/kvgraph/release", data=body.encode(),
                             headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400 and fragment in response.json()["error"]
    assert server.status()["running"] == []
    assert_next_good_prompt_matches(server, reference)


# -- cache nodes ordered by their pass-through ----------------------------------------------------------------------


def eager_steps(status: dict) -> dict:
    return {m["engine_id"]: m["eager_steps"].get("no CUDA", 0) for m in status["models"]
            if (m.get("source") or "").endswith(T_FILE)}


def test_cache_nodes_run_after_the_sampler_they_pass_through(server, reference, websocket_log):
    """sampler -> Cache Status -> Release Caches -> VAE Decode: both run after the sampler (the report counts this
    run's steps), pass the latent on unchanged (same image), and send their report to be shown on the node."""
    before = eager_steps(server.status())
    prompt = good_prompt()
    prompt["20"] = {"class_type": "KVGraphCacheStatus", "inputs": {"passthrough": [SAMPLER, 0]}}
    prompt["21"] = {"class_type": "KVGraphReleaseCaches",
                    "inputs": {"release_models": False, "passthrough": ["20", 1]}}
    prompt[DECODE]["inputs"]["latent"] = ["21", 1]
    prompt_id = server.queue_ok(prompt)
    entry = server.wait(prompt_id)
    assert entry["status"]["status_str"] == "success"
    assert server.output_pixels(entry) == reference

    after = eager_steps(server.status())
    engine, = [e for e in after if after[e] - before.get(e, 0) == STEPS]  # the engine this run sampled on
    report = entry["outputs"]["20"]["text"][0]
    line = next(line for line in report.splitlines() if line.startswith("graph cache") and T_FILE in line)
    assert f"eager steps: no CUDA: {after[engine]};" in line  # counts this run: the node ran after the sampler
    released = entry["outputs"]["21"]["text"][0]
    assert "QwenImage21Transformer2DModel" in released

    messages = websocket_log()
    order = [m["data"]["node"] for m in messages if m.get("type") == "executing"
             and m["data"].get("prompt_id") == prompt_id and m["data"].get("node")]
    assert order.index(SAMPLER) < order.index("20") < order.index("21") < order.index(DECODE), order
    # The `executed` messages the web extension shows on the nodes, to this client.
    texts = {m["data"]["node"]: m["data"]["output"].get("text") for m in messages if m.get("type") == "executed"
             and m["data"].get("prompt_id") == prompt_id}
    assert texts.get("20") == [report] and texts.get("21") == [released]


def test_every_socket_of_every_node_has_a_tooltip(server):
    info = server.get("/object_info")
    ours = {k: v for k, v in info.items() if v["category"].startswith("KV-Graph")}
    assert len(ours) >= 10
    for node_id, spec in ours.items():
        assert spec["output_tooltips"] and all(spec["output_tooltips"]), node_id
        for section in ("required", "optional"):
            for name, (_, *options) in spec["input"].get(section, {}).items():
                assert options and options[0].get("tooltip"), f"{node_id}.{name}"


# -- the real frontend (headless Chromium) --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page(server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("needs a Chromium executable (Debian: apt-get install chromium)")
    assert server.post("/settings/Comfy.TutorialCompleted", True).ok  # no template browser opening by itself
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1600, "height": 900})
        tab.errors = []
        tab.on("pageerror", lambda exc: tab.errors.append(str(exc)))
        tab.goto(server.url)
        tab.wait_for_function("window.app?.graph && window.app.extensionManager", timeout=90_000)
        tab.wait_for_function("window.comfyAPI?.api?.api?.socket?.readyState === 1", timeout=30_000)
        yield tab
        browser.close()


@pytest.mark.browser
def test_frontend_loads_the_extension_and_templates_under_the_folder_with_a_space(page):
    assert "kvgraph.panel" in page.evaluate("window.app.extensions.map(e => e.name)")
    page.evaluate("window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    page.get_by_text(SPACE_FOLDER, exact=True).click()  # the pack's category in the template browser
    page.locator(f"[data-testid='template-workflow-{ui_workflow_path(T2I).stem}']").click()
    page.wait_for_function("window.app.graph.nodes.some(n => n.type === 'KVGraphSampler')", timeout=30_000)
    types = sorted(page.evaluate("window.app.graph.nodes.map(n => n.type)"))
    expected = json.loads(ui_workflow_path(T2I).read_text())
    assert types == sorted(n["type"] for n in expected["nodes"])
    assert page.errors == []


@pytest.mark.browser
def test_frontend_retypes_the_passthrough_and_shows_the_status_text(page, server):
    wiring = page.evaluate("""async () => {
        const app = window.app, LiteGraph = window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph;
        app.graph.clear();
        const [sampler, status, decode] = ['KVGraphSampler', 'KVGraphCacheStatus', 'KVGraphVAEDecode']
            .map(type => { const n = LiteGraph.createNode(type); app.graph.add(n); return n; });
        const before = status.outputs[1].type;
        const toStatus = sampler.connect(0, status, status.findInputSlot('passthrough'));
        const toDecode = status.connect(1, decode, decode.findInputSlot('latent'));
        const prompt = (await app.graphToPrompt()).output;
        return { before, after: status.outputs[1].type, linked: !!toStatus && !!toDecode,
                 decodeLatent: prompt[String(decode.id)].inputs.latent, statusId: String(status.id) };
    }""")
    # The output takes the type of what is connected, so only LATENT inputs accept it once the latent is wired in.
    assert wiring["before"] == "*" and wiring["after"] == "LATENT" and wiring["linked"]
    assert wiring["decodeLatent"] == [wiring["statusId"], 1]

    # Queued from the page: the report shows in the node's report box, and is still there once the job has ended
    # (1.58 clears a node's progress text then); it is neither an input of the prompt nor a saved widget value.
    page.evaluate("""async () => {
        const app = window.app, LiteGraph = window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph;
        app.graph.clear();
        const node = LiteGraph.createNode('KVGraphCacheStatus');
        app.graph.add(node);
        node.pos = [200, 200];
        window.kvgraphStatusNode = node;
        await app.queuePrompt(0);
    }""")
    page.wait_for_function("window.kvgraphStatusNode.widgets?.find(w => w.name === 'report')?.value", timeout=60_000)
    node_id = page.evaluate("String(window.kvgraphStatusNode.id)")
    deadline = time.time() + 30
    while not (history := server.get("/history?max_items=1")) or node_id not in next(iter(history.values()))["outputs"]:
        assert time.time() < deadline, "the prompt never finished"
        time.sleep(0.2)
    page.wait_for_timeout(1500)  # the frontend has reset the job by now
    shown = page.evaluate("""async () => {
        const app = window.app, node = window.kvgraphStatusNode;
        const prompt = (await app.graphToPrompt()).output;
        return { value: node.widgets.find(w => w.name === 'report').value,
                 boxes: Array.from(document.querySelectorAll('[data-testid=kvgraph-report]')).map(e => e.value),
                 inputs: Object.keys(prompt[String(node.id)].inputs), saved: node.serialize().widgets_values ?? [] };
    }""")
    report = next(iter(history.values()))["outputs"][node_id]["text"][0]
    assert shown["value"] == report
    assert shown["boxes"] == [report]  # drawn on the page, not only held by the widget
    assert "report" not in shown["inputs"] and report not in shown["saved"]
    assert page.errors == []
