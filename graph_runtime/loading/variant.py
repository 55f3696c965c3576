"""Which Qwen-Image-2.1 checkpoint a transformer is: the base model or the distilled Turbo one.

The two have the same architecture and key layout, so the weights cannot tell them apart. The Turbo checkpoint is
named so (ComfyUI's `qwen_image_2.1_turbo_*.safetensors`, a `...-Turbo` folder); a diffusers pipeline folder of it
also ships its sampling grid as `sample_sigmas` in model_index.json (diffusers picks its Turbo pipeline on that key);
a single file may say so in its safetensors metadata (`modelspec.title`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

BASE = "base"
TURBO = "turbo"
_METADATA_KEYS = ("modelspec.title", "modelspec.architecture", "modelspec.description")


def _says_turbo(text) -> bool:
    return isinstance(text, str) and TURBO in text.lower()


def transformer_variant(path: str | os.PathLike) -> str:
    """"turbo" or "base" for a transformer file or (pipeline / transformer) folder; reads at most a header or a
    model_index.json. A path that cannot be read is "base": the loader reports what is wrong with it."""
    path = Path(path).expanduser()
    names = [path.stem if path.is_file() else path.name]
    if path.is_dir():
        for index in (path / "model_index.json", path.parent / "model_index.json"):
            try:
                if json.loads(index.read_text(encoding="utf-8")).get("sample_sigmas"):
                    return TURBO
            except (OSError, ValueError, AttributeError):
                continue
        names.append(path.parent.name if path.name == "transformer" else "")
    if any(_says_turbo(name) for name in names):
        return TURBO
    if path.is_file():
        from ..safetensors_file import read_header

        try:
            metadata = read_header(path).metadata
        except Exception:  # noqa: BLE001 - a broken file is reported by the loader, with its own message
            return BASE
        if any(_says_turbo(metadata.get(key)) for key in _METADATA_KEYS):
            return TURBO
    return BASE


# The sampler node's sigma presets: "auto" picks the Turbo grid for the Turbo checkpoint, the dynamic schedule
# otherwise.
AUTO = "auto"


def sigma_preset_for(preset: str, variant: str | None) -> str:
    """The runtime preset ("dynamic" / "turbo") a node's preset means for a model of `variant`."""
    if preset == AUTO:
        return "turbo" if variant == TURBO else "dynamic"
    return preset

