// Keeps the graph beside the KV-Graph panel.
//
// The sidebar panel is drawn over the canvas: a node under it is hidden. The example workflows open beside it at the
// view they carry, but a frontend that fits a template to the whole window (1.58 does, whatever the workflow's saved
// view) or a view the user saved elsewhere can put nodes under it. So when the panel opens, or a workflow loads while
// it is open, and a node would be hidden, the view moves right (the panel may still be sliding open: every change of
// its size is one more look), zooming out only as far as the graph needs to fit
// beside the panel; a graph that would have to shrink below MIN_SCALE is left where it is (the user pans it).

export const MIN_SCALE = 0.5;
export const MARGIN = 24; // px between the panel and the graph, and at the window's right edge
const BADGE_HEIGHT = 20; // the node source badge the frontend draws above a node's title

/** [left, top, right, bottom] of what the frontend draws for `nodes` (title bars and badges included), in canvas units. */
export function graphBounds(nodes) {
  const boxes = nodes.map((node) => node.getBounding());
  return [
    Math.min(...boxes.map((b) => b[0])),
    Math.min(...boxes.map((b) => b[1])) - BADGE_HEIGHT,
    Math.max(...boxes.map((b) => b[0] + b[2])),
    Math.max(...boxes.map((b) => b[1] + b[3])),
  ];
}

/**
 * The view ({scale, offset}) that draws `bounds` right of `panelRight` (px from the canvas element's left edge), or
 * null when the current one already does, or when fitting would need a scale under MIN_SCALE. A canvas point p is
 * drawn at (p + offset) * scale. The graph keeps its vertical centre; it shrinks only if it is wider than the room.
 */
export function viewBesidePanel(bounds, scale, offset, panelRight, canvasWidth) {
  const [x0, y0, x1, y1] = bounds;
  if ((x0 + offset[0]) * scale >= panelRight) return null;
  const room = canvasWidth - panelRight - 2 * MARGIN;
  const fitted = Math.min(scale, room / (x1 - x0));
  if (!(fitted >= MIN_SCALE)) return null;
  const middle = ((y0 + y1) / 2 + offset[1]) * scale; // px, kept where it is
  return {
    scale: fitted,
    offset: [(panelRight + MARGIN) / fitted - x0, middle / fitted - (y0 + y1) / 2],
  };
}

/** Move `canvas` (the frontend's LGraphCanvas) so no node is under `panel` (an element inside the open panel). */
export function keepGraphBesidePanel(canvas, panel) {
  const nodes = canvas?.graph?.nodes;
  if (!nodes?.length || !panel?.isConnected || !canvas.canvas) return false;
  const area = canvas.canvas.getBoundingClientRect();
  const panelRight = panel.getBoundingClientRect().right - area.left;
  const view = viewBesidePanel(graphBounds(nodes), canvas.ds.scale, canvas.ds.offset, panelRight, area.width);
  if (!view) return false;
  canvas.ds.scale = view.scale;
  canvas.ds.offset[0] = view.offset[0];
  canvas.ds.offset[1] = view.offset[1];
  canvas.setDirty(true, true);
  return true;
}

/** Call `check` once the frontend has placed its own view after a load (it may do so a frame or two later). */
export function afterTheFrontendsView(check) {
  setTimeout(() => requestAnimationFrame(() => requestAnimationFrame(check)), 0);
}
