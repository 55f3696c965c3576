"""Where the nodes of a UI-format example workflow go, and the view (`extra.ds`) it opens with.

The nodes stand in columns, left to right in the order the data flows (loaders, then the prompt and its reference
images, then the sampler and its outputs). A column is a list of rows; the nodes of a row share the column's width,
and a column is as wide as its widest row needs. Every node is at least as large as ComfyUI's frontend makes it for
its widgets (its `computeSize()`), and wide enough that no widget's label and value are cut short; the minimum sizes
below were measured in the frontend (ComfyUI frontend 1.35), and tests/browser/test_templates.py checks them there.

The view: the frontend opens a workflow at `extra.ds` (`Comfy.EnableWorkflowViewRestore`, on by default): a canvas
point p is drawn at (p + offset) * scale. `view()` picks the scale and offset that fit the whole graph, titles and
the pack's node badges included, into a 1920x1080 window beside the sidebar with the KV-Graph panel open.
"""

from __future__ import annotations

# The frontend's geometry (LiteGraph.NODE_TITLE_HEIGHT; the pack's source badge is drawn above the title).
TITLE_HEIGHT = 30
BADGE_HEIGHT = 20
# Spacing between columns (room for the links) and between the rows of a column (a title bar plus a gap).
COLUMN_GAP = 80
ROW_GAP = 30
NODE_GAP = 24  # between two nodes of one row

# The window a workflow should open well in: 1920x1080 with the sidebar (its icon bar and the KV-Graph panel, whose
# right edge is at 430 px) at the left, the tab bar and the workflow's breadcrumb and Run bar on top, the canvas
# toolbar at the bottom.
VIEWPORT = (1920, 1080)
SIDEBAR = 440
TOP = 100
BOTTOM = 60
MARGIN = 24
MAX_SCALE = 1.0

# (width, height) each node type needs at least: its widgets at full width (the longest label and value of the
# example values, plus the widget's arrows and padding), its title, and `computeSize()`'s height.
MIN_SIZE = {
    "KVGraphLoadTransformer": (480, 174),
    "KVGraphLoadTextEncoder": (440, 130),
    "KVGraphLoadVAE": (400, 82),
    "KVGraphLoadLoRA": (400, 82),
    "MarkdownNote": (400, 240),
    "LoadImage": (340, 340),
    "KVGraphTextEncode": (460, 360),
    "KVGraphSampler": (360, 300),
    "KVGraphVAEDecode": (260, 50),
    "SaveImage": (360, 320),
    "KVGraphSigmas": (400, 180),
    "KVGraphVAEEncode": (260, 50),
    "KSampler": (360, 262),
    "RandomNoise": (320, 82),
    "KSamplerSelect": (320, 58),
    "CFGGuider": (320, 106),
    "SamplerCustomAdvanced": (360, 106),
    "SetLatentNoiseMask": (260, 50),
}
# The encode node grows a socket row per reference socket: its height for `sockets` of them.
ENCODE_BASE_HEIGHT, SOCKET_ROW = 258, 20
# Load Image at the height the frontend needs (its preview smaller), where an example has many of them.
COMPACT_IMAGE = (340, 326)


def place(columns, node_types: dict, sizes: dict | None = None) -> dict:
    """{node id: ((x, y), (width, height))} for `columns`: a list of columns, each a list of rows, each a list of
    node ids. `node_types` maps each id to its type (for MIN_SIZE); `sizes` may give some ids another size (at least
    what the frontend needs for their widgets). Node positions are the top-left corner of the node's body; its title
    bar sits above, inside the row gap."""
    placed = {}
    x = 0

    def size(i):
        return (sizes or {}).get(i) or MIN_SIZE[node_types[i]]

    for column in columns:
        width = max(sum(size(i)[0] for i in row) + NODE_GAP * (len(row) - 1) for row in column)
        y = 0
        for row in column:
            share = (width - NODE_GAP * (len(row) - 1)) // len(row)
            height = max(size(i)[1] for i in row)
            for k, node_id in enumerate(row):
                placed[node_id] = ((x + k * (share + NODE_GAP), y), (share, height))
            y += height + ROW_GAP + TITLE_HEIGHT
        x += width + COLUMN_GAP
    return placed


def bounds(placed: dict) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of what the frontend draws for the nodes: bodies, title bars and badges."""
    return (min(x for (x, _), _ in placed.values()),
            min(y for (_, y), _ in placed.values()) - TITLE_HEIGHT - BADGE_HEIGHT,
            max(x + w for (x, _), (w, _) in placed.values()),
            max(y + h for (_, y), (_, h) in placed.values()))


def view_area() -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the window area the graph should fill, in screen pixels."""
    width, height = VIEWPORT
    return SIDEBAR + MARGIN, TOP, width - MARGIN, height - BOTTOM


def view(placed: dict) -> dict:
    """`extra.ds` that shows every node of `placed`, centred in view_area() at the largest scale (up to
    MAX_SCALE) that fits. The scale is rounded down to 1/100 and the offset to whole canvas units."""
    x0, y0, x1, y1 = bounds(placed)
    left, top, right, bottom = view_area()
    scale = min((right - left) / (x1 - x0), (bottom - top) / (y1 - y0), MAX_SCALE)
    scale = int(scale * 100) / 100
    offset_x = (left + (right - left - (x1 - x0) * scale) / 2) / scale - x0
    offset_y = (top + (bottom - top - (y1 - y0) * scale) / 2) / scale - y0
    return {"scale": scale, "offset": [round(offset_x), round(offset_y)]}
