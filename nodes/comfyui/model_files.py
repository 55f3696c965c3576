"""Where the user's model files are: ComfyUI's model folders (folder_paths), and ComfyUI's bundled Qwen tokenizer.

Every name a loader node opens goes through graph_runtime.loading.paths: a name that would leave its model folder
(absolute, or with a '..') is refused with one message, before anything outside the folder is looked at. ComfyUI's
own `folder_paths.get_full_path` is not used: it silently rewrites such names into other names inside the folder.
"""

from __future__ import annotations

import os

import folder_paths

from ...graph_runtime.comfy_interop.files import file_identity
from ...graph_runtime.errors import CheckpointError
from ...graph_runtime.loading.paths import find_in_folders

DIFFUSERS = "diffusers"
GGUF = ".gguf"
# ComfyUI-GGUF's loaders list `unet` and `clip` (on current ComfyUI other names for diffusion_models and
# text_encoders): a folder registered under those names alone is searched too.
ALSO_SEARCHED = {"diffusion_models": ("unet",), "text_encoders": ("clip",)}


def folder_roots(folder: str) -> list[str]:
    roots = []
    for name in (folder, *ALSO_SEARCHED.get(folder, ())):
        try:
            roots += [r for r in folder_paths.get_folder_paths(name) if r not in roots]
        except Exception:  # noqa: BLE001 - a folder name this ComfyUI does not register
            continue
    return roots


def gguf_choices(folder: str) -> list[str]:
    """The .gguf files under `folder`'s model folders (ComfyUI lists only its own extensions there unless
    ComfyUI-GGUF is installed), relative to their folder, sorted."""
    found = set()
    for root in folder_roots(folder):
        for dirpath, _, files in os.walk(root, followlinks=True):
            found.update(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                         for f in files if f.lower().endswith(GGUF))
    return sorted(found)


def file_choices(folder: str, default: str, *known: str) -> list[str]:
    """The files ComfyUI lists in a model folder, with our default name kept first (then the other `known` release
    names) so a fresh node shows them even before the file is downloaded (running then fails with a message naming
    the file)."""
    try:
        names = list(folder_paths.get_filename_list(folder))
    except Exception:  # an unknown folder name in an unusual ComfyUI setup: offer the known names only
        names = []
    if folder in ALSO_SEARCHED:
        names += gguf_choices(folder)
    first = list(dict.fromkeys((default, *known)))
    return first + list(dict.fromkeys(n for n in names if n not in first))


def full_path(folder: str, name: str, input_name: str) -> str:
    """The file `name` in ComfyUI's `folder` model folders (symlinks inside them followed, as ComfyUI does)."""
    roots = folder_roots(folder)
    path = find_in_folders(roots, name, input_name=input_name, folder=folder)
    if path is None:
        searched = ", ".join(roots) or f"models/{folder}"
        raise CheckpointError(name, f"was not found in ComfyUI's {folder} folder ({searched}).",
                              f"the file named in '{input_name}' to exist in models/{folder}")
    return path


def fingerprint(folder: str, name: str, *rest) -> tuple:
    """A loader node's `fingerprint_inputs`: the file's identity (graph_runtime.comfy_interop.files) and `rest`, so
    ComfyUI runs the node again when the file changes on disk, not only when a widget changes."""
    try:
        return (file_identity(full_path(folder, name, "")), *rest)
    except Exception:  # noqa: BLE001 - a missing file is reported by execute, with a proper message
        return (name, *rest)


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
    path = find_in_folders(folder_paths.get_folder_paths(DIFFUSERS), name, input_name=input_name, folder=DIFFUSERS,
                           directory=True)
    if path is None:
        raise CheckpointError(name, "was not found under ComfyUI's models/diffusers folder.",
                              f"'{input_name}' to name a diffusers pipeline folder in models/diffusers")
    return path


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


def files_in(folder: str) -> list[str]:
    """Every file under `folder`'s model folders (full paths)."""
    return [os.path.join(dirpath, f) for root in folder_roots(folder)
            for dirpath, _, files in os.walk(root, followlinks=True) for f in files]
