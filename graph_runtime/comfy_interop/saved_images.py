"""IMAGE batches saved as ComfyUI's SaveImage saves them (the same files, names and metadata), with the PNGs deflated
on several CPU threads (graph_runtime/png_writer.py).

ComfyUI's own parts stay with ComfyUI: the caller passes what `folder_paths.get_save_image_path` returned and whether
metadata is disabled (`--disable-metadata`). Unlike core, an existing file is never replaced: core's counter misses
earlier files when the prefix is empty, ends in a slash or holds `%batch_num%`, so the counter here also goes past
every file of the batch's names, and each PNG takes its name only once complete, and only if no file has it
(graph_runtime/output_files.py).
"""

from __future__ import annotations

import itertools
import json
import os
import re

import numpy as np
import torch

from ..errors import InputError
from ..output_files import write_new_file
from ..png_writer import COMFYUI_COMPRESS_LEVEL, write_png

BATCH_NUM = "%batch_num%"


def prefix_text(value) -> str:
    """The filename prefix as text: a number (a linked INT or FLOAT) is used as its digits, as a typed one would
    be; anything else that is not text is refused, naming the input."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return str(value)
    raise InputError("filename_prefix", value, "text (a STRING, or a number used as text), e.g. ComfyUI or "
                                               "photos/day1_%batch_num%")


def next_free_counter(folder: str, filename: str, counter: int) -> int:
    """`counter` (core's), or past the highest counter of any file in `folder` named `<filename>_<counter>...` with
    `%batch_num%` standing for any number: the counter core's SaveImage would give had it seen every earlier file of
    these names."""
    parts = [re.escape(part) for part in filename.split(BATCH_NUM)]
    flags = re.IGNORECASE if os.path.normcase("A") == "a" else 0
    pattern = re.compile(r"\d+".join(parts) + r"_(\d+)(?:[_.]|$)", flags)
    try:
        names = os.listdir(folder)
    except OSError:
        return counter
    found = [int(m.group(1)) for name in names if (m := pattern.match(name))]
    return max([counter, *(n + 1 for n in found)])


def saved_pixels(image: torch.Tensor):
    """One IMAGE `[H, W, C]` in [0, 1] as a PIL image, converted as SaveImage converts it (255 x, clipped, truncated
    to uint8), so the file's pixels are the ones SaveImage would write."""
    from PIL import Image

    return Image.fromarray(np.clip(255.0 * image.cpu().numpy(), 0, 255).astype(np.uint8))


def png_text(prompt, extra_pnginfo) -> dict[str, str]:
    """The text SaveImage writes: the prompt as "prompt" and each key of `extra_pnginfo` (the frontend's "workflow")
    under its own name, every value as JSON; nothing for a value that is None."""
    text = {}
    if prompt is not None:
        text["prompt"] = json.dumps(prompt)
    if extra_pnginfo is not None:
        for key in extra_pnginfo:
            text[key] = json.dumps(extra_pnginfo[key])
    return text


def save_batch(images: torch.Tensor, folder: str, filename: str, counter: int, subfolder: str,
               text: dict[str, str] | None, folder_type: str = "output",
               compress_level: int = COMFYUI_COMPRESS_LEVEL) -> list[dict]:
    """Each image of `images` written as `<filename>_<counter:05>_.png` in `folder`, `%batch_num%` in `filename`
    replaced by the image's index in the batch (what `folder_paths.get_save_image_path` and SaveImage do), the
    counter counting up from `counter` or from past the files already there (`next_free_counter`), and skipping any
    name a file has meanwhile taken; `text` in every file. Returns the UI's entries, one per file:
    {"filename", "subfolder", "type"}."""
    counter = next_free_counter(folder, filename, counter)
    results = []
    for batch_number, image in enumerate(images):
        stem = filename.replace(BATCH_NUM, str(batch_number))
        pixels = saved_pixels(image)
        taken = write_new_file((os.path.join(folder, f"{stem}_{n:05}_.png") for n in itertools.count(counter)),
                               lambda file: write_png(file, pixels, compress_level, text=text))
        results.append({"filename": taken.name, "subfolder": subfolder, "type": folder_type})
        counter = int(taken.name[len(stem) + 1:-len("_.png")]) + 1
    return results
