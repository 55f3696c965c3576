"""What the browser tests select in ComfyUI's frontend, the same way in every frontend version they run against."""

from __future__ import annotations

# The KV-Graph sidebar tab's button. The frontend renders it: 1.58 gives it data-testid="<tab id>-tab-button", 1.35
# and 1.49 only a class of that name; every one of them names it by the tab's tooltip (the extension's), which is
# what selects it everywhere.
TAB_TEST_ID = "kvgraph-status-tab-button"
TAB_TOOLTIP = "KV-Graph decode-graph cache"
# The frontend's dialogs (PrimeVue's in 1.35, reka-ui's in 1.49 and later) all have this role; the panel is ours.
DIALOG = "[role=dialog]"
PANEL = "[data-testid=kvgraph-panel]"
# The left sidebar's tool bar: a test id in 1.58, only a class in 1.35 and 1.49.
SIDEBAR = "[data-testid=side-toolbar], .side-tool-bar-container"
# The minimap's box (its canvas and controls) and the Run bar: no version gives them a test id or a role.
MINIMAP = ".minimap-main-container"
RUN_BAR = ".actionbar"
# The main menu's button (the Comfy logo): a test id in 1.58, only a class in 1.35 and 1.49.
MENU_BUTTON = "[data-testid=comfy-menu-button], .comfy-menu-button-wrapper"
# A toast: 1.58 marks each with data-testid="toast"; 1.35 and 1.49 show PrimeVue's toast messages. (Both have
# role=alert, but so has 1.58's empty live region, always there.)
TOAST = "[data-testid=toast], .p-toast-message"
# JavaScript that removes every toast: the toast manager's removeAll (1.35, 1.49) or dismissAll (1.58).
CLEAR_TOASTS = "(() => { const t = window.app.extensionManager.toast; (t.removeAll ?? t.dismissAll).call(t); })()"


def tab_button(page):
    return page.get_by_test_id(TAB_TEST_ID).or_(page.get_by_role("button", name=TAB_TOOLTIP, exact=True))


def set_panel(page, visible: bool) -> None:
    """Open or close the KV-Graph sidebar tab (its button toggles, so click only when it is not as wanted)."""
    if page.locator(PANEL).is_visible() != visible:
        tab_button(page).click()
    page.wait_for_selector(PANEL, state="visible" if visible else "detached", timeout=10_000)


def toast_texts(page) -> list[str]:
    return page.evaluate(f"Array.from(document.querySelectorAll('{TOAST}')).map(e => e.innerText)")


def clear_toasts(page) -> None:
    page.evaluate(CLEAR_TOASTS)
    page.wait_for_function(f"document.querySelectorAll('{TOAST}').length === 0", timeout=10_000)


def wait_for_toast(page, text: str, timeout: int = 10_000) -> None:
    page.wait_for_function(f"""(text) => Array.from(document.querySelectorAll('{TOAST}'))
        .some(t => t.innerText.includes(text))""", arg=text, timeout=timeout)
