"""The images the edit example workflows load, copied into ComfyUI's input folder at start-up.

The edit examples' Load Image nodes name files of the input folder; a fresh install has none of them, and ComfyUI
refuses such a prompt ("Invalid image file"). The pack ships them in example_workflows/inputs/ and, when ComfyUI
loads it, copies each one whose name is not in the input folder yet. A file of that name already there is the
user's and is never replaced. Only the standard library here: the module imports (and its functions run) without
ComfyUI.
"""

from __future__ import annotations

import logging
import os
import shutil

logger = logging.getLogger("kvgraph")

INPUTS_DIRECTORY = os.path.join("example_workflows", "inputs")


def copy_missing_inputs(source_dir: str, input_dir: str) -> list[str]:
    """Copy every file of `source_dir` into `input_dir` whose name is not there yet (the folder is made when
    missing); returns the names copied, sorted. Never overwrites: an existing file or folder of that name stays."""
    if not os.path.isdir(source_dir):
        return []
    names = sorted(n for n in os.listdir(source_dir) if os.path.isfile(os.path.join(source_dir, n)))
    copied = []
    for name in names:
        target = os.path.join(input_dir, name)
        if os.path.lexists(target):
            continue
        os.makedirs(input_dir, exist_ok=True)
        try:
            # "x": a file that appeared since the check (another process, a user's upload) is left alone as well.
            with open(os.path.join(source_dir, name), "rb") as src, open(target, "xb") as dst:
                try:
                    shutil.copyfileobj(src, dst)
                except OSError:
                    dst.close()
                    os.remove(target)  # only the half-written copy this call created
                    raise
        except FileExistsError:
            continue
        copied.append(name)
    return copied


def install_example_inputs(pack_dir: str) -> list[str]:
    """Copy the examples' missing input images into ComfyUI's input folder (folder_paths.get_input_directory());
    logs one line naming what was copied, or nothing when nothing was. A failure (no ComfyUI folder_paths, a
    read-only folder) is logged and never stops the pack from loading; returns the names copied."""
    try:
        import folder_paths

        input_dir = folder_paths.get_input_directory()
    except (ImportError, AttributeError) as exc:
        logger.debug("KV-Graph: no ComfyUI input folder to copy the example images into: %s", exc)
        return []
    try:
        copied = copy_missing_inputs(os.path.join(pack_dir, INPUTS_DIRECTORY), input_dir)
    except OSError as exc:
        logger.warning("KV-Graph: could not copy the edit examples' reference images into %s: %s", input_dir, exc)
        return []
    if copied:
        logger.info("KV-Graph: copied the edit examples' reference images into ComfyUI's input folder %s: %s",
                    input_dir, ", ".join(copied))
    return copied
