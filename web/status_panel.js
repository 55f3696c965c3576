// The KV-Graph sidebar panel: renders a StatusStore into plain DOM.
//
// Plain DOM (no Vue) because the frontend's extension API hands custom tabs a bare container, and the pack ships no
// build step. Server data only ever goes into textContent, never innerHTML: model paths and fallback reasons come
// from another process. The panel rebuilds its body on every store change; the payload is small (a few models, at
// most `max_entries` graph entries each), so diffing would buy nothing.

import {
  baseName,
  describePhase,
  describePlacements,
  describePrefills,
  formatBytes,
  formatKeyDetail,
  formatKeyTitle,
  formatReasons,
  shortId,
  totals,
} from "./format.js";

const STYLE_ID = "kvgraph-panel-style";
const POLL_MS = 1500;

// Colours come from the frontend's palette variables, so the panel follows the user's light/dark theme.
const CSS = `
.kvgraph-panel { display: flex; flex-direction: column; gap: 10px; padding: 10px 12px; height: 100%;
  overflow-y: auto; box-sizing: border-box; font-size: 13px; color: var(--fg-color, #ddd); }
.kvgraph-header { display: flex; align-items: center; gap: 6px; }
.kvgraph-header h3 { margin: 0; font-size: 15px; flex: 1; }
.kvgraph-button { display: inline-flex; align-items: center; gap: 4px; padding: 3px 8px; font-size: 12px;
  border-radius: 4px; cursor: pointer; border: 1px solid var(--border-color, #555);
  background: var(--comfy-input-bg, #222); color: var(--input-text, var(--fg-color, #ddd)); }
.kvgraph-button:hover { filter: brightness(1.2); }
.kvgraph-button:disabled { opacity: 0.5; cursor: default; }
.kvgraph-muted { color: var(--descrip-text, #999); font-size: 12px; }
.kvgraph-error { color: var(--error-text, #f66); }
.kvgraph-section h4 { margin: 4px 0 6px; font-size: 12px; text-transform: uppercase; letter-spacing: 0.04em;
  color: var(--descrip-text, #999); }
.kvgraph-totals { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 4px 12px; }
.kvgraph-stat { display: flex; justify-content: space-between; gap: 6px; }
.kvgraph-stat .kvgraph-value { font-variant-numeric: tabular-nums; font-weight: 600; }
.kvgraph-card { border: 1px solid var(--border-color, #444); border-radius: 6px; padding: 6px 8px; margin-bottom: 6px;
  background: var(--comfy-menu-secondary-bg, transparent); }
.kvgraph-card-title { font-weight: 600; word-break: break-all; }
.kvgraph-entry { border-left: 3px solid var(--border-color, #555); padding: 2px 0 2px 8px; margin: 6px 0 2px; }
.kvgraph-entry[data-state="captured"] { border-left-color: #4caf50; }
.kvgraph-entry[data-state="registered"] { border-left-color: #e0a030; }
.kvgraph-entry[data-state="failed"] { border-left-color: var(--error-text, #f66); }
.kvgraph-badge { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 11px; margin-left: 4px;
  border: 1px solid var(--border-color, #555); }
.kvgraph-phases { margin: 0; padding-left: 18px; }
.kvgraph-phases li[data-phase="fallback"] { color: #e0a030; }
.kvgraph-phases li[data-phase="done"] { font-weight: 600; }
`;

function ensureStyle() {
  if (document.getElementById(STYLE_ID)) return;
  const style = document.createElement("style");
  style.id = STYLE_ID;
  style.textContent = CSS;
  document.head.appendChild(style);
}

/** Tiny element builder: h("div", {class: "x"}, "text", child). Strings become text nodes (never parsed as HTML). */
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value == null || value === false) continue;
    if (name === "onclick") el.addEventListener("click", value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child == null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function stat(label, value, name) {
  return h("div", { class: "kvgraph-stat", "data-stat": name },
    h("span", { class: "kvgraph-muted" }, label), h("span", { class: "kvgraph-value" }, value));
}

function renderTotals(status) {
  const t = totals(status);
  return h("section", { class: "kvgraph-section kvgraph-totals-section" },
    h("h4", {}, "Totals"),
    h("div", { class: "kvgraph-totals" },
      stat("Graph caches", t.models, "models"),
      stat("Entries", t.entries, "entries"),
      stat("Captures", t.captures, "captures"),
      stat("Replays", t.replays, "replays"),
      stat("Eager steps", t.eagerTotal, "eager"),
      t.skipped ? stat("Skipped steps", t.skipped, "skipped") : null,
      stat("Held", formatBytes(t.bytes), "bytes")),
    t.eagerTotal
      ? h("div", { class: "kvgraph-muted kvgraph-eager-reasons" }, `Eager steps by reason: ${formatReasons(t.eagerSteps)}`)
      : null);
}

function renderEntry(entry) {
  const key = entry.key || {};
  const state = entry.state || "unknown";
  const detail = state === "failed"
    ? h("div", { class: "kvgraph-error" }, `failed: ${entry.reason ?? "?"}${entry.detail ? ` (${entry.detail})` : ""}`)
    : h("div", { class: "kvgraph-muted" },
      `${entry.captures ?? 0} captures · ${entry.replays ?? 0} replays · ${formatBytes(entry.bytes)} · `
      + (entry.host_bytes ? `${formatBytes(entry.host_bytes)} pinned on the host · ` : "")
      + "owner " + (entry.owner_alive ? "alive (in use)" : "released"));
  return h("div", { class: "kvgraph-entry", "data-state": state },
    h("div", {}, formatKeyTitle(key), h("span", { class: "kvgraph-badge" }, state)),
    h("div", { class: "kvgraph-muted" }, formatKeyDetail(key)),
    detail);
}

/** The last request's memory plan (graph_runtime/memory/plan.py `as_dict`) in one line. */
export function describePlan(plan) {
  const blocks = plan.streamed_blocks
    ? `${plan.resident_blocks}/${plan.blocks} blocks resident, ${plan.streamed_blocks} streamed`
    : `all ${plan.blocks} blocks resident`;
  const te = plan.text_encoder ? ` · text encoder ${plan.text_encoder}` : "";
  return `Memory plan: ${blocks} · prefix ${plan.prefix_placement}${te} · VAE decode ${plan.vae_decode} · `
    + `${formatBytes(plan.gpu_bytes)} GPU · step ~${Math.round(plan.step_ms)} ms (estimate)`;
}

function renderModel(model) {
  if (model.error) {
    return h("div", { class: "kvgraph-card kvgraph-model" },
      h("div", { class: "kvgraph-card-title" }, `engine ${model.engine_id}`),
      h("div", { class: "kvgraph-error" }, `unreadable: ${model.error}`));
  }
  const kernels = [...new Set(Object.values(model.attention || {}))].join(", ");
  // What was asked for, and what runs where it differs (a fallback, or fp8's kernel name fa3-fp8)
  const runs = kernels && kernels !== model.attention_requested ? ` (runs ${kernels})` : "";
  const attention = model.attention_requested ? `attention ${model.attention_requested}${runs}` : null;
  const where = [model.dtype, model.device, model.loads != null ? `loaded ${model.loads}×` : null, attention,
    model.compiled ? "compiled blocks" : null, model.busy ? "sampling now" : "idle"].filter(Boolean).join(" · ");
  const fallbacks = Object.keys(model.attention_fallbacks || {}).length ? model.attention_fallbacks : null;
  const entries = model.entries || [];
  return h("div", { class: "kvgraph-card kvgraph-model", "data-engine": model.engine_id },
    h("div", { class: "kvgraph-card-title", title: model.source || "" },
      model.source ? baseName(model.source) : `${model.model ?? "transformer"} (not loaded by a KV-Graph loader)`),
    h("div", { class: "kvgraph-muted" }, where),
    h("div", { class: "kvgraph-model-stats" },
      `${model.captures ?? 0} captures · ${model.replays ?? 0} replays · ${model.eager_total ?? 0} eager · `
      + (model.skipped_steps ? `${model.skipped_steps} skipped (step cache) · ` : "")
      + `${formatBytes(model.bytes_held)} held · ${entries.length}/${model.max_entries ?? "?"} entries`),
    model.eager_total
      ? h("div", { class: "kvgraph-muted" }, `eager by reason: ${formatReasons(model.eager_steps)}`)
      : null,
    fallbacks
      ? h("div", { class: "kvgraph-muted kvgraph-attention" }, `attention fallback: ${formatReasons(fallbacks)}`)
      : null,
    describePrefills(model)
      ? h("div", { class: "kvgraph-muted kvgraph-prefills" }, describePrefills(model))
      : null,
    model.budget?.plan
      ? h("div", { class: "kvgraph-muted kvgraph-plan", "data-placement": model.budget.plan.prefix_placement },
        describePlan(model.budget.plan))
      : null,
    describePlacements(model)
      ? h("div", { class: "kvgraph-muted kvgraph-placements" }, describePlacements(model))
      : null,
    entries.length
      ? entries.map(renderEntry)
      : h("div", { class: "kvgraph-muted kvgraph-no-entries" }, "No decode graphs held."));
}

function renderModels(status) {
  const models = status.models || [];
  return h("section", { class: "kvgraph-section kvgraph-models" },
    h("h4", {}, "Decode-graph caches"),
    models.length
      ? models.map(renderModel)
      : h("div", { class: "kvgraph-muted kvgraph-empty" },
        "No transformer loaded yet. Queue a workflow with the KV-Graph sampler to see its graph cache here."));
}

function renderRunning(status) {
  const runs = status.running || [];
  if (!runs.length) return null;
  return h("section", { class: "kvgraph-section kvgraph-running" },
    h("h4", {}, "Running"),
    runs.map((r) => h("div", {}, `prompt ${shortId(r.prompt_id)} · node ${r.node ?? "?"} · step ${r.step}/${r.total}`)));
}

function renderLoaded(status) {
  const loaded = status.loaded || [];
  if (!loaded.length) return null;
  return h("section", { class: "kvgraph-section kvgraph-loaded" },
    h("h4", {}, "Loaded files"),
    loaded.map((item) => h("div", { class: "kvgraph-muted", title: item.source || "" },
      `${item.kind}: ${baseName(item.source)} · ${item.dtype ?? "?"} · ${item.device ?? "?"} · `
      + `${formatBytes(item.bytes)} · loaded ${item.loads ?? "?"}×`)));
}

function renderLastRun(run) {
  return h("section", { class: "kvgraph-section kvgraph-last-run" },
    h("h4", {}, "Last run"),
    run
      ? [
        h("div", { class: "kvgraph-muted" },
          `prompt ${shortId(run.prompt_id)} · node ${run.node ?? "?"}${run.summary ? "" : " · in progress"}`),
        h("ol", { class: "kvgraph-phases" },
          run.phases.map((p) => h("li", { "data-phase": p.phase, title: p.at.toLocaleTimeString() },
            describePhase(p.data)))),
      ]
      : h("div", { class: "kvgraph-muted" }, "No sampler run seen since this page opened."));
}

export class StatusPanel {
  /**
   * @param store a StatusStore
   * @param onRelease async () => void: the release command (shared with the menu, so both toast the same way)
   */
  constructor(store, onRelease) {
    this.store = store;
    this.onRelease = onRelease;
    this.container = null;
    this.root = null;
    this.body = null;
    this.unsubscribe = null;
    this.pollTimer = null;
  }

  /**
   * The frontend calls a custom tab's render(container) whenever its slot re-renders, possibly with the same element
   * again, so mounting twice into one container is a no-op rather than a second panel.
   */
  mount(container) {
    if (this.container === container && this.root?.isConnected) return;
    this.unmount();
    ensureStyle();
    this.container = container;
    // data-testid, as the frontend marks its own controls (the tab's button included), so tests find these the same
    // way in every frontend version.
    this.refreshButton = h("button", { class: "kvgraph-button kvgraph-refresh", "data-testid": "kvgraph-refresh",
      title: "Fetch the status again", onclick: () => this._refresh() }, h("i", { class: "pi pi-refresh" }), "Refresh");
    this.releaseButton = h("button", { class: "kvgraph-button kvgraph-release", "data-testid": "kvgraph-release",
      title: "Release every captured decode graph and its buffers (loaded models stay)",
      onclick: () => this._release() }, h("i", { class: "pi pi-trash" }), "Release");
    this.body = h("div", { class: "kvgraph-body" });
    this.root = h("div", { class: "kvgraph-panel", "data-testid": "kvgraph-panel" },
      h("div", { class: "kvgraph-header" }, h("h3", {}, "KV-Graph"), this.refreshButton, this.releaseButton),
      this.body);
    container.replaceChildren(this.root);
    this.unsubscribe = this.store.subscribe(() => this.update());
    this.update();
    this.store.refresh(); // opening the tab always shows fresh numbers
  }

  unmount() {
    clearTimeout(this.pollTimer);
    this.pollTimer = null;
    this.unsubscribe?.();
    this.unsubscribe = null;
    this.root?.remove();
    this.container = this.root = this.body = null;
  }

  async _refresh() {
    this.refreshButton.disabled = true;
    try {
      await this.store.refresh();
    } finally {
      if (this.refreshButton) this.refreshButton.disabled = false;
    }
  }

  async _release() {
    this.releaseButton.disabled = true;
    try {
      await this.onRelease();
    } catch {
      // the release command already reported the failure in a toast
    } finally {
      if (this.releaseButton) this.releaseButton.disabled = false;
    }
  }

  update() {
    if (!this.body) return;
    const { status, error, updatedAt, lastRun } = this.store;
    const when = updatedAt ? `updated ${updatedAt.toLocaleTimeString()}` : "loading…";
    const parts = [h("div", { class: "kvgraph-muted kvgraph-updated" }, when)];
    if (error) parts.push(h("div", { class: "kvgraph-error kvgraph-fetch-error" }, `Could not read the status: ${error}`));
    if (status) {
      parts.push(renderTotals(status), renderRunning(status), renderModels(status), renderLoaded(status));
    }
    parts.push(renderLastRun(lastRun));
    this.body.replaceChildren(...parts.filter(Boolean));
    this._schedulePoll();
  }

  /**
   * While a sampler runs and the panel is open, poll the route so the step counter moves; websocket events only mark
   * phase changes. Idle, or with the panel closed, nothing is polled.
   */
  _schedulePoll() {
    const running = this.store.status?.running?.length > 0;
    if (!running || this.pollTimer || this.store.loading) return;
    this.pollTimer = setTimeout(() => {
      this.pollTimer = null;
      if (this.body) this.store.refresh();
    }, POLL_MS);
  }
}
