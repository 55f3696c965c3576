// KV-Graph web extension: a sidebar tab with the live decode-graph cache status (the graph moved out from under it
// when it opens), toasts when decode steps fall back to eager, a "Release KV-Graph caches" command and an about-page
// badge.
//
// ComfyUI imports every .js file under the pack's WEB_DIRECTORY. This one registers the panel's extension;
// reference_sockets.js (the encode node's first reference socket) and report_text.js (the cache nodes' report on the
// node) register their own small ones; the others just export. Only the frontend's stable public modules are
// imported (scripts/app.js and scripts/api.js); everything on `app.extensionManager` is feature-detected because older
// frontends lack parts of it and the pack must still load there.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { describePhase, describeRelease, shortId } from "./format.js";
import { afterTheFrontendsView, keepGraphBesidePanel as moveGraphBesidePanel } from "./panel_view.js";
import { StatusPanel } from "./status_panel.js";
import { StatusStore } from "./status_store.js";

// Keep in step with pyproject.toml's version (a browser test checks the badge against it).
export const VERSION = "0.1.0";
export const EXTENSION_NAME = "kvgraph.panel";
export const EVENT = "kvgraph.status";
export const TAB_ID = "kvgraph-status";
export const SETTING_FALLBACK_TOASTS = "KVGraph.FallbackToasts";
export const SETTING_BESIDE_PANEL = "KVGraph.KeepGraphBesidePanel";
export const COMMAND_RELEASE = "KVGraph.ReleaseCaches";
export const COMMAND_SHOW_PANEL = "KVGraph.ShowPanel";
const REPO_URL = "https://github.com/kv-graph/comfyui-kv-graph";

export const store = new StatusStore(api);
let panel = null;
let panelResizes = null; // watches the open panel's size (it slides open; the user may widen it)

/**
 * Show a toast if this frontend has a toast manager. `add` is the API of the frontend this was built against (1.35);
 * newer frontends deprecate it in favour of success/warning/error, so use those when `add` is gone.
 */
export function toast(severity, summary, detail, life = 6000) {
  const manager = app.extensionManager?.toast;
  if (typeof manager?.add === "function") {
    manager.add({ severity, summary, detail, life });
    return true;
  }
  const method = { warn: "warning", success: "success", error: "error", info: "info" }[severity];
  if (typeof manager?.[method] === "function") {
    manager[method](summary, { description: detail });
    return true;
  }
  console.info(`[KV-Graph] ${summary}: ${detail}`);
  return false;
}

function settingOn(id, fallback) {
  const settings = app.extensionManager?.setting;
  const value = typeof settings?.get === "function" ? settings.get(id) : undefined;
  return value === undefined || value === null ? fallback : Boolean(value);
}

/** The release command: graphs only (`models: false`); the loaded weights stay so the next prompt starts fast. */
export async function releaseCaches() {
  try {
    // The status from before names each model by its file in the toast; fetch it if the panel never did.
    const before = store.status ?? (await store.refresh());
    const result = await store.release(false);
    toast("success", "KV-Graph caches released", describeRelease(result, before));
    return result;
  } catch (err) {
    toast("error", "KV-Graph release failed", err?.message || String(err), 10000);
    throw err;
  }
}

function onStatusEvent(event) {
  const detail = event?.detail;
  store.handleEvent(detail);
  // A fallback is correct but slow; users who decode eagerly on purpose (CPU, lowvram) switch the toasts off.
  if (detail?.phase === "fallback" && settingOn(SETTING_FALLBACK_TOASTS, true)) {
    toast("warn", "KV-Graph: decoding eagerly",
      `${describePhase(detail)} (prompt ${shortId(detail.prompt_id)}, node ${detail.node ?? "?"}). `
      + "Results are correct, decode steps are slower.");
  }
}

/** With the panel open, move the view so no node is hidden under it (see panel_view.js), unless switched off. */
function keepGraphBesidePanel() {
  if (!panel?.root?.isConnected || !settingOn(SETTING_BESIDE_PANEL, true)) return false;
  return moveGraphBesidePanel(app.canvas, panel.root);
}

function registerPanel() {
  const manager = app.extensionManager;
  if (typeof manager?.registerSidebarTab !== "function") {
    console.warn("[KV-Graph] this ComfyUI frontend has no sidebar tabs; the status panel is not available");
    return false;
  }
  panel = new StatusPanel(store, releaseCaches);
  manager.registerSidebarTab({
    id: TAB_ID,
    icon: "pi pi-bolt",
    title: "KV-Graph",
    tooltip: "KV-Graph decode-graph cache",
    label: "KV-Graph",
    type: "custom",
    render: (container) => {
      panel.mount(container);
      panelResizes?.disconnect();
      panelResizes = typeof ResizeObserver === "function" ? new ResizeObserver(() => keepGraphBesidePanel()) : null;
      panelResizes?.observe(panel.root); // also reports the size it opens with
    },
    destroy: () => {
      panelResizes?.disconnect();
      panelResizes = null;
      panel.unmount();
    },
  });
  return true;
}

app.registerExtension({
  name: EXTENSION_NAME,

  settings: [
    {
      id: SETTING_FALLBACK_TOASTS,
      category: ["KV-Graph", "Notifications", "Fallback toasts"],
      name: "Show a toast when the KV-Graph sampler decodes eagerly",
      tooltip: "Eager decode steps are correct but slower than replayed CUDA graphs; the reason is in the toast.",
      type: "boolean",
      defaultValue: true,
    },
    {
      id: SETTING_BESIDE_PANEL,
      category: ["KV-Graph", "Panel", "Keep the graph beside the panel"],
      name: "Move the graph out from under the KV-Graph panel when it opens or a workflow loads",
      tooltip: "The panel covers the left of the canvas; nodes it would hide are moved right of it (zooming out only "
        + "as far as needed).",
      type: "boolean",
      defaultValue: true,
    },
  ],

  commands: [
    {
      id: COMMAND_RELEASE,
      label: "Release KV-Graph caches",
      icon: "pi pi-trash",
      tooltip: "Free every captured decode graph and its buffers (loaded models stay)",
      function: () => releaseCaches().catch(() => {}), // the toast already reported the error
    },
    {
      id: COMMAND_SHOW_PANEL,
      label: "Show KV-Graph status",
      icon: "pi pi-bolt",
      function: () => {
        // The frontend registers a toggle command for every sidebar tab; reuse it so the tab button stays in sync.
        app.extensionManager?.command?.execute?.(`Workspace.ToggleSidebarTab.${TAB_ID}`);
      },
    },
  ],

  menuCommands: [{ path: ["Extensions", "KV-Graph"], commands: [COMMAND_SHOW_PANEL, COMMAND_RELEASE] }],

  aboutPageBadges: [{ label: `KV-Graph v${VERSION}`, url: REPO_URL, icon: "pi pi-bolt" }],

  // A workflow opened while the panel is open (a template fitted to the whole window, say) moves out from under it.
  async afterConfigureGraph() {
    afterTheFrontendsView(keepGraphBesidePanel);
  },

  async setup() {
    api.addEventListener(EVENT, onStatusEvent);
    // After a server restart the graphs are gone: refetch rather than show what the old process held.
    api.addEventListener("reconnected", () => store.refresh());
    registerPanel();
  },
});
