"""IMAGE batches saved as ComfyUI's SaveImage saves them (the same files, names and metadata), with the PNGs deflated
on several CPU threads (graph_runtime/png_writer.py).

ComfyUI's own parts stay with ComfyUI: the caller passes what `folder_paths.get_save_image_path` returned and whether
metadata is disabled (`--disable-metadata`).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from ..png_writer import COMFYUI_COMPRESS_LEVEL, write_png


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
    """Each image of `images` written as `<filename>_<counter:05>_.png` in `folder`, the counter counting up from
    `counter` and `%batch_num%` in `filename` replaced by the image's index in the batch (what
    `folder_paths.get_save_image_path` and SaveImage do); `text` in every file. Returns the UI's entries, one per
    file: {"filename", "subfolder", "type"}."""
    results = []
    for batch_number, image in enumerate(images):
        name = f"{filename.replace('%batch_num%', str(batch_number))}_{counter:05}_.png"
        with open(os.path.join(folder, name), "wb") as file:
            write_png(file, saved_pixels(image), compress_level, text=text)
        results.append({"filename": name, "subfolder": subfolder, "type": folder_type})
        counter += 1
    return results
