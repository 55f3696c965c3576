"""The example workflows: the UI-format JSON matches the pack's node schemas (widget order, types, ranges, combo
options, sockets and link types), each API-format twin in example_workflows/api is the same graph, each opens
readable in a 1600x1000 window and beside the KV-Graph panel at 1920x1080, and each has a template card (its file
named by its title, and a thumbnail).

The schemas come from the pack itself, loaded with the small ComfyUI fake (no ComfyUI needed). Core nodes used by
the examples (LoadImage, SaveImage) are described here by their widget names only. A UI file is named by its card's
title and its API twin by the example's name: make_workflows.py pairs them (ui_path).
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import make_workflows  # noqa: E402

UI_FILES = sorted((ROOT / "example_workflows").glob("*.json"))
EXPECTED = {"qwen_image_2.1_text_to_image", "qwen_image_2.1_turbo_8_steps", "qwen_image_2.1_edit_one_reference",
            "qwen_image_2.1_edit_two_references", "qwen_image_2.1_cfg_negative_prompt", "qwen_image_2.1_lora",
            "qwen_image_2.1_ksampler", "qwen_image_2.1_edit_custom_sampler", "qwen_image_2.1_inpaint",
            "qwen_image_2.1_edit_five_references", "qwen_image_2.1_controlnet", "qwen_image_2.1_controlnet_inpaint",
            "qwen_image_2.1_step_cache", "qwen_image_2.1_easycache",
            "qwen_image_2.1_core_lora", "qwen_image_2.1_remove_background",
            "qwen_image_2.1_skip_layer_guidance", "qwen_image_2.1_gguf"}
LORA_FILE = "qwen_image_2.1_lora.safetensors"  # the LoRA example's file (users put their own in models/loras)
CONTROLNET_FILE = "qwen_image_2.1_fun_controlnet_union.safetensors"  # the ControlNet examples' (models/model_patches)
# ComfyUI's templates load the INT8 ConvRot files by default; the Turbo example loads the Turbo checkpoint.
REAL_FILES = {"qwen_image_2.1_int8_convrot.safetensors", "qwen3vl_8b_int8_convrot.safetensors",
              "qwen_image_2.1_vae_bf16.safetensors"}
TURBO_FILE = "qwen_image_2.1_turbo_int8_convrot.safetensors"
GGUF_FILE = "qwen_image_2.1-Q8_0.gguf"  # the GGUF example's transformer (make-tiny writes a tiny one)
BF16_FILES = ("qwen_image_2.1_bf16.safetensors", "qwen3vl_8b_bf16.safetensors")
WIDGETS = ("BOOLEAN", "INT", "FLOAT", "STRING", "COMBO")
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
EXAMPLES = sorted(EXPECTED)
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
    "EasyCache": {"widgets": ["reuse_threshold", "start_percent", "end_percent", "verbose"],
                  "inputs": {"model": "MODEL"}, "outputs": ["MODEL"]},
    # core's LoRA loader on the MODEL; Join Image with Alpha (IMAGE + MASK -> RGBA IMAGE)
    "LoraLoaderModelOnly": {"widgets": ["lora_name", "strength_model"], "inputs": {"model": "MODEL"},
                            "outputs": ["MODEL"]},
    "JoinImageWithAlpha": {"widgets": [], "inputs": {"image": "IMAGE", "alpha": "MASK"}, "outputs": ["IMAGE"]},
    "SkipLayerGuidanceDiT": {"widgets": ["double_layers", "single_layers", "scale", "start_percent", "end_percent",
                                         "rescaling_scale"], "inputs": {"model": "MODEL"}, "outputs": ["MODEL"]},
}


def load(path):
    return json.loads(path.read_text())


def ui_file(name):
    return make_workflows.ui_path(name)


def api_file(name):
    return ROOT / "example_workflows" / "api" / f"{name}.json"


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


def test_the_examples_exist_with_api_twins_and_thumbnails():
    """Every example has its UI file (named by its card's title), its thumbnail beside it, and its API twin; nothing
    else is in the folder ComfyUI lists as templates."""
    assert {p.stem for p in (ROOT / "example_workflows" / "api").glob("*.json")} == EXPECTED
    assert set(UI_FILES) == {ui_file(name) for name in EXPECTED}
    assert {p.name for p in (ROOT / "example_workflows").glob("*.jpg")} == {ui_file(n).stem + ".jpg" for n in EXPECTED}


@pytest.mark.parametrize("name", EXAMPLES)
def test_ui_workflow_matches_node_schemas(comfy_env, name):
    workflow = load(ui_file(name))
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
    if "turbo" in name:
        expected_files = REAL_FILES - {"qwen_image_2.1_int8_convrot.safetensors"} | {TURBO_FILE}
    if "gguf" in name:
        expected_files = REAL_FILES - {"qwen_image_2.1_int8_convrot.safetensors"} | {GGUF_FILE}
    assert files - {LORA_FILE, CONTROLNET_FILE} == expected_files and (LORA_FILE in files) == ("lora" in name)
    assert (CONTROLNET_FILE in files) == ("controlnet" in name)
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


@pytest.mark.parametrize("name", EXAMPLES)
def test_api_twin_is_the_same_graph(comfy_env, name):
    ui = load(ui_file(name))
    api = load(api_file(name))
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
    by_name = {name: {n["type"]: named_widgets(comfy_env, n) for n in load(ui_file(name))["nodes"]} for name in EXAMPLES}
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


def test_the_core_lora_example_puts_cores_loader_between_the_model_and_ksampler():
    api = load(ROOT / "example_workflows" / "api" / "qwen_image_2.1_core_lora.json")
    ids = {n["class_type"]: node_id for node_id, n in api.items()}
    assert api[ids["LoraLoaderModelOnly"]]["inputs"] == {"lora_name": LORA_FILE, "strength_model": 1.0,
                                                         "model": [ids["KVGraphLoadTransformer"], 1]}
    assert api[ids["KSampler"]]["inputs"]["model"] == [ids["LoraLoaderModelOnly"], 0]


def test_the_background_removal_example_saves_the_decodes_alpha():
    """The decode's IMAGE and MASK go into Join Image with Alpha, whose RGBA image KV-Graph Save Image writes; the
    edited image is the cut-out one."""
    api = load(ROOT / "example_workflows" / "api" / "qwen_image_2.1_remove_background.json")
    ids = {n["class_type"]: node_id for node_id, n in api.items()}
    decode = ids["KVGraphVAEDecode"]
    assert api[ids["JoinImageWithAlpha"]]["inputs"] == {"image": [decode, 0], "alpha": [decode, 1]}
    assert api[ids["KVGraphSaveImage"]]["inputs"]["images"] == [ids["JoinImageWithAlpha"], 0]
    assert "SaveImage" not in ids and api[ids["LoadImage"]]["inputs"]["image"] == make_workflows.REFERENCE_IMAGES[1]
    assert "background" in api[ids["KVGraphTextEncode"]]["inputs"]["prompt"]


# -- how the examples open (the layout) ------------------------------------------------------------------------------
# The frontend draws canvas point p at (p + offset) * scale from the window's top-left corner, a node's title bar
# (30 px) above its `pos` and the pack's badge (20 px) above that. Measured in frontends 1.35.9, 1.49.6 and 1.58.1:
# the sidebar's icon bar ends at 60 px, the tab bar and the workflow's Run bar at 90 px, the canvas's statistics and
# toolbar take the bottom 40 px; the minimap (on by default) covers x 1339-1596, y 738-942 of a 1600x1000 window (the
# zoom toolbar under it too) and x 1659-1916, y 818-1022 of a 1920x1080 one; the KV-Graph panel ends at 438 px.
TITLE_HEIGHT, BADGE_HEIGHT = 30, 20
SMALL_WINDOW = (60, 90, 1600, 1000 - 40)
PANEL_RIGHT = 438
MINIMAPS = {"1600x1000": (1339, 738, 1600, 1000), "1920x1080": (1659, 818, 1920, 1080)}
MIN_SCALE = 0.8  # 12 px widget text drawn at 10 px or more
# Five Load Image nodes with their previews take about half of the room a 1600x1000 window has at MIN_SCALE, and the
# rest of that example's nodes do not fit beside them: it opens smaller, its text still drawn at 8.6 px or more.
MIN_SCALE_FIVE_REFERENCES = 0.72


def node_box(node):
    """(left, top, right, bottom) of a node as drawn, its title bar included."""
    (x, y), (w, h) = node["pos"], node["size"]
    return x, y - TITLE_HEIGHT, x + w, y + h


def drawn_boxes(workflow):
    """{title: (left, top, right, bottom)} of each node as the view draws it, its badge included, in screen pixels."""
    scale, (offset_x, offset_y) = workflow["extra"]["ds"]["scale"], workflow["extra"]["ds"]["offset"]
    boxes = {}
    for node in workflow["nodes"]:
        x0, y0, x1, y1 = node_box(node)
        boxes[node["title"]] = ((x0 + offset_x) * scale, (y0 - BADGE_HEIGHT + offset_y) * scale,
                                (x1 + offset_x) * scale, (y1 + offset_y) * scale)
    return boxes


@pytest.mark.parametrize("name", EXAMPLES)
def test_nodes_have_titles_that_read_as_titles(comfy_env, name):
    """Each node is titled by what it does in this workflow, not by its class or its name in the node menu."""
    nodes = load(ui_file(name))["nodes"]
    titles = [n.get("title") for n in nodes]
    assert all(isinstance(t, str) and t.strip() for t in titles), titles
    assert len(set(titles)) == len(titles), f"two nodes share a title: {titles}"
    for node in nodes:
        title = node["title"]
        assert title != node["type"] and not title.startswith("KVGraph"), f"a class name as the title: {title}"
        if node["type"] in comfy_env.nodes:
            assert title != comfy_env.nodes[node["type"]].define_schema().display_name, title
        assert title[0].isupper() and len(title) <= 48, title


@pytest.mark.parametrize("name", EXAMPLES)
def test_no_two_nodes_overlap(name):
    nodes = load(ui_file(name))["nodes"]
    for node in nodes:
        w, h = node["size"]
        assert w >= 200 and h >= 40, f"{node['title']}: {node['size']} is too small to read"
    for i, a in enumerate(nodes):
        ax0, ay0, ax1, ay1 = node_box(a)
        for b in nodes[i + 1:]:
            bx0, by0, bx1, by1 = node_box(b)
            apart = ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0
            assert apart, f"{a['title']} and {b['title']} overlap"


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_view_shows_the_whole_graph_in_a_1600x1000_window(name):
    """Opened in a 1600x1000 window, every node, title and badge included, is drawn inside the canvas (clear of the
    sidebar's icons, the tab and Run bars and the canvas toolbar), at a scale that keeps widget text readable, and
    the graph fills at least two thirds of the free width or height."""
    workflow = load(ui_file(name))
    scale = workflow["extra"]["ds"]["scale"]
    assert (MIN_SCALE_FIVE_REFERENCES if "five_references" in name else MIN_SCALE) <= scale <= 1.0, scale
    boxes = drawn_boxes(workflow).values()
    left, top = min(b[0] for b in boxes), min(b[1] for b in boxes)
    right, bottom = max(b[2] for b in boxes), max(b[3] for b in boxes)
    view_left, view_top, view_right, view_bottom = SMALL_WINDOW
    assert left >= view_left and top >= view_top and right <= view_right and bottom <= view_bottom, (
        f"the graph is drawn at ({left:.0f}, {top:.0f})-({right:.0f}, {bottom:.0f}), outside the 1600x1000 window's "
        f"canvas ({view_left}, {view_top})-({view_right}, {view_bottom})")
    free_width, free_height = view_right - PANEL_RIGHT, view_bottom - view_top
    assert (right - left) >= free_width * 2 / 3 or (bottom - top) >= free_height * 2 / 3


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_view_keeps_every_node_clear_of_the_panel_and_the_minimap(name):
    """The same view at 1920x1080 with the KV-Graph panel open draws no node under the panel, and in neither window
    does the minimap cover a node (the Save Image preview above all)."""
    for title, (left, top, right, bottom) in drawn_boxes(load(ui_file(name))).items():
        assert left >= PANEL_RIGHT, f"{title} is drawn under the KV-Graph panel (x {left:.0f})"
        for window, (x0, y0, x1, y1) in MINIMAPS.items():
            apart = right <= x0 or left >= x1 or bottom <= y0 or top >= y1
            assert apart, f"{title} ({left:.0f}, {top:.0f})-({right:.0f}, {bottom:.0f}) is under the minimap at {window}"


def fitted_boxes(workflow, width, height):
    """drawn_boxes for the view 1.58's template browser gives a template instead of its extra.ds (LiteGraph's
    fitView): the nodes' bounds (title bars included) grown by 10 on every side, centred in the window at
    min(0.75 * width / their width, 0.75 * height / their height)."""
    boxes = [node_box(n) for n in workflow["nodes"]]
    x0, y0 = min(b[0] for b in boxes) - 10, min(b[1] for b in boxes) - 10
    w, h = max(b[2] for b in boxes) + 10 - x0, max(b[3] for b in boxes) + 10 - y0
    scale = min(0.75 * width / max(w, 300), 0.75 * height / max(h, 300))
    offset_x, offset_y = width / 2 / scale - x0 - w / 2, height / 2 / scale - y0 - h / 2
    return {n["title"]: ((b[0] + offset_x) * scale, (b[1] - BADGE_HEIGHT + offset_y) * scale,
                         (b[2] + offset_x) * scale, (b[3] + offset_y) * scale)
            for n, b in zip(workflow["nodes"], boxes)}


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_minimap_stays_clear_where_the_frontend_fits_the_graph_to_the_window(name):
    """1.58 opens a template fitted to the window, not at its extra.ds: the layout leaves the graph's bottom-right
    corner, where the minimap sits, free, so there too no node (the Save Image preview above all) is under it."""
    for window, (x0, y0, x1, y1) in MINIMAPS.items():
        width, height = map(int, window.split("x"))
        for title, (left, top, right, bottom) in fitted_boxes(load(ui_file(name)), width, height).items():
            apart = right <= x0 or left >= x1 or bottom <= y0 or top >= y1
            assert apart, f"{title} ({left:.0f}, {top:.0f})-({right:.0f}, {bottom:.0f}) is under the minimap at {window}"


# -- template cards: titles and thumbnails ---------------------------------------------------------------------------


def test_each_card_has_a_title_a_person_reads_as_one():
    """The frontend titles a card by the UI file's name: each is short enough for the card's one line (30 characters
    fit 1.35's cards in a 1600 px window), says what the example does (not its internal name), names the model, and
    differs from every other."""
    titles = [ui_file(name).stem for name in EXAMPLES]
    assert len(set(titles)) == len(titles)
    for name, title in zip(EXAMPLES, titles):
        assert title.startswith("Qwen-Image-2.1 ") and "_" not in title and len(title) <= 30, title
        assert title != name


def test_a_headline_wider_than_the_thumbnail_is_refused():
    """A headline that would run off the thumbnail's right edge (the card shows it cut mid-word) is refused, naming
    the card; the shipped headlines all fit (each thumbnail is drawn by the test below)."""
    import workflow_cards

    name = EXAMPLES[0]
    long = workflow_cards.Card(make_workflows.card(name).title, "Skip layer guidance", "too long a headline")
    with pytest.raises(ValueError, match="Skip layer guidance.*shorten it"):
        workflow_cards.draw_thumbnail(long, make_workflows.WORKFLOWS[name][0], make_workflows.INPUTS)


@pytest.mark.parametrize("name", EXAMPLES)
def test_thumbnails_are_what_make_workflows_draws(name):
    """Each thumbnail is the square JPEG the script draws for the example (compared as pixels: a JPEG decoder may
    differ by a few levels, a stale picture by far more)."""
    from PIL import Image, ImageChops, ImageStat

    drawn = make_workflows.thumbnail(name)
    path = ui_file(name).with_suffix(".jpg")
    assert path.stat().st_size <= 60_000, path.stat().st_size
    with Image.open(path) as shipped:
        assert shipped.format == "JPEG" and shipped.size == drawn.size == (512, 512)
        difference = ImageStat.Stat(ImageChops.difference(shipped.convert("RGB"), drawn)).mean
    assert max(difference) < 4, f"{path.name}: rerun python tests/e2e/make_workflows.py ({difference})"


def test_the_files_are_what_make_workflows_writes():
    assert set(make_workflows.WORKFLOWS) == EXPECTED
    for name, workflow in make_workflows.WORKFLOWS.items():
        stale = "rerun python tests/e2e/make_workflows.py"
        assert load(ui_file(name)) == make_workflows.ui_workflow(workflow), stale
        assert load(api_file(name)) == make_workflows.api_workflow(workflow), stale


# -- the LoRA example runs on the tiny files ------------------------------------------------------------------------


def test_make_tiny_writes_the_lora_the_lora_example_loads(tmp_path, capsys):
    """`make-tiny --comfyui-models` also writes a LoRA in models/loras under the very name the LoRA example loads, and
    the pack reads it as a LoRA for the tiny transformer (every Linear of every block patched), so the example runs as
    shipped on the tiny files. A file of the user's under that name is not replaced without --force."""
    import torch

    from graph_runtime.cli import main
    from graph_runtime.lora.file import read_lora
    from graph_runtime.lora.tiny import BLOCK_LINEARS
    from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer

    api = load(api_file("qwen_image_2.1_lora"))
    lora_name = next(n for n in api.values() if n["class_type"] == "KVGraphLoadLoRA")["inputs"]["lora_name"]
    models = tmp_path / "models"
    assert main(["make-tiny", "--comfyui-models", str(models)]) == 0
    path = models / "loras" / lora_name
    assert f"wrote lora: {path}" in capsys.readouterr().out
    torch.manual_seed(0)
    lora = read_lora(path, random_tiny_transformer())
    expected = {f"transformer_blocks.{b}.{n}.weight" for b in range(TINY_TRANSFORMER["num_layers"])
                for n in BLOCK_LINEARS}
    assert {"img_mlp.gate_layer", "img_mlp.proj"} <= set(BLOCK_LINEARS)  # diffusers' names: core's loaders map them
    assert set(lora.patches) == expected

    users = tmp_path / "users_models" / "loras" / lora_name  # a models/ folder holding only the user's LoRA
    users.parent.mkdir(parents=True)
    users.write_bytes(b"a user's LoRA")
    assert main(["make-tiny", "--comfyui-models", str(users.parent.parent)]) == 2
    assert f"make-tiny output='{users}' is invalid" in capsys.readouterr().err
    assert users.read_bytes() == b"a user's LoRA"


# -- the ControlNet examples run on the tiny files ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen_image_2.1_controlnet", "qwen_image_2.1_controlnet_inpaint"])
def test_make_tiny_writes_the_controlnet_the_controlnet_examples_load(tmp_path, capsys, name):
    """`make-tiny --comfyui-models` writes a Fun ControlNet Union in models/model_patches under the very name the
    ControlNet examples load, and the pack reads it as a net for the tiny transformer."""
    from graph_runtime.cli import main
    from graph_runtime.controlnet import load_fun_controlnet
    from graph_runtime.tiny import random_tiny_transformer

    api = load(api_file(name))
    file_name = next(n for n in api.values()
                     if n["class_type"] == "KVGraphLoadControlNet")["inputs"]["controlnet_name"]
    models = tmp_path / "models"
    assert main(["make-tiny", "--comfyui-models", str(models)]) == 0
    path = models / "model_patches" / file_name
    assert f"wrote controlnet: {path}" in capsys.readouterr().out
    load_fun_controlnet(path).check_base(random_tiny_transformer())
