"""Where the user's model files are: ComfyUI's model folders (folder_paths), and ComfyUI's bundled Qwen tokenizer."""

from __future__ import annotations

import os

import folder_paths

from ..graph_runtime.errors import CheckpointError

DIFFUSERS = "diffusers"


def file_choices(folder: str, default: str, *known: str) -> list[str]:
    """The files ComfyUI lists in a model folder, with our default name kept first (then the other `known` release
    names) so a fresh node shows them even before the file is downloaded (running then fails with a message naming
    the file)."""
    try:
        names = list(folder_paths.get_filename_list(folder))
    except Exception:  # an unknown folder name in an unusual ComfyUI setup: offer the known names only
        names = []
    first = list(dict.fromkeys((default, *known)))
    return first + [n for n in names if n not in first]


def full_path(folder: str, name: str, input_name: str) -> str:
    path = folder_paths.get_full_path(folder, name)
    if path is None:
        searched = ", ".join(folder_paths.get_folder_paths(folder)) or f"models/{folder}"
        raise CheckpointError(name, f"was not found in ComfyUI's {folder} folder ({searched}).",
                              f"the file named in '{input_name}' to exist in models/{folder}")
    return path


def diffusers_choices() -> list[str]:
    """Folders under models/diffusers that hold a diffusers pipeline (a model_index.json), relative to it."""
    found = []
    for root in folder_paths.get_folder_paths(DIFFUSERS):
        if not os.path.isdir(root):
            continue
        for dirpath, _, files in os.walk(root, followlinks=True):
            if "model_index.json" in files:
                found.append(os.path.relpath(dirpath, root))
    return sorted(set(found))


def diffusers_path(name: str, input_name: str = "folder") -> str:
    for root in folder_paths.get_folder_paths(DIFFUSERS):
        path = os.path.join(root, name)
        if os.path.isdir(path):
            return path
    raise CheckpointError(name, "was not found under ComfyUI's models/diffusers folder.",
                          f"'{input_name}' to name a diffusers pipeline folder in models/diffusers")


def bundled_tokenizer_dir() -> str | None:
    """ComfyUI ships Qwen's tokenizer (comfy/text_encoders/qwen25_tokenizer); a single-file text encoder needs it."""
    try:
        import comfy.text_encoders
    except ImportError:
        return None
    # comfy/text_encoders is a namespace package (no __init__.py, so no __file__): search its __path__.
    for folder in getattr(comfy.text_encoders, "__path__", []):
        path = os.path.join(folder, "qwen25_tokenizer")
        if os.path.isdir(path):
            return path
    return None
