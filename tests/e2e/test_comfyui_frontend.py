"""The UI-format example workflows in ComfyUI's real frontend (headless Chromium): each loads without errors and the
frontend turns it into exactly its API-format twin (same nodes, links and widget values)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import REPO, ui_workflow_path  # noqa: E402

pytestmark = [pytest.mark.comfyui, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
EXAMPLES = sorted(p.stem for p in (REPO / "example_workflows" / "api").glob("*.json"))


@pytest.fixture(scope="module")
def page(classic_server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright)")
    if CHROMIUM is None:
        pytest.skip("needs a Chromium executable (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        tab = browser.new_page()
        tab.errors = []
        tab.on("pageerror", lambda exc: tab.errors.append(str(exc)))
        tab.goto(classic_server.url)
        tab.wait_for_function("window.app && window.app.graph", timeout=90_000)
        yield tab
        browser.close()


def without_meta(prompt: dict) -> dict:
    return {k: {kk: vv for kk, vv in v.items() if kk != "_meta"} for k, v in prompt.items()}


@pytest.mark.parametrize("name", EXAMPLES)
def test_frontend_loads_the_workflow_as_its_api_twin(page, name):
    workflow = json.loads(ui_workflow_path(name).read_text())
    prompt = page.evaluate("""async (workflow) => {
        await window.app.loadGraphData(workflow);
        return (await window.app.graphToPrompt()).output;
    }""", workflow)
    twin = json.loads((REPO / "example_workflows" / "api" / f"{name}.json").read_text())
    assert without_meta(prompt) == without_meta(twin)
    assert page.errors == []
