"""The example workflows: the UI-format JSON matches the pack's node schemas (widget order, types, ranges, combo
options, sockets and link types), and each API-format twin in example_workflows/api is the same graph.

The schemas come from the pack itself, loaded with the small ComfyUI fake (no ComfyUI needed). Core nodes used by
the examples (LoadImage, SaveImage) are described here by their widget names only.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
UI_FILES = sorted((ROOT / "example_workflows").glob("*.json"))
EXPECTED = {"qwen_image_2.1_text_to_image", "qwen_image_2.1_turbo_8_steps", "qwen_image_2.1_edit_one_reference",
            "qwen_image_2.1_edit_two_references", "qwen_image_2.1_cfg_negative_prompt", "qwen_image_2.1_lora",
            "qwen_image_2.1_ksampler", "qwen_image_2.1_edit_custom_sampler", "qwen_image_2.1_inpaint",
            "qwen_image_2.1_edit_five_references"}
LORA_FILE = "qwen_image_2.1_lora.safetensors"  # the LoRA example's file (users put their own in models/loras)
# ComfyUI's templates load the INT8 ConvRot files by default; the Turbo example loads the Turbo checkpoint.
REAL_FILES = {"qwen_image_2.1_int8_convrot.safetensors", "qwen3vl_8b_int8_convrot.safetensors",
              "qwen_image_2.1_vae_bf16.safetensors"}
TURBO_FILE = "qwen_image_2.1_turbo_int8_convrot.safetensors"
BF16_FILES = ("qwen_image_2.1_bf16.safetensors", "qwen3vl_8b_bf16.safetensors")
WIDGETS = ("BOOLEAN", "INT", "FLOAT", "STRING", "COMBO")
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
# Core nodes: widget names as the UI stores them (LoadImage adds the upload button's value), and socket types.
CORE = {
    "LoadImage": {"widgets": ["image", None], "inputs": {}, "outputs": ["IMAGE", "MASK"]},
    "SaveImage": {"widgets": ["filename_prefix"], "inputs": {"images": "IMAGE"}, "outputs": []},
    # frontend-only: a prompt leaves it out, so it has no API-format twin
    "MarkdownNote": {"widgets": ["text"], "inputs": {}, "outputs": [], "ui_only": True},
    # core's sampling nodes, on the transformer loader's MODEL
    "KSampler": {"widgets": ["seed", None, "steps", "cfg", "sampler_name", "scheduler", "denoise"],
                 "inputs": {"model": "MODEL", "positive": "CONDITIONING", "negative": "CONDITIONING",
                            "latent_image": "LATENT"}, "outputs": ["LATENT"]},
    "RandomNoise": {"widgets": ["noise_seed", None], "inputs": {}, "outputs": ["NOISE"]},
    "KSamplerSelect": {"widgets": ["sampler_name"], "inputs": {}, "outputs": ["SAMPLER"]},
    "CFGGuider": {"widgets": ["cfg"], "inputs": {"model": "MODEL", "positive": "CONDITIONING",
                                                 "negative": "CONDITIONING"}, "outputs": ["GUIDER"]},
    "SamplerCustomAdvanced": {"widgets": [], "inputs": {"noise": "NOISE", "guider": "GUIDER", "sampler": "SAMPLER",
                                                        "sigmas": "SIGMAS", "latent_image": "LATENT"},
                              "outputs": ["LATENT", "LATENT"]},
    "SetLatentNoiseMask": {"widgets": [], "inputs": {"samples": "LATENT", "mask": "MASK"}, "outputs": ["LATENT"]},
}


def load(path):
    return json.loads(path.read_text())


def ui_widgets(schema):
    """(input, consumes a control value after it) in the frontend's order: required widgets, then optional ones."""
    ordered = [i for i in schema.inputs if not i.optional] + [i for i in schema.inputs if i.optional]
    return [(i, bool(getattr(i, "control_after_generate", False))) for i in ordered if i.io_type in WIDGETS]


def check_widget(where, item, value):
    if item.io_type == "COMBO":
        assert value in item.options, f"{where}: {value!r} is not one of {item.options}"
    elif item.io_type == "BOOLEAN":
        assert isinstance(value, bool), where
    elif item.io_type == "STRING":
        assert isinstance(value, str), where
    else:
        kind = int if item.io_type == "INT" else (int, float)
        assert isinstance(value, kind) and not isinstance(value, bool), f"{where}: {value!r}"
        assert item.min is None or value >= item.min, f"{where}: {value} < {item.min}"
        assert item.max is None or value <= item.max, f"{where}: {value} > {item.max}"
        if item.io_type == "INT" and item.step and item.min is not None and item.step > 1:
            assert value % item.step == 0, f"{where}: {value} is not a multiple of {item.step}"


def named_widgets(env, node):
    """{widget name: value} of a UI node, checked against its schema."""
    node_type, values = node["type"], list(node["widgets_values"])
    where = f"{node_type} #{node['id']}"
    if node_type in CORE:
        names = CORE[node_type]["widgets"]
        assert len(values) == len(names), where
        return {n: v for n, v in zip(names, values) if n is not None}
    schema = env.nodes[node_type].define_schema()
    named = {}
    for item, has_control in ui_widgets(schema):
        assert values, f"{where}: missing widget value for {item.id}"
        value = values.pop(0)
        check_widget(f"{where}.{item.id}", item, value)
        named[item.id] = value
        if has_control:
            assert values and values.pop(0) in CONTROL_VALUES, f"{where}.{item.id}: no control_after_generate value"
    assert not values, f"{where}: extra widget values {values}"
    return named


AUTOGROW, MATCHTYPE = "COMFY_AUTOGROW_V3", "COMFY_MATCHTYPE_V3"


def schema_socket(item) -> dict:
    """{socket name: type} of one schema input as the frontend draws it: sockets that grow as they are connected are
    named `<input>.<name>`; a socket of several allowed types lists them."""
    if item.io_type == AUTOGROW:
        return {f"{item.id}.{name}": item.template.input.io_type for name in item.template.names}
    if item.io_type == MATCHTYPE:
        return {item.id: ",".join(t.io_type for t in item.template.allowed_types)}
    return {item.id: item.io_type}


def socket_types(env, node_type, node=None):
    """(socket inputs {name: type}, output types) from the schema or the core table. An output that takes the type
    of its input (MatchType) has the type the UI node gives it, which must be one of those its input allows."""
    if node_type in CORE:
        return CORE[node_type]["inputs"], CORE[node_type]["outputs"]
    schema = env.nodes[node_type].define_schema()
    inputs = {}
    for item in schema.inputs:
        if item.io_type not in WIDGETS:
            inputs.update(schema_socket(item))
    outputs = []
    for slot, output in enumerate(schema.outputs):
        if output.io_type == MATCHTYPE and node is not None:
            given = node["outputs"][slot]["type"]
            assert given in [t.io_type for t in output.template.allowed_types], f"{node_type}: {given}"
            outputs.append(given)
        else:
            outputs.append(output.io_type)
    return inputs, outputs


def test_the_examples_exist_with_api_twins():
    assert {p.stem for p in UI_FILES} == EXPECTED
    for path in UI_FILES:
        assert (ROOT / "example_workflows" / "api" / path.name).is_file()


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_matches_node_schemas(comfy_env, path):
    workflow = load(path)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    assert len(nodes) == len(workflow["nodes"]) and workflow["last_node_id"] >= max(nodes)
    files = set()
    for node in nodes.values():
        assert node["type"] in comfy_env.nodes or node["type"] in CORE, node["type"]
        widgets = named_widgets(comfy_env, node)
        files |= {v for k, v in widgets.items() if k.endswith("_name") and k != "sampler_name"}
        inputs, outputs = socket_types(comfy_env, node["type"], node)
        assert [(i["name"], i["type"]) for i in node["inputs"]] == [
            (i["name"], inputs[i["name"]]) for i in node["inputs"]], node["type"]
        assert [o["type"] for o in node["outputs"]] == outputs, node["type"]
    expected_files = REAL_FILES
    if "turbo" in path.stem:
        expected_files = REAL_FILES - {"qwen_image_2.1_int8_convrot.safetensors"} | {TURBO_FILE}
    assert files - {LORA_FILE} == expected_files and (LORA_FILE in files) == ("lora" in path.stem)
    link_ids = set()
    for link_id, src, src_slot, dst, dst_slot, link_type in workflow["links"]:
        link_ids.add(link_id)
        out_type = socket_types(comfy_env, nodes[src]["type"], nodes[src])[1][src_slot]
        target = nodes[dst]["inputs"][dst_slot]
        assert link_type == out_type and link_type in target["type"].split(","), f"link {link_id}"
        assert target["link"] == link_id and link_id in nodes[src]["outputs"][src_slot]["links"]
    assert workflow["last_link_id"] == max(link_ids)
    for node in nodes.values():  # every connected socket points at a real link; required sockets are connected
        schema_inputs = {} if node["type"] in CORE else {
            name: i for i in comfy_env.nodes[node["type"]].define_schema().inputs for name in schema_socket(i)}
        for socket in node["inputs"]:
            assert socket["link"] is None or socket["link"] in link_ids
            if socket["link"] is None and socket["name"] in schema_inputs:
                assert schema_inputs[socket["name"]].optional, f"{node['type']}.{socket['name']} unconnected"


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_api_twin_is_the_same_graph(comfy_env, path):
    ui = load(path)
    api = load(ROOT / "example_workflows" / "api" / path.name)
    prompt_nodes = [n for n in ui["nodes"] if not CORE.get(n["type"], {}).get("ui_only")]
    assert set(api) == {str(n["id"]) for n in prompt_nodes}
    for node in prompt_nodes:
        twin = api[str(node["id"])]
        assert twin["class_type"] == node["type"]
        expected = dict(named_widgets(comfy_env, node))
        for _, src, src_slot, dst, dst_slot, _ in ui["links"]:
            if dst == node["id"]:
                expected[node["inputs"][dst_slot]["name"]] = [str(src), src_slot]
        assert twin["inputs"] == expected, node["type"]


def test_examples_cover_the_documented_cases(comfy_env):
    by_name = {p.stem: {n["type"]: named_widgets(comfy_env, n) for n in load(p)["nodes"]} for p in UI_FILES}
    assert by_name["qwen_image_2.1_text_to_image"]["KVGraphSampler"]["steps"] == 40
    turbo = by_name["qwen_image_2.1_turbo_8_steps"]
    assert turbo["KVGraphSampler"]["sigma_preset"] == "auto" and turbo["KVGraphSampler"]["steps"] == 8
    assert turbo["KVGraphSampler"]["cfg"] == 1.0 and turbo["KVGraphLoadTransformer"]["transformer_name"] == TURBO_FILE
    for name, nodes in by_name.items():  # the bf16 files are named as the alternative in every example's note
        assert nodes["KVGraphLoadTransformer"]["int8_weights"] == "int8"
        assert all(f in nodes["MarkdownNote"]["text"] for f in BF16_FILES[1:]), name
        assert "bf16.safetensors`" in nodes["MarkdownNote"]["text"]
    cfg = load(ROOT / "example_workflows" / "api" / "qwen_image_2.1_cfg_negative_prompt.json")
    sampler = next(n for n in cfg.values() if n["class_type"] == "KVGraphSampler")
    encode = next(n for n in cfg.values() if n["class_type"] == "KVGraphTextEncode")
    assert sampler["inputs"]["cfg"] > 1 and "negative" in sampler["inputs"] and encode["inputs"]["negative_prompt"]
    for name, count in (("qwen_image_2.1_edit_one_reference", 1), ("qwen_image_2.1_edit_two_references", 2),
                        ("qwen_image_2.1_edit_custom_sampler", 1), ("qwen_image_2.1_edit_five_references", 5)):
        api = load(ROOT / "example_workflows" / "api" / f"{name}.json")
        encode = next(n for n in api.values() if n["class_type"] == "KVGraphTextEncode")
        assert sorted(k for k in encode["inputs"] if k.startswith("images.")) == sorted(
            f"images.image{i + 1}" for i in range(count))
        assert "vae" in encode["inputs"]
        assert sum(n["class_type"] == "LoadImage" for n in api.values()) == count


def test_the_lora_example_puts_the_lora_between_the_loader_and_the_sampler():
    api = load(ROOT / "example_workflows" / "api" / "qwen_image_2.1_lora.json")
    ids = {n["class_type"]: node_id for node_id, n in api.items()}
    lora = api[ids["KVGraphLoadLoRA"]]
    assert lora["inputs"] == {"lora_name": LORA_FILE, "strength": 1.0, "model": [ids["KVGraphLoadTransformer"], 0]}
    assert api[ids["KVGraphSampler"]]["inputs"]["model"] == [ids["KVGraphLoadLoRA"], 0]


# -- how the examples open (the layout) ------------------------------------------------------------------------------
# The window an example must open well in: 1920x1080, with the sidebar and the KV-Graph panel at the left (the
# panel's right edge is at 430 px), the tab bar and the workflow's Run bar on top (90 px) and the canvas toolbar at the
# bottom (40 px). The frontend draws a node's title bar (30 px) above its `pos`, and the pack's badge above that.
VIEW_LEFT, VIEW_TOP, VIEW_RIGHT, VIEW_BOTTOM = 430, 90, 1920, 1080 - 40
TITLE_HEIGHT, BADGE_HEIGHT = 30, 20
MIN_SCALE = 0.8  # 12 px widget text drawn at 10 px or more


def node_box(node):
    """(left, top, right, bottom) of a node as drawn, its title bar included."""
    (x, y), (w, h) = node["pos"], node["size"]
    return x, y - TITLE_HEIGHT, x + w, y + h


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_nodes_have_titles_that_read_as_titles(comfy_env, path):
    """Each node is titled by what it does in this workflow, not by its class or its name in the node menu."""
    nodes = load(path)["nodes"]
    titles = [n.get("title") for n in nodes]
    assert all(isinstance(t, str) and t.strip() for t in titles), titles
    assert len(set(titles)) == len(titles), f"two nodes share a title: {titles}"
    for node in nodes:
        title = node["title"]
        assert title != node["type"] and not title.startswith("KVGraph"), f"a class name as the title: {title}"
        if node["type"] in comfy_env.nodes:
            assert title != comfy_env.nodes[node["type"]].define_schema().display_name, title
        assert title[0].isupper() and len(title) <= 48, title


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_no_two_nodes_overlap(path):
    nodes = load(path)["nodes"]
    for node in nodes:
        w, h = node["size"]
        assert w >= 260 and h >= 40, f"{node['title']}: {node['size']} is too small to read"
    for i, a in enumerate(nodes):
        ax0, ay0, ax1, ay1 = node_box(a)
        for b in nodes[i + 1:]:
            bx0, by0, bx1, by1 = node_box(b)
            apart = ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0
            assert apart, f"{a['title']} and {b['title']} overlap"


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_the_view_shows_the_whole_graph_beside_the_sidebar(path):
    workflow = load(path)
    ds = workflow["extra"]["ds"]
    scale, (offset_x, offset_y) = ds["scale"], ds["offset"]
    assert MIN_SCALE <= scale <= 1.0, scale
    boxes = [node_box(n) for n in workflow["nodes"]]
    x0, y0 = min(b[0] for b in boxes), min(b[1] for b in boxes) - BADGE_HEIGHT
    x1, y1 = max(b[2] for b in boxes), max(b[3] for b in boxes)
    # The frontend draws canvas point p at (p + offset) * scale.
    left, top = (x0 + offset_x) * scale, (y0 + offset_y) * scale
    right, bottom = (x1 + offset_x) * scale, (y1 + offset_y) * scale
    assert left >= VIEW_LEFT and top >= VIEW_TOP and right <= VIEW_RIGHT and bottom <= VIEW_BOTTOM, (
        f"the graph is drawn at ({left:.0f}, {top:.0f})-({right:.0f}, {bottom:.0f}), outside the view "
        f"({VIEW_LEFT}, {VIEW_TOP})-({VIEW_RIGHT}, {VIEW_BOTTOM})")
    # ...and fills it: at least two thirds of the free width or height.
    assert (right - left) >= (VIEW_RIGHT - VIEW_LEFT) * 2 / 3 or (bottom - top) >= (VIEW_BOTTOM - VIEW_TOP) * 2 / 3


def test_the_files_are_what_make_workflows_writes():
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    import make_workflows

    assert set(make_workflows.WORKFLOWS) == EXPECTED
    for name, workflow in make_workflows.WORKFLOWS.items():
        stale = "rerun python tests/e2e/make_workflows.py"
        assert load(ROOT / "example_workflows" / f"{name}.json") == make_workflows.ui_workflow(workflow), stale
        assert load(ROOT / "example_workflows" / "api" / f"{name}.json") == make_workflows.api_workflow(workflow), stale
