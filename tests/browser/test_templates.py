"""The example workflows as ComfyUI templates, in the real frontend (headless Chromium, a real ComfyUI on CPU).

ComfyUI lists a pack's example_workflows/*.json under GET /workflow_templates (by the pack's folder name) and serves
the folder at /api/workflow_templates/<folder>/; the frontend's template browser shows `<name>.jpg` beside
`<name>.json` as the card's (square) thumbnail. Checked here: every example is listed and has its thumbnail served,
a JPEG of sensible size; each example opens, at 1920x1080 with the KV-Graph panel open, at the view its `extra.ds`
gives, every node drawn beside the panel, every node at least as large as the frontend needs, no widget's label or
value cut short; the template browser shows our cards with their thumbnails.

Each thumbnail is made here, in the frontend: the workflow opened with no panel, the whole graph in view, that part
of the window screenshot, padded to a square with the canvas colour. It is always written to tests/artifacts/; with
KVGRAPH_TEMPLATE_THUMBNAILS=1 also to example_workflows/<name>.jpg.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "example_workflows").glob("*.json"))
WINDOW = {"width": 1920, "height": 1080}  # the window the examples' views are made for (tests/e2e/workflow_layout.py)
THUMBNAIL_SIDE = 512
THUMBNAIL_QUALITY = 80
THUMBNAIL_MAX_BYTES = 60_000
CANVAS_COLOUR = (32, 32, 32)  # what the square is padded with; close to the dark theme's canvas
# The frontend's widget geometry (litegraph BaseWidget: margin 15; combo and number widgets keep 5 px at the left and
# 20 px at the right for their arrows, text widgets none): a widget's label, a 5 px gap and its value must fit.
WIDGET_MARGIN, LABEL_VALUE_GAP = 15, 5
WIDGET_PADDING = {"combo": (5, 20), "number": (5, 20), "text": (0, 0)}


@pytest.fixture(scope="module")
def window(page):
    page.set_viewport_size(WINDOW)
    page.evaluate("window.app.extensionManager.setting.set('Comfy.Minimap.Visible', false)")
    return page


def open_workflow(page, path):
    """Open an example as the template browser does (its view restored from extra.ds), named as its file."""
    page.evaluate("""async ([w, name]) => {
        await window.app.loadGraphData(w, true, true, name);
        await new Promise(r => setTimeout(r, 300));
        window.app.canvas.setDirty(true, true);
    }""", [json.loads(path.read_text()), path.stem])


def set_panel(page, visible: bool):
    if page.locator(".kvgraph-panel").is_visible() != visible:
        page.click(".kvgraph-status-tab-button")
    if visible:
        page.wait_for_selector(".kvgraph-panel", state="visible", timeout=10_000)
    else:
        page.wait_for_selector(".kvgraph-panel", state="detached", timeout=10_000)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_opens_with_the_whole_graph_beside_the_panel(window, path):
    page = window
    set_panel(page, True)
    open_workflow(page, path)
    workflow = json.loads(path.read_text())
    result = page.evaluate("""([padding, margin, gap]) => {
        const app = window.app, ds = app.canvas.ds;
        const canvas = app.canvas.canvas.getBoundingClientRect();
        const panel = document.querySelector('.kvgraph-panel').getBoundingClientRect();
        const ctx = app.canvas.canvas.getContext('2d');
        ctx.save();
        ctx.font = app.canvas.inner_text_font;
        const nodes = app.graph.nodes.map(n => {
            const b = n.getBounding();  // [x, y, w, h] with the title bar
            const [left, top] = ds.convertOffsetToCanvas([b[0], b[1]]);
            const [right, bottom] = ds.convertOffsetToCanvas([b[0] + b[2], b[1] + b[3]]);
            const cut = (n.widgets || []).filter(w => w.type in padding).filter(w => {
                const [lp, rp] = padding[w.type];
                const room = (w.width ?? n.size[0]) - (2 * margin + lp) - 2 * margin - rp;
                const text = ctx.measureText(w.displayName ?? w.label ?? w.name).width + gap
                    + ctx.measureText(String(w._displayValue ?? w.value)).width;
                return text > room;
            }).map(w => `${w.name} = ${w.value}`);
            return { title: n.title, size: [...n.size], needs: [...n.computeSize()],
                     box: [left + canvas.left, top + canvas.top, right + canvas.left, bottom + canvas.top], cut };
        });
        ctx.restore();
        return { scale: ds.scale, offset: [...ds.offset], panelRight: panel.right,
                 canvas: [canvas.left, canvas.top, canvas.right, canvas.bottom], nodes };
    }""", [WIDGET_PADDING, WIDGET_MARGIN, LABEL_VALUE_GAP])
    assert result["scale"] == workflow["extra"]["ds"]["scale"]
    assert result["offset"] == workflow["extra"]["ds"]["offset"]
    assert len(result["nodes"]) == len(workflow["nodes"])
    _, canvas_top, canvas_right, canvas_bottom = result["canvas"]
    for node in result["nodes"]:
        left, top, right, bottom = node["box"]
        assert left > result["panelRight"], f"{node['title']} is drawn under the panel (x {left:.0f})"
        assert top > canvas_top + 60 and right < canvas_right and bottom < canvas_bottom, (node["title"], node["box"])
        assert node["size"][0] >= node["needs"][0] and node["size"][1] >= node["needs"][1], (
            f"{node['title']}: {node['size']} is smaller than the frontend needs ({node['needs']})")
        assert node["cut"] == [], f"{node['title']}: these widgets do not fit its width: {node['cut']}"
    assert page.errors == []


def fit_whole_graph(page, margin: int = 8) -> dict:
    """Show every node (titles and badges included) as large as the window allows clear of the frontend's overlays
    (the tab and Run bars on top, the canvas info and toolbar at the bottom); returns the graph's rectangle on the
    page, `margin` around it."""
    return page.evaluate("""(margin) => {
        const app = window.app, ds = app.canvas.ds;
        const canvas = app.canvas.canvas.getBoundingClientRect();
        const boxes = app.graph.nodes.map(n => n.getBounding());
        const badge = 20;
        const x0 = Math.min(...boxes.map(b => b[0])), y0 = Math.min(...boxes.map(b => b[1])) - badge;
        const x1 = Math.max(...boxes.map(b => b[0] + b[2])), y1 = Math.max(...boxes.map(b => b[1] + b[3]));
        const top = 100, left = 70, right = 16, bottom = 90;
        const width = canvas.width - left - right, height = canvas.height - top - bottom;
        ds.scale = Math.min(width / (x1 - x0), height / (y1 - y0));
        ds.offset[0] = left / ds.scale - x0;
        ds.offset[1] = top / ds.scale - y0;
        app.canvas.setDirty(true, true);
        return { x: canvas.left + left - margin, y: canvas.top + top - margin,
                 width: (x1 - x0) * ds.scale + 2 * margin, height: (y1 - y0) * ds.scale + 2 * margin };
    }""", margin)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_thumbnail(window, artifacts, path):
    from PIL import Image

    page = window
    set_panel(page, False)
    open_workflow(page, path)
    page.evaluate("window.app.extensionManager.toast.removeAll()")
    clip = fit_whole_graph(page)
    page.wait_for_timeout(400)  # let the canvas redraw (and the DOM widgets follow it)
    shot = artifacts / f"template-{path.stem}.png"
    page.screenshot(path=str(shot), clip=clip)
    with Image.open(shot) as image:
        graph = image.convert("RGB")
    side = max(graph.size)
    square = Image.new("RGB", (side, side), CANVAS_COLOUR)
    square.paste(graph, ((side - graph.width) // 2, (side - graph.height) // 2))
    thumbnail = square.resize((THUMBNAIL_SIDE, THUMBNAIL_SIDE), Image.LANCZOS)
    out = artifacts / f"template-{path.stem}.jpg"
    thumbnail.save(out, "JPEG", quality=THUMBNAIL_QUALITY, optimize=True)
    assert out.stat().st_size <= THUMBNAIL_MAX_BYTES, out.stat().st_size
    if os.environ.get("KVGRAPH_TEMPLATE_THUMBNAILS") == "1":
        path.with_suffix(".jpg").write_bytes(out.read_bytes())
    assert page.errors == []


def test_every_example_is_listed_with_its_thumbnail(comfy, pack_folder):
    from PIL import Image

    listed = comfy.get("/workflow_templates")
    assert sorted(listed[pack_folder]) == [p.stem for p in EXAMPLES]
    for path in EXAMPLES:
        jpg = path.with_suffix(".jpg")
        assert jpg.is_file(), f"{jpg.name} missing: KVGRAPH_TEMPLATE_THUMBNAILS=1 python -m pytest -m browser {__file__}"
        # Where the template browser loads it from (getTemplateThumbnailUrl: no "-1" suffix for a pack's template).
        response = requests.get(f"{comfy.url}/api/workflow_templates/{pack_folder}/{path.stem}.jpg", timeout=30)
        assert response.status_code == 200, path.stem
        assert response.headers["Content-Type"] == "image/jpeg"
        assert response.content == jpg.read_bytes()
        assert 4_000 < len(response.content) <= THUMBNAIL_MAX_BYTES, (path.stem, len(response.content))
        with Image.open(io.BytesIO(response.content)) as image:
            image.verify()
        with Image.open(io.BytesIO(response.content)) as image:
            assert image.format == "JPEG" and image.size == (THUMBNAIL_SIDE, THUMBNAIL_SIDE), (path.stem, image.size)


def test_the_template_browser_shows_the_cards_and_opens_one_at_its_view(window, pack_folder):
    """The user's view: Templates, the pack's category, one card per example with its thumbnail loaded (the frontend
    fetches each thumbnail and shows it from a blob URL); a click on a card opens that workflow at its extra.ds."""
    page = window
    fetched = []

    def record(response):
        if f"/workflow_templates/{pack_folder}/" in response.url and response.url.endswith(".jpg"):
            fetched.append((response.url.rsplit("/", 1)[1], response.status))

    page.on("response", record)
    try:
        page.evaluate("window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
        page.wait_for_selector(".p-dialog", timeout=15_000)
        page.locator(".p-dialog").get_by_text(pack_folder, exact=True).first.click()
        names = [p.stem for p in EXAMPLES]
        # The browser draws the cards in view: scroll through them until every thumbnail was fetched and every card
        # drawn shows its thumbnail at full size.
        page.wait_for_function("""([names, side]) => {
            const dialog = document.querySelector('.p-dialog');
            if (!dialog || !names.every(name => dialog.innerText.includes(name))) return false;
            const images = Array.from(dialog.querySelectorAll('img'));
            return images.length > 0 && images.every(i => i.complete && i.naturalWidth === side);
        }""", arg=[names, THUMBNAIL_SIDE], timeout=20_000)
        deadline = time.time() + 20
        while {n for n, _ in fetched} < {f"{name}.jpg" for name in names} and time.time() < deadline:
            page.evaluate("""() => document.querySelectorAll('.p-dialog *').forEach(el => {
                if (el.scrollHeight > el.clientHeight + 4) el.scrollTop += el.clientHeight / 2;
            })""")
            page.wait_for_timeout(300)
    finally:
        page.remove_listener("response", record)
    assert sorted(set(fetched)) == [(f"{name}.jpg", 200) for name in sorted(names)]
    chosen = REPO / "example_workflows" / "qwen_image_2.1_edit_two_references.json"
    page.locator(".p-dialog").get_by_text(chosen.stem, exact=True).first.click()
    page.wait_for_function("document.querySelectorAll('.p-dialog').length === 0", timeout=15_000)
    page.wait_for_function("(n) => window.app.graph.nodes.length === n", arg=len(json.loads(chosen.read_text())["nodes"]),
                           timeout=15_000)
    view = page.evaluate("({scale: window.app.canvas.ds.scale, offset: [...window.app.canvas.ds.offset]})")
    assert view == json.loads(chosen.read_text())["extra"]["ds"]
    assert page.errors == []
