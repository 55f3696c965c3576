"""Where the nodes of a UI-format example workflow go, and the view (`extra.ds`) it opens with.

The nodes stand in columns, left to right in the order the data flows (loaders and reference images, then the prompt,
then the sampler and its outputs). A column is a list of rows; the nodes of a row share the column's width, and a
column is as wide as its widest row needs. Every node is at least as large as ComfyUI's frontend makes it for its
widgets (its `computeSize()`), and wide enough that no widget's label and value are cut short; the minimum sizes below
were measured in the frontend (1.35.9, 1.49.6 and 1.58.1 agree), and tests/browser/test_templates.py checks them there.

The view: the frontend opens a workflow at `extra.ds` (`Comfy.EnableWorkflowViewRestore`, on by default): a canvas
point p is drawn at (p + offset) * scale, from the window's top-left corner whatever the window's size. One view
serves two windows: a 1600x1000 one, where the graph must fit whole and keep clear of the minimap the frontend shows at
the bottom right (1.25 and later, on by default on wide windows), and a 1920x1080 one with the KV-Graph panel open at
the left, where no node may sit under the panel. So `view()` fits the graph, titles and the pack's node badges
included, into the part of the 1600x1000 window right of where the panel ends, with the minimap's corner left free.
"""

from __future__ import annotations

import math

# The frontend's geometry (LiteGraph.NODE_TITLE_HEIGHT; the pack's source badge is drawn above the title).
TITLE_HEIGHT = 30
BADGE_HEIGHT = 20
# Spacing between columns (room for the links) and between the rows of a column (the next node's badge fits in it).
COLUMN_GAP = 60
ROW_GAP = 24
NODE_GAP = 24  # between two nodes of one row
FREE = None  # ends a row whose nodes keep their own widths, the rest of the column's width left empty

# The windows, in screen pixels. SMALL_WINDOW: the graph fits whole. The KV-Graph panel (1920x1080 window) ends at
# PANEL_RIGHT; the tab bar, the workflow's breadcrumb and Run bar take TOP; the canvas toolbar and the frontend's
# statistics take BOTTOM; the minimap and the zoom toolbar under it take MINIMAP (width, height) at the bottom right.
SMALL_WINDOW = (1600, 1000)
PANEL_WINDOW = (1920, 1080)
PANEL_RIGHT = 440
TOP = 100
BOTTOM = 48
MARGIN = 24
MINIMAP = (270, 272)
MAX_SCALE = 1.0

# (width, height) each node type needs at least: its widgets at full width (the longest label and value of the
# example values, plus the widget's arrows and padding), its title whole (1.58 cuts a title short where it is wider
# than the node less twice the title bar's height), and `computeSize()`'s height. A Load Image node's height holds its
# image preview.
MIN_SIZE = {
    "KVGraphLoadTransformer": (470, 198),
    "KVGraphLoadTextEncoder": (420, 130),
    "KVGraphLoadVAE": (370, 82),
    "KVGraphLoadLoRA": (340, 82),
    "MarkdownNote": (300, 120),
    "LoadImage": (240, 330),
    "KVGraphTextEncode": (320, 300),
    "KVGraphSampler": (300, 290),
    "KVGraphVAEDecode": (200, 50),
    "SaveImage": (330, 230),
    "KVGraphSigmas": (240, 174),
    "KVGraphVAEEncode": (200, 50),
    "KSampler": (250, 262),
    "RandomNoise": (250, 82),
    "KSamplerSelect": (210, 58),
    "CFGGuider": (210, 98),
    "SamplerCustomAdvanced": (250, 106),
    "SetLatentNoiseMask": (200, 50),
    "KVGraphLoadControlNet": (480, 58),
    "KVGraphApplyControlNet": (210, 210),
    "KVGraphStepCache": (210, 106),
    "EasyCache": (210, 130),
    "LoraLoaderModelOnly": (340, 82),
    "JoinImageWithAlpha": (210, 50),  # its title is what needs the width
    "KVGraphSaveImage": (330, 230),
    "SkipLayerGuidanceDiT": (210, 178),
}
# The encode node's reference sockets grow as they are connected: MIN_SIZE holds its height with as many sockets as it
# has outputs (3), and each socket beyond those takes one more row.
ENCODE_ROWS, SOCKET_ROW = 3, 20


def min_size(node_type: str) -> tuple[int, int]:
    if node_type not in MIN_SIZE:
        raise KeyError(f"no minimum size for {node_type!r}: measure what the frontend needs (its computeSize() and "
                       "its widgets' text) and add it to MIN_SIZE in tests/e2e/workflow_layout.py")
    return MIN_SIZE[node_type]


def encode_height(sockets: int) -> int:
    """The height the encode node needs with `sockets` input sockets (its fixed ones and the reference sockets)."""
    return MIN_SIZE["KVGraphTextEncode"][1] + SOCKET_ROW * max(0, sockets - ENCODE_ROWS)


def place(columns, node_types: dict, height_for=None) -> dict:
    """{node id: ((x, y), (width, height))} for `columns`: a list of columns, each a list of rows, each a list of
    node ids. `node_types` maps each id to its type (for MIN_SIZE); `height_for(node id, width)`, if given, may ask
    more height for a node at the width it gets (a note's text). A column is as wide as its widest row; the nodes of a
    narrower row share the rest of its width, unless the row ends in FREE: then they keep their own widths and the
    rest stays empty. The nodes of a row share its height. Node positions are the top-left corner of the node's
    body; its title bar sits above, inside the row gap."""
    def min_width(node_id):
        return min_size(node_types[node_id])[0]

    placed = {}
    x = 0
    for column in columns:
        widths = [sum(min_width(i) for i in row if i is not FREE) + NODE_GAP * (sum(i is not FREE for i in row) - 1)
                  for row in column]
        width = max(widths)
        y = 0
        for row, needed in zip(column, widths):
            nodes = [i for i in row if i is not FREE]
            grow = 0 if FREE in row else (width - needed) // len(nodes)
            sizes = {i: min_width(i) + grow for i in nodes}
            height = max(max(min_size(node_types[i])[1], height_for(i, sizes[i]) if height_for else 0) for i in nodes)
            left = x
            for node_id in nodes:
                placed[node_id] = ((left, y), (sizes[node_id], height))
                left += sizes[node_id] + NODE_GAP
            y += height + ROW_GAP + TITLE_HEIGHT
        x += width + COLUMN_GAP
    return placed


def node_box(pos, size) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of what the frontend draws for a node: its body, its title bar and its badge."""
    (x, y), (w, h) = pos, size
    return x, y - TITLE_HEIGHT - BADGE_HEIGHT, x + w, y + h


def bounds(placed: dict) -> tuple[float, float, float, float]:
    boxes = [node_box(pos, size) for pos, size in placed.values()]
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))


def view_area() -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the window area the graph should fill, in screen pixels."""
    width, height = SMALL_WINDOW
    return PANEL_RIGHT + MARGIN, TOP, width - MARGIN, height - BOTTOM


def minimap_corner() -> tuple[int, int]:
    """(left, top) of the 1600x1000 window's bottom-right corner the minimap covers, in screen pixels."""
    width, height = SMALL_WINDOW
    return width - MINIMAP[0], height - MINIMAP[1]


def _clear_of_the_minimap(placed: dict, scale: float, origin: tuple[float, float]) -> bool:
    corner_x, corner_y = minimap_corner()
    (x0, y0), (left, top) = origin, view_area()[:2]
    for pos, size in placed.values():
        _, _, right, bottom = node_box(pos, size)
        if left + (right - x0) * scale > corner_x and top + (bottom - y0) * scale > corner_y:
            return False
    return True


def view(placed: dict) -> dict:
    """`extra.ds` that draws every node of `placed` inside view_area(), from its top-left corner, at the largest
    scale (up to MAX_SCALE, in steps of 1/100) that fits and leaves the minimap's corner free. The offset is rounded
    to whole canvas units."""
    x0, y0, x1, y1 = bounds(placed)
    left, top, right, bottom = view_area()
    scale = int(min((right - left) / (x1 - x0), (bottom - top) / (y1 - y0), MAX_SCALE) * 100) / 100
    while scale > 0.01 and not _clear_of_the_minimap(placed, scale, (x0, y0)):
        scale = round(scale - 0.01, 2)
    # Whole canvas units, rounded up: the graph moves right and down by under one unit, never out of the area's
    # top-left edge (rounding the scale down left room for that at the other edges).
    return {"scale": scale, "offset": [math.ceil(left / scale - x0), math.ceil(top / scale - y0)]}
