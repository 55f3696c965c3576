"""The example workflows as ComfyUI templates, in the real frontend (headless Chromium, a real ComfyUI on CPU).

ComfyUI lists a pack's example_workflows/*.json under GET /workflow_templates (by the pack's folder name) and serves
the folder at /api/workflow_templates/<folder>/; the frontend's template browser titles each card by the file's name
and shows `<name>.jpg` beside `<name>.json` as its square thumbnail. Checked here: every example is listed with its
thumbnail served; the template browser shows one card per example, its title whole and its thumbnail loaded, and a
click on a card opens that workflow at its view. Each example opens in a 1600x1000 window (no panel; the minimap on,
as on a new install) with every node inside the canvas, clear of the minimap and the bars; in a 1920x1080 window
with the KV-Graph panel open, with every node right of the panel; every node at least as large as the frontend
needs, no widget's label or value cut short, no title cut short, no note's text scrolled out of sight.

Screenshots of every example in both windows as the template browser opens it, and of the template browser, go to
tests/artifacts/; with KVGRAPH_EXAMPLE_SCREENSHOTS=1 also to docs/examples/ (what docs/examples.md shows).
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
import requests
from browser_ui import DIALOG, MINIMAP, PANEL, RUN_BAR, SIDEBAR, clear_toasts, set_panel
from comfy_server import ui_workflow_path

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.stem for p in (REPO / "example_workflows" / "api").glob("*.json"))
DOCS_EXAMPLES = REPO / "docs" / "examples"
WINDOWS = {"1600x1000": {"width": 1600, "height": 1000}, "1920x1080-panel": {"width": 1920, "height": 1080}}
THUMBNAIL_SIDE = 512
THUMBNAIL_MAX_BYTES = 60_000
BOTTOM_BAR = 40  # the canvas's statistics (bottom left) and zoom toolbar (bottom right)
# The frontend's widget geometry (litegraph BaseWidget: margin 15; combo and number widgets keep 5 px at the left and
# 20 px at the right for their arrows, text widgets none): a widget's label, a 5 px gap and its value must fit.
WIDGET_MARGIN, LABEL_VALUE_GAP = 15, 5
WIDGET_PADDING = {"combo": (5, 20), "number": (5, 20), "text": (0, 0)}


def open_workflow(page, name):
    """Open an example as the template browser does (its view restored from extra.ds), named as its file."""
    path = ui_workflow_path(name)
    page.evaluate("""async ([w, name]) => {
        await window.app.loadGraphData(w, true, true, name);
        await new Promise(r => setTimeout(r, 300));
        window.app.canvas.setDirty(true, true);
    }""", [json.loads(path.read_text()), path.stem])


def drawn_nodes(page) -> dict:
    """Where the frontend draws each node (its title bar and the pack's 20 px badge included) and what it needs, and
    where its overlays are, in page pixels."""
    return page.evaluate("""([padding, margin, gap, selectors]) => {
        const app = window.app, ds = app.canvas.ds;
        const canvas = app.canvas.canvas.getBoundingClientRect();
        const rect = (selector) => {
            const el = document.querySelector(selector);
            if (!el || !el.offsetParent) return null;
            const b = el.getBoundingClientRect();
            return [b.left, b.top, b.right, b.bottom];
        };
        const ctx = app.canvas.canvas.getContext('2d');
        const titleHeight = (window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph).NODE_TITLE_HEIGHT;
        ctx.save();
        ctx.font = app.canvas.inner_text_font;
        const nodes = app.graph.nodes.map(n => {
            const b = n.getBounding();  // [x, y, w, h] with the title bar
            const [left, top] = ds.convertOffsetToCanvas([b[0], b[1] - 20]);
            const [right, bottom] = ds.convertOffsetToCanvas([b[0] + b[2], b[1] + b[3]]);
            const cut = (n.widgets || []).filter(w => w.type in padding).filter(w => {
                const [lp, rp] = padding[w.type];
                const room = (w.width ?? n.size[0]) - (2 * margin + lp) - 2 * margin - rp;
                const text = ctx.measureText(w.displayName ?? w.label ?? w.name).width + gap
                    + ctx.measureText(String(w._displayValue ?? w.value)).width;
                return text > room;
            }).map(w => `${w.name} = ${w.value}`);
            // A note's markdown scrolls inside it when the node is too short for the text.
            const note = n.type === 'MarkdownNote' ? n.widgets[0].element?.querySelector('.ProseMirror') : null;
            const hidden = note ? Array.from(note.children).some(
                c => c.getBoundingClientRect().bottom > note.getBoundingClientRect().bottom + 1) : false;
            // 1.58 cuts a title short where it is wider than the node less twice the title bar's height.
            ctx.font = app.canvas.title_text_font;
            const titleCut = ctx.measureText(n.title).width > n.size[0] - 2 * titleHeight;
            ctx.font = app.canvas.inner_text_font;
            return { title: n.title, size: [...n.size], needs: [...n.computeSize()], cut, hidden, titleCut,
                     box: [left + canvas.left, top + canvas.top, right + canvas.left, bottom + canvas.top] };
        });
        ctx.restore();
        return { scale: ds.scale, offset: [...ds.offset], nodes,
                 canvas: [canvas.left, canvas.top, canvas.right, canvas.bottom],
                 panel: rect(selectors.panel), sidebar: rect(selectors.sidebar), minimap: rect(selectors.minimap),
                 runBar: rect(selectors.runBar) };
    }""", [WIDGET_PADDING, WIDGET_MARGIN, LABEL_VALUE_GAP,
          {"panel": PANEL, "sidebar": SIDEBAR, "minimap": MINIMAP, "runBar": RUN_BAR}])


def overlaps(a, b) -> bool:
    return not (a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1])


def check_nodes(result, workflow):
    assert len(result["nodes"]) == len(workflow["nodes"])
    for node in result["nodes"]:
        assert node["size"][0] >= node["needs"][0] and node["size"][1] >= node["needs"][1], (
            f"{node['title']}: {node['size']} is smaller than the frontend needs ({node['needs']})")
        assert node["cut"] == [], f"{node['title']}: these widgets do not fit its width: {node['cut']}"
        assert not node["hidden"], f"{node['title']}: its text does not fit the note"
        assert not node["titleCut"], f"{node['title']}: the title does not fit the node's width"


def screenshot(page, artifacts, name: str):
    from PIL import Image

    clear_toasts(page)
    page.wait_for_timeout(400)  # let the canvas redraw (and the DOM widgets follow it)
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path))
    if os.environ.get("KVGRAPH_EXAMPLE_SCREENSHOTS") == "1":
        DOCS_EXAMPLES.mkdir(parents=True, exist_ok=True)
        # A palette PNG: the flat UI colours survive 256 colours, at a fraction of the size.
        with Image.open(path) as image:
            image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(
                DOCS_EXAMPLES / path.name, optimize=True)


@pytest.fixture(scope="module")
def window(page):
    """The page as a new install has it: the minimap shown (the frontend's default on wide windows)."""
    page.evaluate("window.app.extensionManager.setting.set('Comfy.Minimap.Visible', true)")
    yield page
    page.set_viewport_size({"width": 1600, "height": 900})


def check_clear(result, panel_open: bool):
    """Every node inside the canvas: right of the sidebar (and of the KV-Graph panel when it is open), below the tab
    and Run bars, above the canvas's bottom bar, and clear of the minimap."""
    _, canvas_top, canvas_right, canvas_bottom = result["canvas"]
    left_edge = result["panel"][2] if panel_open else result["sidebar"][2]
    top_edge = max(canvas_top, result["runBar"][3] if result["runBar"] else 0)
    assert result["minimap"], "the minimap is not shown: the check below would prove nothing"
    for node in result["nodes"]:
        left, top, right, bottom = box = node["box"]
        assert left > left_edge, f"{node['title']} is drawn under the {'panel' if panel_open else 'sidebar'} ({box})"
        assert top > top_edge and right < canvas_right and bottom < canvas_bottom - BOTTOM_BAR, (node["title"], box)
        assert not overlaps(box, result["minimap"]), f"the minimap covers {node['title']} ({box})"


@pytest.mark.parametrize("window_name", WINDOWS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_opens_at_its_view_with_every_node_in_sight(window, artifacts, name, window_name):
    """Opened as a dropped file (and as 1.35's and 1.49's template browsers open it), at its extra.ds: in a
    1600x1000 window every node in the canvas and clear of the minimap; at 1920x1080 every node beside the panel."""
    page = window
    panel_open = window_name.endswith("panel")
    page.set_viewport_size(WINDOWS[window_name])
    set_panel(page, panel_open)
    open_workflow(page, name)
    result = drawn_nodes(page)
    workflow = json.loads(ui_workflow_path(name).read_text())
    assert result["scale"] == workflow["extra"]["ds"]["scale"]
    assert result["offset"] == workflow["extra"]["ds"]["offset"]
    check_nodes(result, workflow)
    check_clear(result, panel_open)
    assert page.errors == []


def test_every_example_is_listed_with_its_thumbnail(comfy, pack_folder):
    from PIL import Image

    listed = comfy.get("/workflow_templates")
    titles = sorted(ui_workflow_path(name).stem for name in EXAMPLES)
    assert sorted(listed[pack_folder]) == titles
    for title in titles:
        jpg = REPO / "example_workflows" / f"{title}.jpg"
        # Where the template browser loads it from (getTemplateThumbnailUrl: no "-1" suffix for a pack's template).
        response = requests.get(f"{comfy.url}/api/workflow_templates/{pack_folder}/{title}.jpg", timeout=30)
        assert response.status_code == 200, title
        assert response.headers["Content-Type"] == "image/jpeg"
        assert response.content == jpg.read_bytes()
        assert 4_000 < len(response.content) <= THUMBNAIL_MAX_BYTES, (title, len(response.content))
        with Image.open(io.BytesIO(response.content)) as image:
            assert image.format == "JPEG" and image.size == (THUMBNAIL_SIDE, THUMBNAIL_SIDE), (title, image.size)


def open_template_browser(page, pack_folder):
    page.evaluate("window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    page.wait_for_selector(DIALOG, timeout=15_000)
    page.locator(DIALOG).get_by_text(pack_folder, exact=True).first.click()


def test_the_template_browser_shows_each_card_with_its_title_and_thumbnail(window, artifacts, pack_folder):
    """The user's view in a 1600x1000 window: Templates, the pack's category, one card per example titled whole by
    its title, with its thumbnail loaded (the frontend fetches each thumbnail and shows it from a blob URL or its
    URL)."""
    page = window
    page.set_viewport_size(WINDOWS["1600x1000"])
    set_panel(page, False)
    titles = [ui_workflow_path(name).stem for name in EXAMPLES]
    fetched = []

    def record(response):
        if f"/workflow_templates/{pack_folder}/" in response.url and response.url.endswith(".jpg"):
            fetched.append((requests.utils.unquote(response.url.rsplit("/", 1)[1]), response.status))

    page.on("response", record)
    try:
        open_template_browser(page, pack_folder)
        # The browser draws the cards in view: every title listed and each thumbnail drawn shown at full size...
        cards = page.wait_for_function("""([selector, titles, side]) => {
            const dialog = document.querySelector(selector);
            if (!dialog) return false;
            const images = Array.from(dialog.querySelectorAll('img'));
            if (!images.length || !images.every(i => i.complete && i.naturalWidth === side)) return false;
            // The element showing each title: the innermost one whose whole text is the title.
            const cards = titles.map(title => Array.from(dialog.querySelectorAll('*')).filter(
                e => e.children.length === 0 && e.textContent.trim() === title)[0]);
            if (cards.some(c => !c)) return false;
            return cards.map(c => ({ title: c.textContent.trim(), whole: c.scrollWidth <= c.clientWidth + 1 }));
        }""", arg=[DIALOG, titles, THUMBNAIL_SIDE], timeout=20_000).json_value()
        page.wait_for_timeout(500)
        screenshot(page, artifacts, "template-browser")
        # ...then scroll through the cards until every thumbnail was fetched, however many fit the window.
        deadline = time.time() + 20
        while {n for n, _ in fetched} < {f"{title}.jpg" for title in titles} and time.time() < deadline:
            page.evaluate("""(selector) => document.querySelectorAll(`${selector} *`).forEach(el => {
                if (el.scrollHeight > el.clientHeight + 4) el.scrollTop += el.clientHeight / 2;
            })""", DIALOG)
            page.wait_for_timeout(300)
    finally:
        page.remove_listener("response", record)
    assert sorted(set(fetched)) == [(f"{title}.jpg", 200) for title in sorted(titles)]
    assert [c for c in cards if not c["whole"]] == [], "titles cut short on their cards"
    # A card opens its workflow and closes the browser (Escape does not close 1.35's).
    page.locator(DIALOG).get_by_text(titles[0], exact=True).first.click()
    page.wait_for_function(f"document.querySelectorAll('{DIALOG}').length === 0", timeout=15_000)
    assert page.errors == []


@pytest.mark.parametrize("window_name", WINDOWS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_opens_from_the_template_browser_with_every_node_in_sight(window, artifacts, pack_folder,
                                                                                name, window_name):
    """A click on the example's card opens it (1.35 and 1.49 at its extra.ds, 1.58 fitted to the window): in a
    1600x1000 window every node in the canvas and clear of the minimap; at 1920x1080 with the panel open every node
    beside the panel (the extension moves a graph the frontend put under it). The screenshots are these views."""
    page = window
    panel_open = window_name.endswith("panel")
    page.set_viewport_size(WINDOWS[window_name])
    set_panel(page, panel_open)
    workflow = json.loads(ui_workflow_path(name).read_text())
    open_template_browser(page, pack_folder)
    page.locator(DIALOG).get_by_text(ui_workflow_path(name).stem, exact=True).first.click()
    page.wait_for_function(f"document.querySelectorAll('{DIALOG}').length === 0", timeout=15_000)
    page.wait_for_function("(n) => window.app.graph.nodes.length === n && window.app.canvas.ds.scale > 0",
                           arg=len(workflow["nodes"]), timeout=15_000)
    page.wait_for_timeout(500)  # the frontend places its view, then the extension moves it clear of the panel
    result = drawn_nodes(page)
    check_nodes(result, workflow)
    check_clear(result, panel_open)
    screenshot(page, artifacts, f"example-{name}-{window_name}")
    assert page.errors == []
