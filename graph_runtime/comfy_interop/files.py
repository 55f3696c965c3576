"""A model file's (or folder's) identity, which the pack's loaded-model cache and ComfyUI's re-run checks key on.

Kept here because it is what ComfyUI's loaders compare between prompts; it reads only the file system.
"""

from __future__ import annotations

import os
from pathlib import Path


def file_identity(path: str | os.PathLike) -> tuple:
    """What makes a model file (or folder) the same one: real path plus size and mtime of every weight file in it.

    A folder's identity covers its `.safetensors`/`.json` files one level down (a diffusers pipeline keeps each
    component in a subfolder), so replacing any shard changes it.
    """
    real = Path(os.path.realpath(path))
    if real.is_file():
        st = real.stat()
        return (str(real), st.st_size, st.st_mtime_ns)
    parts = []
    for f in sorted(real.rglob("*")):
        if f.is_file() and f.suffix in (".safetensors", ".json") and len(f.relative_to(real).parts) <= 2:
            st = f.stat()
            parts.append((str(f.relative_to(real)), st.st_size, st.st_mtime_ns))
    return (str(real), tuple(parts))
