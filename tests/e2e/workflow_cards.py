"""What ComfyUI's template browser shows for each example workflow: its title, and a thumbnail a person can read at
card size.

The frontend (1.35 to 1.58) reads nothing about a custom node pack's template but its file name: a card's title is the
name, and where a card has a description line (1.35), it is the name again with "-" and "_" as spaces. A pack's
index.json is not read (and ComfyUI would list it as a template of its own), nor any field of the workflow. So the
UI-format file is named by its card's title, and what the example does, in a few words, is drawn on its thumbnail:
`<title>.jpg` beside `<title>.json`, shown as a square.

A thumbnail is drawn here, with Pillow and the font Pillow bundles (no system font, no network: the same picture on
every machine with the same Pillow): the card's headline and description, then what the workflow holds (its reference
images, or its prompt and negative prompt) and its main settings, in type large enough to read at a quarter of
its size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SIDE = 512
QUALITY = 85
# Characters a title may use: it is a file name on every OS and part of a URL path the frontend builds unquoted.
TITLE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9 .,()-]*[A-Za-z0-9)]")
TITLE_MAX = 30  # what fits a card's one title line in the template browser of a 1600 px wide window (1.35's)

BACKGROUND_TOP, BACKGROUND_BOTTOM = (38, 40, 52), (20, 21, 27)
TEXT, MUTED = (255, 255, 255), (208, 212, 226)
ACCENT = (244, 184, 76)
BOX, BOX_EDGE = (46, 49, 64), (98, 140, 255)
NEGATIVE_BOX, NEGATIVE_EDGE = (64, 40, 44), (232, 96, 96)
CHECKER = ((150, 154, 166, 255), (104, 108, 122, 255))
MARGIN = 32


@dataclass(frozen=True)
class Card:
    """An example's template card: `title` names the UI file (so the card), `headline` and `description` are drawn
    on the thumbnail."""

    title: str
    headline: str
    description: str

    def __post_init__(self):
        if not TITLE_PATTERN.fullmatch(self.title) or len(self.title) > TITLE_MAX:
            raise ValueError(f"card title {self.title!r}: expected at most {TITLE_MAX} letters, digits, spaces and "
                             ".,()- (it names a file and a URL), starting with a letter or digit")


def font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def workflow_facts(nodes) -> dict:
    """What the thumbnail shows of a graph, from its nodes (id, type, widgets, links, title): the reference images
    (Load Image nodes), the prompt and negative prompt, steps, cfg, core's sampler where one is chosen, and whether it
    loads a LoRA."""
    facts = {"references": [], "prompt": "", "negative": "", "steps": None, "cfg": None, "sampler": None,
             "lora": False}
    for _, node_type, widgets, _, _ in nodes:
        if node_type == "MarkdownNote":
            continue
        values = dict(widgets)
        if node_type == "LoadImage":
            facts["references"].append(values["image"])
        facts["prompt"] = facts["prompt"] or values.get("prompt", "")
        facts["negative"] = facts["negative"] or values.get("negative_prompt", "")
        for key, widget in (("steps", "steps"), ("cfg", "cfg"), ("sampler", "sampler_name")):
            facts[key] = facts[key] if widget not in values else values[widget]
        facts["lora"] = facts["lora"] or "lora_name" in values
    return facts


def settings_line(facts: dict) -> str:
    parts = []
    if facts["steps"] is not None:
        parts.append(f"{facts['steps']} steps")
    if facts["cfg"] is not None:
        parts.append(f"CFG {facts['cfg']:g}")
    if facts["sampler"]:
        parts.append(facts["sampler"])
    if facts["lora"]:
        parts.append("LoRA")
    return " · ".join(parts)


def wrap(draw, text: str, face, width: int, lines: int) -> list[str]:
    """`text` in at most `lines` lines no wider than `width`, the last one ending in an ellipsis if text is left."""
    words, out = text.split(), []
    while words and len(out) < lines:
        line = words.pop(0)
        while words and draw.textlength(f"{line} {words[0]}", font=face) <= width:
            line = f"{line} {words.pop(0)}"
        out.append(line)
    if words:
        last = out[-1]
        while last and draw.textlength(last + "…", font=face) > width:
            last = last[:-1].rstrip()
        out[-1] = last + "…"
    return out


def _background():
    from PIL import Image

    image = Image.new("RGB", (SIDE, SIDE))
    for y in range(SIDE):
        t = y / (SIDE - 1)
        colour = tuple(round(a + (b - a) * t) for a, b in zip(BACKGROUND_TOP, BACKGROUND_BOTTOM))
        image.paste(colour, (0, y, SIDE, y + 1))
    return image


def _text_box(draw, box, text, face, fill, edge, colour, lines):
    left, top, right, bottom = box
    draw.rounded_rectangle(box, radius=14, fill=fill, outline=edge, width=3)
    y = top + 14
    for line in wrap(draw, text, face, right - left - 32, lines):
        draw.text((left + 16, y), line, font=face, fill=colour)
        y += face.size + 8


def _checkerboard(size, square=12):
    """The usual picture of transparency: a grey checkerboard of `size` (what an RGBA cut-out's empty parts show)."""
    from PIL import Image, ImageDraw

    board = Image.new("RGBA", size, CHECKER[0])
    draw = ImageDraw.Draw(board)
    for y in range(0, size[1], square):
        for x in range((y // square) % 2 * square, size[0], 2 * square):
            draw.rectangle((x, y, x + square - 1, y + square - 1), fill=CHECKER[1])
    return board


def _pictures(image, draw, paths, box):
    """The reference images in `box`, each fitted into its share over a checkerboard where it is transparent: side by
    side with a "+" between two or three, in rows of three (without the "+") for more."""
    from PIL import Image

    left, top, right, bottom = box
    rows = [paths] if len(paths) <= 3 else [paths[:3], paths[3:]]
    per_row = max(len(row) for row in rows)
    gap = 48 if len(rows) == 1 and len(paths) > 1 else 20
    share = (right - left - gap * (per_row - 1)) // per_row
    row_height = (bottom - top - gap * (len(rows) - 1)) // len(rows)
    for r, row in enumerate(rows):
        row_top = top + r * (row_height + gap)
        row_left = left + (right - left - len(row) * share - (len(row) - 1) * gap) // 2
        for i, path in enumerate(row):
            with Image.open(path) as picture:
                picture = picture.convert("RGBA")
                picture.thumbnail((share, row_height), Image.LANCZOS)
                tile = _checkerboard(picture.size)
                tile.alpha_composite(picture)
            x = row_left + i * (share + gap) + (share - tile.width) // 2
            y = row_top + (row_height - tile.height) // 2
            image.paste(tile.convert("RGB"), (x, y))
            draw.rectangle((x - 2, y - 2, x + tile.width + 1, y + tile.height + 1), outline=BOX_EDGE, width=3)
            if i and len(rows) == 1:
                draw.text((x - gap // 2, row_top + row_height // 2), "+", font=font(56), fill=TEXT, anchor="mm")


def draw_thumbnail(card: Card, nodes, inputs: Path):
    """The card's square thumbnail (an RGB PIL image, SIDE x SIDE) for the graph `nodes`; reference images are read
    from `inputs`."""
    from PIL import ImageDraw

    facts = workflow_facts(nodes)
    image = _background()
    draw = ImageDraw.Draw(image)
    # The top-left corner stays free: the 1.58 template browser puts a "Node graph" badge there.
    headline = font(58)
    right = draw.textbbox((MARGIN, 72), card.headline, font=headline, stroke_width=1)[2]
    if right > SIDE - MARGIN:
        # Drawn anyway it would run off the picture, cut mid-word on the card.
        raise ValueError(f"card {card.title!r}: headline {card.headline!r} is {right - MARGIN} px wide at size 58, "
                         f"the thumbnail has room for {SIDE - 2 * MARGIN}: shorten it")
    draw.text((MARGIN, 72), card.headline, font=headline, fill=TEXT, stroke_width=1, stroke_fill=TEXT)
    description = font(30)
    y = 146
    for line in wrap(draw, card.description, description, SIDE - 2 * MARGIN, 2):
        draw.text((MARGIN, y), line, font=description, fill=MUTED)
        y += 38
    area = (MARGIN, 230, SIDE - MARGIN, 442)
    if facts["references"]:
        _pictures(image, draw, [inputs / name for name in facts["references"]], area)
    elif facts["negative"]:
        middle = (area[1] + area[3]) // 2
        _text_box(draw, (area[0], area[1], area[2], middle - 6), f"“{facts['prompt']}”", font(28), BOX, BOX_EDGE,
                  TEXT, 2)
        _text_box(draw, (area[0], middle + 6, area[2], area[3]), f"not: {facts['negative']}", font(28),
                  NEGATIVE_BOX, NEGATIVE_EDGE, TEXT, 2)
    elif facts["prompt"]:
        _text_box(draw, area, f"“{facts['prompt']}”", font(30), BOX, BOX_EDGE, TEXT, 4)
    draw.text((MARGIN, 458), settings_line(facts), font=font(32), fill=ACCENT)
    return image


def save_thumbnail(image, path: Path) -> None:
    image.save(path, "JPEG", quality=QUALITY, optimize=True)
