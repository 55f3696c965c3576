// The report of KV-Graph Cache Status and KV-Graph Release Caches, shown on the node: each returns it as its `ui`
// text (ComfyUI's `executed` message, which also keeps it in /history), and this puts it in a read-only text box that
// keeps it until the node runs again. A node's progress text would not do: frontend 1.58 clears it when the job ends.

import { app } from "../../scripts/app.js";

export const REPORT_NODES = ["KVGraphCacheStatus", "KVGraphReleaseCaches"];
export const REPORT_WIDGET = "report";
const PLACEHOLDER = "The report shows here once the node has run.";
const MIN_HEIGHT = 120;

/** The node's report box, added on first use; null where the frontend has no DOM widgets (then /history has it). */
export function reportWidget(node) {
  const existing = node.widgets?.find((w) => w.name === REPORT_WIDGET);
  if (existing) return existing;
  if (typeof node.addDOMWidget !== "function") return null;
  const box = document.createElement("textarea");
  box.readOnly = true;
  box.spellcheck = false;
  box.placeholder = PLACEHOLDER;
  box.className = "comfy-multiline-input kvgraph-report";
  box.dataset.testid = "kvgraph-report"; // as the panel's controls: tests find it the same in every frontend
  const widget = node.addDOMWidget(REPORT_WIDGET, "kvgraph-report", box, {
    getValue: () => box.value,
    setValue: (value) => {
      box.value = value ?? "";
    },
    getMinHeight: () => MIN_HEIGHT,
    serialize: false, // not an input of the node: left out of the prompt...
  });
  widget.serialize = false; // ...and out of the saved workflow's widget values
  return widget;
}

/** `text` of an `executed` message (a list of strings) as the box shows it. */
export function reportText(text) {
  return Array.isArray(text) ? text.join("\n") : String(text);
}

app.registerExtension({
  name: "kvgraph.reportText",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!REPORT_NODES.includes(nodeData?.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function (...args) {
      const result = onNodeCreated?.apply(this, args);
      reportWidget(this);
      return result;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message, ...args) {
      onExecuted?.apply(this, [message, ...args]);
      const widget = reportWidget(this);
      if (widget && message?.text !== undefined) {
        widget.value = reportText(message.text);
        this.setDirtyCanvas?.(true, true);
      }
    };
  },
});
