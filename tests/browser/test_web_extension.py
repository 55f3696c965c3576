"""The KV-Graph web extension in ComfyUI's real frontend, in headless Chromium against a real ComfyUI on CPU.

The tests share one page and run in file order (the run test feeds the panel the later ones look at): the extension
registers its tab, commands, setting and badge; every example workflow loads with all node types known; the panel
shows what GET /kvgraph/status says, before and after a real tiny prompt, with the websocket phases of that run; the
release command posts from the panel and from the menu; the fallback-toast setting silences toasts.

A screenshot of the text-to-image workflow with the panel open is saved to tests/artifacts/; with
KVGRAPH_DOCS_SCREENSHOT=1 it is also written, resized, to docs/sampler-workflow.png for the README, and with
KVGRAPH_DOCS_STATUS=FILE the panel in it shows the status payload in FILE (a GPU run's) instead of this CPU run's.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from comfy_server import ui_workflow_path
from browser_ui import DIALOG, MENU_BUTTON, PANEL, TOAST, clear_toasts, set_panel, toast_texts, wait_for_toast

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]

EXAMPLES = sorted((REPO / "example_workflows").glob("*.json"))
TEXT_TO_IMAGE = ui_workflow_path("qwen_image_2.1_text_to_image")
TRANSFORMER_FILE = "qwen_image_2.1_int8_convrot.safetensors"  # the example workflows load the INT8 file
DOCS_SCREENSHOT = REPO / "docs" / "sampler-workflow.png"
DOCS_WINDOW = {"width": 1920, "height": 1080}  # the window the examples' views are made for
VIEWPORT = {"width": 1600, "height": 900}  # the page fixture's (tests/browser/conftest.py)
STATUS_ROUTE_GLOB = "**/kvgraph/status"


def open_panel(page):
    set_panel(page, True)
    page.wait_for_selector(f"{PANEL} .kvgraph-totals", timeout=15_000)


def wait_refreshed(page):
    page.wait_for_function("""() => {
        const el = document.querySelector('.kvgraph-updated');
        return el && el.textContent.startsWith('updated');
    }""", timeout=15_000)


def stat(page, name: str) -> str:
    return page.inner_text(f".kvgraph-stat[data-stat={name}] .kvgraph-value").strip()




def close_dialogs(page):
    page.keyboard.press("Escape")
    page.wait_for_function(f"document.querySelectorAll('{DIALOG}').length === 0", timeout=10_000)


def test_extension_registers_tab_commands_setting_and_badge(page):
    info = page.evaluate("""() => {
        const app = window.app, m = app.extensionManager;
        const ext = app.extensions.find(e => e.name === 'kvgraph.panel');
        return {
            names: app.extensions.map(e => e.name),
            tabs: m.getSidebarTabs().map(t => t.id),
            commands: m.command.commands.map(c => c.id),
            setting: m.setting.get('KVGraph.FallbackToasts'),
            badges: ext ? ext.aboutPageBadges : null,
            menu: ext ? ext.menuCommands : null,
        };
    }""")
    assert "kvgraph.panel" in info["names"]
    assert "kvgraph-status" in info["tabs"]
    assert {"KVGraph.ReleaseCaches", "KVGraph.ShowPanel"} <= set(info["commands"])
    assert info["setting"] is True  # default on
    assert info["menu"] == [{"path": ["Extensions", "KV-Graph"],
                             "commands": ["KVGraph.ShowPanel", "KVGraph.ReleaseCaches"]}]
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert info["badges"][0]["label"] == f"KV-Graph v{version}"
    assert page.errors == []


def test_show_panel_command_toggles_the_tab(page):
    page.evaluate("window.app.extensionManager.command.execute('KVGraph.ShowPanel')")
    page.wait_for_selector(PANEL, state="visible", timeout=10_000)
    page.evaluate("window.app.extensionManager.command.execute('KVGraph.ShowPanel')")
    page.wait_for_selector(PANEL, state="detached", timeout=10_000)


def test_about_page_shows_the_badge(page):
    page.evaluate("window.app.extensionManager.command.execute('Comfy.Help.AboutComfyUI')")
    page.wait_for_selector(".about-container", timeout=15_000)
    assert "KV-Graph v" in page.inner_text(".about-container")
    close_dialogs(page)


def test_panel_shows_route_status_and_a_real_run(page, comfy, artifacts):
    from comfy_server import load_api_workflow

    # The user's view: the example workflow open (named as its file), then the panel. Before any prompt the real
    # route holds nothing and the panel says so.
    page.evaluate("async ([w, name]) => { await window.app.loadGraphData(w, true, true, name); }",
                  [json.loads(TEXT_TO_IMAGE.read_text()), TEXT_TO_IMAGE.stem])
    assert comfy.status()["models"] == []
    open_panel(page)
    wait_refreshed(page)
    assert page.locator(".kvgraph-models .kvgraph-empty").is_visible()
    assert stat(page, "entries") == "0" and stat(page, "models") == "0" and stat(page, "bytes") == "0 B"

    # One tiny prompt through the HTTP API: the page hears its kvgraph.status events over the websocket.
    clear_toasts(page)
    # Toasts live 6 s from the step that raised them, and a slow run outlasts that: record every toast shown while
    # the prompt runs, to check them afterwards.
    page.evaluate("""(selector) => { window.kvgraphToasts = []; new MutationObserver(() => {
        for (const t of document.querySelectorAll(selector))
            if (!window.kvgraphToasts.includes(t.innerText)) window.kvgraphToasts.push(t.innerText);
    }).observe(document.body, {childList: true, subtree: true, characterData: true}); }""", TOAST)
    prompt = load_api_workflow("qwen_image_2.1_text_to_image", seed=int(time.time()) % 100_000)
    # Queued for this page's websocket client: the pack sends a prompt's events to its own client only.
    prompt_id = comfy.queue_ok(prompt, client_id=page.evaluate("sessionStorage.getItem('clientId') || window.name"))
    page.wait_for_selector(".kvgraph-phases li[data-phase=done]", timeout=120_000)
    comfy.wait(prompt_id)
    status = comfy.status()
    model = next(m for m in status["models"] if (m["source"] or "").endswith(TRANSFORMER_FILE))
    eager_total = sum(m["eager_total"] for m in status["models"])
    # The panel fetches the route again when the run's `done` event arrives; wait for that fetch to land.
    page.wait_for_function("""(n) => document.querySelector(
        '.kvgraph-stat[data-stat=eager] .kvgraph-value')?.textContent === String(n)""", arg=eager_total,
                           timeout=15_000)

    # Totals and the model card match the route.
    assert stat(page, "models") == str(len(status["models"]))
    assert stat(page, "captures") == str(model["captures"])
    assert stat(page, "replays") == str(model["replays"])
    assert page.inner_text(".kvgraph-model .kvgraph-card-title") == TRANSFORMER_FILE
    card = page.inner_text(".kvgraph-model")
    assert f"{model['eager_total']} eager" in card and f"/{model['max_entries']} entries" in card
    # No prefill ran from a graph entry on this CPU run: the card has no prefill line.
    assert model["prefill_replays"] == model["prefill_captures"] == 0
    assert page.locator(".kvgraph-model .kvgraph-prefills").count() == 0
    if model["entries"]:  # on CPU nothing is captured, so the card says so instead
        assert page.locator(".kvgraph-model .kvgraph-entry").count() == len(model["entries"])
    else:
        assert page.locator(".kvgraph-model .kvgraph-no-entries").is_visible()
    for reason, steps in model["eager_steps"].items():
        assert f"{reason}: {steps}" in card
    assert TRANSFORMER_FILE in page.inner_text(".kvgraph-loaded")

    # The last run: this prompt's phases, in order, ending with its summary.
    run = page.inner_text(".kvgraph-last-run")
    assert f"prompt {prompt_id.split('-')[0]}" in run
    phases = page.evaluate("Array.from(document.querySelectorAll('.kvgraph-phases li')).map(li => li.dataset.phase)")
    assert phases[0] == "prefill" and phases[-1] == "done"
    if "no CUDA" in model["eager_steps"]:
        assert "fallback" in phases and "no CUDA" in run
        # ...and the fallback toast named the reason (the setting is on by default).
        toasts = page.evaluate("window.kvgraphToasts")
        assert any("decoding eagerly" in t and "no CUDA" in t for t in toasts), toasts
    page.screenshot(path=str(artifacts / "browser-panel-after-run.png"))
    assert page.errors == []


def test_screenshot_of_the_sampler_workflow(page, artifacts, pack_folder):
    """The README's picture: the text-to-image example (loaded by the run test) at the view it opens with, in the
    1920x1080 window that view is made for, beside the open panel showing that run. With KVGRAPH_DOCS_STATUS=FILE
    the panel shows FILE instead (see serve_docs_status)."""
    open_panel(page)
    assert page.evaluate("window.app.graph.nodes.some(n => n.type === 'KVGraphSampler')")
    page.set_viewport_size(DOCS_WINDOW)
    docs_status = os.environ.get("KVGRAPH_DOCS_STATUS")
    try:
        if docs_status:
            serve_docs_status(page, pack_folder, json.loads(Path(docs_status).read_text()))
        page.evaluate("""async (ds) => {
            const app = window.app;
            await app.extensionManager.setting.set('Comfy.Minimap.Visible', true);  // as on a new install
            app.canvas.ds.scale = ds.scale;
            app.canvas.ds.offset = [...ds.offset];
            app.canvas.setDirty(true, true);
        }""", json.loads(TEXT_TO_IMAGE.read_text())["extra"]["ds"])
        clear_toasts(page)
        page.wait_for_timeout(500)  # let the canvas redraw
        path = artifacts / "sampler-workflow.png"
        page.screenshot(path=str(path))
        if os.environ.get("KVGRAPH_DOCS_SCREENSHOT") == "1":
            write_docs_screenshot(path)
    finally:
        if docs_status:
            page.unroute(STATUS_ROUTE_GLOB)
            page.evaluate("async (pack) => (await import(`/extensions/${pack}/kvgraph.js`)).store.refresh()",
                          pack_folder)
        page.set_viewport_size(VIEWPORT)


def serve_docs_status(page, pack_folder, payload):
    """Make the panel show `payload` (what GET /kvgraph/status answers, e.g. the GPU node test's
    KVGRAPH_STATUS_DUMP): the page's requests for the route get it, and its optional `last_run` list (the
    `kvgraph.status` websocket events of one sampler run) replaces the panel's last run; without one the panel says
    it has seen no run, rather than show this CPU run's events beside another machine's numbers."""
    last_run = payload.pop("last_run", None) or []
    body = json.dumps(payload)
    page.route(STATUS_ROUTE_GLOB, lambda route: route.fulfill(status=200, content_type="application/json", body=body))
    page.evaluate("""async ([pack, events]) => {
        const { store } = await import(`/extensions/${pack}/kvgraph.js`);
        store.lastRun = null;
        const api = window.comfyAPI.api.api;
        for (const detail of events) api.dispatchEvent(new CustomEvent('kvgraph.status', { detail }));
        await store.refresh();
    }""", [pack_folder, last_run])
    replays = sum(m.get("replays", 0) for m in payload.get("models", []) if not m.get("error"))
    page.wait_for_function("""(n) => document.querySelector(
        '.kvgraph-stat[data-stat=replays] .kvgraph-value')?.textContent === String(n)""", arg=replays, timeout=15_000)


def write_docs_screenshot(source):
    """Copy the screenshot to docs/, as a palette PNG (the flat UI colours survive 256 colours, at a fraction of the
    size), halving it only if it is still over the README's 400 KB budget."""
    from PIL import Image

    DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
    image = Image.open(source).convert("RGB")
    while True:
        image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(DOCS_SCREENSHOT, optimize=True)
        if DOCS_SCREENSHOT.stat().st_size < 400_000:
            break
        image = image.resize((image.width * 3 // 4, image.height * 3 // 4), Image.LANCZOS)


def test_release_from_the_panel_button(page, comfy):
    open_panel(page)
    clear_toasts(page)
    with page.expect_request(lambda r: r.url.endswith("/kvgraph/release") and r.method == "POST") as request:
        page.get_by_test_id("kvgraph-release").click()
    assert json.loads(request.value.post_data) == {"models": False}
    wait_for_toast(page, "KV-Graph caches released")
    released = " ".join(toast_texts(page))
    assert f"{TRANSFORMER_FILE}: released" in released
    status = comfy.status()
    assert status["models"] and all(m["entries"] == [] for m in status["models"])
    wait_refreshed(page)
    assert stat(page, "entries") == "0" and stat(page, "bytes") == "0 B"


def test_release_command_from_the_menu(page, comfy):
    clear_toasts(page)
    page.click(MENU_BUTTON)
    # The submenus' items (1.58 has a second "Extensions" item, a plain one).
    submenu = page.locator("[aria-haspopup]")
    page.get_by_role("menuitem", name="Extensions", exact=True).and_(submenu).hover()
    page.get_by_role("menuitem", name="KV-Graph", exact=True).and_(submenu).hover()
    with page.expect_request(lambda r: r.url.endswith("/kvgraph/release") and r.method == "POST") as request:
        page.get_by_role("menuitem", name="Release KV-Graph caches").click()
    assert json.loads(request.value.post_data) == {"models": False}
    wait_for_toast(page, "KV-Graph caches released")
    assert all(m["entries"] == [] for m in comfy.status()["models"])
    assert page.errors == []


def test_fallback_toast_setting_silences_toasts(page):
    """Synthetic fallback events (the real one was seen in the run test): off means no toast, on means one."""
    def fallback(reason):
        page.evaluate("""(reason) => window.comfyAPI.api.api.dispatchEvent(new CustomEvent('kvgraph.status', {detail:
            {phase: 'fallback', prompt_id: 'synthetic-prompt', node: '99', branch: 'cond', reason}}))""", reason)

    clear_toasts(page)
    page.evaluate("window.app.extensionManager.setting.set('KVGraph.FallbackToasts', false)")
    fallback("silenced reason")
    page.wait_for_timeout(700)
    assert not any("silenced reason" in t for t in toast_texts(page))
    page.evaluate("window.app.extensionManager.setting.set('KVGraph.FallbackToasts', true)")
    fallback("shown reason")
    wait_for_toast(page, "shown reason")
    # Both events still reach the panel's last-run list, toast or not.
    run = page.inner_text(".kvgraph-last-run")
    assert "silenced reason" in run and "shown reason" in run


def test_panel_renders_graph_entries(page, pack_folder):
    """Graph entries only exist on CUDA; render a payload shaped like the route's (a captured and a failed entry)
    with the panel's own modules, on a stub api, to check what the CPU run cannot show."""
    text = page.evaluate("""async (pack) => {
        const { StatusStore } = await import(`/extensions/${pack}/status_store.js`);
        const { StatusPanel } = await import(`/extensions/${pack}/status_panel.js`);
        const key = { branch: 'cond', batch: 1, prefix_tokens: 1100, target_tokens: 4096,
                      image_shapes: [[1, 32, 32], [1, 64, 64]], dtype: 'torch.bfloat16', device: 'cuda:0',
                      backend: 'sdpa' };
        const payload = { models: [{ engine_id: 'abc', model: 'QwenImage21Transformer2DModel',
            source: '/m/diffusion_models/qwen_image_2.1_bf16.safetensors', dtype: 'bf16', device: 'cuda:0',
            loads: 1, busy: true, captures: 1, replays: 38, eager_steps: { 'owned by another request': 39 },
            eager_total: 39, evictions: 0, bytes_held: 3 * 2 ** 30, max_entries: 4, compiled: false, skipped_steps: 5,
            prefill_replays: 12, prefill_captures: 1, eager_prefills: { 'long prefix': 2 },
            budget: { total_bytes: 15 * 2 ** 30, plan: { fits: true, whole: false, blocks: 32, resident_blocks: 26,
                streamed_blocks: 6, prefix_placement: 'host', text_encoder: 'cpu', vae_decode: 'tiled',
                gpu_bytes: 15 * 2 ** 30, step_ms: 262.4 } },
            attention_requested: 'fp8', attention: { 'cuda:0 bfloat16': 'fa3' },
            attention_fallbacks: { 'FP8 attention runs in bf16: this FlashAttention-3 build has no FP8 forward': 1 },
            prefix_placements: { gpu: 12, host: 1, recompute: 2 },
            entries: [
                { key, state: 'captured', captures: 1, replays: 38, bytes: 3 * 2 ** 30, owner_alive: true },
                { key: { ...key, prefix_placement: 'host' }, state: 'captured', captures: 1, replays: 3,
                  bytes: 2 ** 30, host_bytes: 20 * 2 ** 30, owner_alive: false },
                { key: { ...key, branch: 'uncond' }, state: 'failed', reason: 'allocation failed',
                  detail: 'CUDA out of memory' },
            ] }],
            loaded: [], running: [{ prompt_id: 'a1b2c3d4-0000', node: '5', step: 7, total: 40 }] };
        let fetches = 0;
        const api = { fetchApi: async () => { fetches += 1; return { ok: true, json: async () => payload }; } };
        const store = new StatusStore(api);
        const panel = new StatusPanel(store, async () => {});
        const div = document.createElement('div');
        document.body.appendChild(div);
        panel.mount(div);
        panel.mount(div);  // the frontend may call render() again with the same element
        await store.refresh();
        const out = { text: div.innerText, panels: div.querySelectorAll('.kvgraph-panel').length,
                      states: Array.from(div.querySelectorAll('.kvgraph-entry')).map(e => e.dataset.state) };
        // A run is listed, so the open panel polls the route; once unmounted it stops.
        const before = fetches;
        await new Promise(r => setTimeout(r, 1800));
        out.polled = fetches - before;
        panel.unmount();
        div.remove();
        const after = fetches;
        await new Promise(r => setTimeout(r, 1800));
        out.afterUnmount = fetches - after;
        return out;
    }""", pack_folder)
    assert text["panels"] == 1
    assert text["polled"] >= 1 and text["afterUnmount"] == 0
    assert text["states"] == ["captured", "captured", "failed"]
    body = text["text"]
    assert "cond · batch 1 · 1100 prefix + 4096 target tokens" in body
    assert "cond 32×32; target 64×64 · torch.bfloat16 · cuda:0 · sdpa" in body
    assert "1 captures · 38 replays · 3.0 GiB · owner alive (in use)" in body
    assert "failed: allocation failed (CUDA out of memory)" in body
    assert "owned by another request: 39" in body
    assert ("Memory plan: 26/32 blocks resident, 6 streamed · prefix host · text encoder cpu · VAE decode tiled · "
            "15 GiB GPU · step ~262 ms (estimate)") in body
    assert "39 eager · 5 skipped (step cache) · " in body and "Skipped steps" in body
    assert "prefills: 12 replayed · 1 captured · 2 eager (long prefix: 2)" in body
    assert "prefix K/V: gpu 12 · host 1 · recompute (no prefix cache, eager) 2" in body
    assert "cuda:0 · sdpa · prefix host" in body
    assert "1 captures · 3 replays · 1.0 GiB · 20 GiB pinned on the host · owner released" in body
    assert "prompt a1b2c3d4 · node 5 · step 7/40" in body
    assert "attention fp8 (runs fa3)" in body
    assert "attention fallback: FP8 attention runs in bf16: this FlashAttention-3 build has no FP8 forward: 1" in body
    assert re.search(r"Held\s+3\.0 GiB", body)
    assert page.errors == []
    assert not [m for m in page.kv_console if m.startswith("error")], page.kv_console


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_workflow_loads_without_missing_nodes(page, path):
    result = page.evaluate("""async (workflow) => {
        const app = window.app;
        const LiteGraph = window.LiteGraph ?? window.comfyAPI?.litegraph?.LiteGraph;
        // Spy on the frontend's own missing-node / missing-model reporting (it opens a dialog when they fire).
        const calls = [];
        const saved = [app.showMissingNodesError, app.showMissingModelsError];
        app.showMissingNodesError = (...a) => { calls.push(['nodes', a]); return saved[0].apply(app, a); };
        app.showMissingModelsError = (...a) => { calls.push(['models', a]); return saved[1].apply(app, a); };
        try {
            await app.loadGraphData(workflow);
        } finally {
            [app.showMissingNodesError, app.showMissingModelsError] = saved;
        }
        await new Promise(r => setTimeout(r, 300));  // a dialog opens asynchronously
        const nodes = app.graph.nodes;
        return {
            count: nodes.length,
            unknown: nodes.filter(n => !(n.type in LiteGraph.registered_node_types)).map(n => n.type),
            errored: nodes.filter(n => n.has_errors).map(n => n.type),
            calls: calls.map(c => c[0]),
            dialogs: Array.from(document.querySelectorAll('[role=dialog]')).map(d => d.innerText.slice(0, 200)),
            samplers: nodes.filter(n => ['KVGraphSampler', 'KSampler', 'SamplerCustomAdvanced'].includes(n.type)).length,
        };
    }""", json.loads(path.read_text()))
    assert result["count"] == len(json.loads(path.read_text())["nodes"])
    assert result["unknown"] == [] and result["errored"] == []
    assert result["calls"] == [], f"the frontend reported missing nodes or models: {result['calls']}"
    assert result["dialogs"] == []
    assert result["samplers"] == 1
    assert page.errors == []


def test_a_workflow_saved_before_the_attention_input_loads_with_auto(page):
    """A UI workflow whose transformer loader has no `attention` value (saved before the input existed) loads without
    errors, its loader's attention widget at `auto` and its other widgets as saved, and the prompt the frontend makes
    from it sends `attention: auto` (which the e2e tests run)."""
    workflow = json.loads(TEXT_TO_IMAGE.read_text())
    loader = next(n for n in workflow["nodes"] if n["type"] == "KVGraphLoadTransformer")
    assert loader["widgets_values"][-1] == "auto"
    loader["widgets_values"] = loader["widgets_values"][:-1]  # as saved before the input existed
    result = page.evaluate("""async (workflow) => {
        const app = window.app;
        await app.loadGraphData(workflow);
        const node = app.graph.nodes.find(n => n.type === 'KVGraphLoadTransformer');
        const { output } = await app.graphToPrompt();
        return { widgets: Object.fromEntries(node.widgets.map(w => [w.name, w.value])), errored: node.has_errors,
                 inputs: output[String(node.id)].inputs };
    }""", workflow)
    assert result["widgets"]["attention"] == "auto" and not result["errored"]
    assert {k: result["inputs"][k] for k in ("precision", "gpus", "attention")} == {
        "precision": "auto", "gpus": 1, "attention": "auto"}
    assert page.errors == []


def test_opening_the_panel_moves_a_graph_out_from_under_it(page):
    """A graph drawn where the panel opens (a view saved for another window, or a template the frontend fitted to the
    whole window) moves right of the panel when it opens, at the same scale where it fits there; with the setting
    off it stays where it was. Nodes are compared as drawn, title bars included."""
    measure = """() => {
        const app = window.app, ds = app.canvas.ds, canvas = app.canvas.canvas.getBoundingClientRect();
        const left = Math.min(...app.graph.nodes.map(n => (n.getBounding()[0] + ds.offset[0]) * ds.scale));
        const panel = document.querySelector('[data-testid=kvgraph-panel]');
        return { left: left + canvas.left, scale: ds.scale, panelRight: panel ? panel.getBoundingClientRect().right : null };
    }"""
    page.set_viewport_size(DOCS_WINDOW)
    try:
        for keep_beside in (False, True):
            set_panel(page, False)
            page.evaluate("""async ([w, on]) => {
                const app = window.app;
                await app.extensionManager.setting.set('KVGraph.KeepGraphBesidePanel', on);
                await app.loadGraphData(w, true, true, 'moved');
                app.canvas.ds.offset[0] -= 300 / app.canvas.ds.scale;  // the loaders where the panel will be
                app.canvas.setDirty(true, true);
            }""", [json.loads(TEXT_TO_IMAGE.read_text()), keep_beside])
            before = page.evaluate(measure)
            set_panel(page, True)
            page.wait_for_timeout(300)  # the extension waits for the frontend to place its view
            after = page.evaluate(measure)
            assert before["left"] < after["panelRight"]
            if keep_beside:
                assert after["left"] > after["panelRight"] and after["scale"] == before["scale"], (before, after)
            else:
                assert after == {**before, "panelRight": after["panelRight"]}
    finally:
        page.evaluate("window.app.extensionManager.setting.set('KVGraph.KeepGraphBesidePanel', true)")
        page.set_viewport_size(VIEWPORT)
    assert page.errors == []


def test_view_beside_panel_shrinks_only_what_does_not_fit(page, pack_folder):
    """The rule itself (panel_view.js): a graph clear of the panel is left alone; one under it moves right at its
    scale when it fits, and is shrunk to the room when it does not, down to MIN_SCALE and no further."""
    out = page.evaluate("""async (pack) => {
        const { viewBesidePanel, MARGIN, MIN_SCALE } = await import(`/extensions/${pack}/panel_view.js`);
        const bounds = [0, -50, 1000, 700];  // a graph 1000 x 750 canvas units
        return { MARGIN, MIN_SCALE,
            clear: viewBesidePanel(bounds, 1, [500, 100], 430, 1920),
            moved: viewBesidePanel(bounds, 1, [100, 100], 430, 1920),
            shrunk: viewBesidePanel(bounds, 1, [100, 100], 430, 1200),
            tooSmall: viewBesidePanel(bounds, 1, [100, 100], 430, 900) };
    }""", pack_folder)
    margin = out["MARGIN"]
    assert out["clear"] is None
    assert out["moved"]["scale"] == 1 and out["moved"]["offset"][0] == 430 + margin
    assert out["moved"]["offset"][1] == 100  # the vertical middle stays where it was
    shrunk = out["shrunk"]
    assert shrunk["scale"] == pytest.approx((1200 - 430 - 2 * margin) / 1000)
    assert shrunk["offset"][0] * shrunk["scale"] == pytest.approx(430 + margin)
    assert (325 + shrunk["offset"][1]) * shrunk["scale"] == pytest.approx(325 + 100)
    assert (900 - 430 - 2 * margin) / 1000 < out["MIN_SCALE"] and out["tooSmall"] is None


def test_the_encode_nodes_reference_sockets_grow_as_they_are_connected(page):
    """A new encode node offers one reference socket (`images.image1`: the frontend's Autogrow, or the pack's first
    socket where the frontend shows none for all-optional sockets); connecting an image to it adds the next one."""
    result = page.evaluate("""async () => {
        const graph = window.app.graph;
        const encode = LiteGraph.createNode("KVGraphTextEncode");
        const image = LiteGraph.createNode("LoadImage");
        graph.add(encode);
        graph.add(image);
        await new Promise(r => setTimeout(r, 300));
        const names = () => encode.inputs.filter(i => i.name.startsWith("images.")).map(i => i.name);
        const before = names();
        image.connect(0, encode, encode.inputs.findIndex(i => i.name === "images.image1"));
        await new Promise(r => setTimeout(r, 300));
        const after = names();
        graph.remove(encode);
        graph.remove(image);
        return { before, after };
    }""")
    assert result["before"] == ["images.image1"]
    assert result["after"] == ["images.image1", "images.image2"]
    assert page.errors == []
