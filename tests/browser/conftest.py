"""Browser fixtures: a real ComfyUI on CPU with the pack and tiny models, and a headless Chromium page on its UI.

Needs COMFYUI_DIR (a ComfyUI checkout) and COMFYUI_PYTHON (its Python, with diffusers), the `playwright` Python
package and a system Chromium (Debian: `apt-get install chromium`; set CHROMIUM to use another path). Playwright never
downloads a browser here: it is always pointed at that executable. Without any of these the tests are skipped.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
# The e2e suite's server helper (temporary --base-directory, tiny model files, start/stop, HTTP helpers) fits as is.
sys.path.insert(0, str(REPO / "tests" / "e2e"))
# ...and these tests' helpers (the tab button, the panel, dialogs): browser_ui.py.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The folder name the pack is installed under; it shows in node badges, the template browser and extension URLs.
PACK_FOLDER = "comfyui-kv-graph"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1600, "height": 900}
def _chromium() -> str | None:
    if os.environ.get("CHROMIUM"):  # an explicit choice is used as given, never silently replaced
        return os.environ["CHROMIUM"] if Path(os.environ["CHROMIUM"]).is_file() else None
    if Path("/usr/bin/chromium").is_file():
        return "/usr/bin/chromium"
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def browser_requirements():
    """Skip (with the reason) unless ComfyUI, Chromium and playwright are all here; returns their locations."""
    comfyui_dir, python = os.environ.get("COMFYUI_DIR"), os.environ.get("COMFYUI_PYTHON")
    if not comfyui_dir or not python:
        pytest.skip("browser tests need a real ComfyUI: set COMFYUI_DIR to its checkout and COMFYUI_PYTHON to its "
                    "Python (with diffusers installed)")
    if not (Path(comfyui_dir) / "main.py").is_file():
        pytest.fail(f"COMFYUI_DIR={comfyui_dir} has no main.py: not a ComfyUI checkout")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("browser tests need a Chromium executable (Debian: apt-get install chromium, or set CHROMIUM)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("browser tests need the playwright Python package (pip install playwright; no browser download "
                    "needed, the system Chromium is used)")
    return comfyui_dir, python, chromium


@pytest.fixture(scope="session")
def comfy(browser_requirements, tmp_path_factory):
    """ComfyUI on CPU with the pack linked in as PACK_FOLDER, tiny model files, an empty input folder (as on a fresh
    install: the pack copies the edit examples' reference images into it), and the first-run template browser off
    (it would cover the page)."""
    from comfy_server import PACK_FOLDER as E2E_FOLDER
    from comfy_server import ComfyServer, prepare_base

    comfyui_dir, python, _ = browser_requirements
    base = prepare_base(tmp_path_factory.mktemp("comfyui-browser"), reference_images=False)
    (base / "custom_nodes" / E2E_FOLDER).rename(base / "custom_nodes" / PACK_FOLDER)
    server = ComfyServer(comfyui_dir, python, base).start()
    try:
        assert server.post("/settings/Comfy.TutorialCompleted", True).ok
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pack_folder() -> str:
    return PACK_FOLDER


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def page(browser_requirements, comfy, tmp_path_factory):
    """One page on the ComfyUI UI for the module, loaded once (the frontend takes seconds to boot). `page.errors`
    collects uncaught exceptions and `page.kv_console` the console messages that mention the extension."""
    from playwright.sync_api import sync_playwright

    _, _, chromium = browser_requirements
    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh --user-data-dir
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=chromium, headless=True, args=CHROMIUM_ARGS, viewport=VIEWPORT)
        try:
            tab = context.pages[0] if context.pages else context.new_page()
            tab.errors = []
            tab.kv_console = []
            tab.on("pageerror", lambda exc: tab.errors.append(str(exc)))
            tab.on("console", lambda msg: ("kv-graph" in msg.text.lower() or "kvgraph" in msg.text.lower())
                   and tab.kv_console.append(f"{msg.type}: {msg.text}"))
            tab.goto(comfy.url)
            tab.wait_for_function("window.app?.graph && window.app.extensionManager", timeout=90_000)
            # Websocket events only reach a page whose socket is open; wait for it before anything is queued.
            tab.wait_for_function("window.comfyAPI?.api?.api?.socket?.readyState === 1", timeout=30_000)
            yield tab
        finally:
            context.close()
