"""Turn what the user pointed at (a single file, a component folder, or a whole diffusers pipeline folder) into the
safetensors files to read and the folder's config.json, with a CheckpointError for every way that can go wrong."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from .detect import CheckpointInfo, inspect_shapes
from ..safetensors_file import SafetensorsHeader, read_headers

# diffusers / transformers file names, preferred over any other .safetensors in a folder.
STANDARD_WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")

# Pipelines of the previous model generation, named so the error can say so.
QWEN_IMAGE_1X_PIPELINES = {"QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline",
                           "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageLayeredPipeline"}


@dataclass
class WeightSource:
    """path: the file, or the component folder. files: its safetensors shards. config: the folder's config.json
    (None for a single file). header: the merged, validated header. info: what the header says the model is."""

    path: Path
    files: list[Path]
    config: dict | None
    header: SafetensorsHeader
    info: CheckpointInfo


def read_json(path: Path, expected: str) -> dict:
    """A JSON object from `path`, or a CheckpointError (a deeply nested document exhausts Python's parser stack,
    which `json` reports as RecursionError)."""
    try:
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"cannot be read as JSON ({exc}).", expected) from None
    except RecursionError:
        raise CheckpointError(path, "cannot be read as JSON (it is nested too deeply).", expected) from None
    if not isinstance(parsed, dict):
        raise CheckpointError(path, "is not a JSON object.", expected)
    return parsed


def pipeline_component_dir(path: Path, component: str, expected: str) -> Path | None:
    """`path/component` when `path` is a diffusers pipeline folder, else None."""
    index = path / "model_index.json"
    if index.is_file():
        name = read_json(index, expected).get("_class_name", "")
        if name in QWEN_IMAGE_1X_PIPELINES:
            raise CheckpointError(path, f"is a Qwen-Image 1.x pipeline folder ({name}), a different architecture "
                                        "from Qwen-Image-2.1.", expected)
    if index.is_file() or (path / component).is_dir():
        sub = path / component
        if not sub.is_dir():
            raise CheckpointError(path, f"is a diffusers pipeline folder without a {component}/ subfolder.", expected)
        return sub
    return None


def _shard_path(folder: Path, index: Path, name, expected: str) -> Path:
    """`folder/name` for a shard name that stays inside `folder`, read without touching the file system.

    Names are judged as written, as ComfyUI's `folder_paths` judges model names: no absolute path, no `..` that
    climbs out. A symbolic link that lives inside the folder is followed wherever it points, as ComfyUI follows it.
    Any other name gets one message that says nothing about the path it names (not even whether it exists).
    """
    if isinstance(name, str) and name and "\x00" not in name and not os.path.isabs(name):
        parts = Path(os.path.normpath(name)).parts
        if parts and ".." not in parts and not os.path.splitdrive(name)[0]:
            return folder.joinpath(*parts)
    raise CheckpointError(index, "names a shard that is not a file in its folder (shards must sit next to the "
                                 "index).", expected)


def _weight_files(folder: Path, expected: str) -> list[Path]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = read_json(indexes[0], expected).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise CheckpointError(indexes[0], "has a weight_map that is not a JSON object.", expected)
        shards = sorted({_shard_path(folder, indexes[0], name, expected) for name in weight_map.values()})
        if not shards:
            raise CheckpointError(indexes[0], "lists no shards in its weight_map.", expected)
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(shard, f"is listed in {indexes[0].name} but does not exist (an incomplete "
                                             "download?).", expected)
        return shards
    for name in STANDARD_WEIGHT_NAMES:
        if (folder / name).is_file():
            return [folder / name]
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return found
    if len(found) > 1:
        raise CheckpointError(folder, f"holds {len(found)} .safetensors files and no index saying which belong "
                                      f"together: {', '.join(p.name for p in found[:3])}.", expected)
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.ckpt")):
        raise CheckpointError(folder, "has only pickled PyTorch weights (.bin/.pt/.ckpt); only .safetensors are "
                                      "loaded.", expected)
    raise CheckpointError(folder, "has no .safetensors weights.", expected)


def resolve(path: str | os.PathLike, component: str, expected: str) -> WeightSource:
    """Resolve `path` for `component` ("transformer", "vae" or "text_encoder") and validate its headers."""
    path = Path(path).expanduser()
    if not os.path.exists(path):  # False, not an OSError, for a name too long for the file system
        raise CheckpointError(path, "does not exist.", expected)
    if path.is_file():
        header = read_headers([path], expected)
        return WeightSource(path=path, files=[path], config=None, header=header, info=inspect_shapes(header.shapes))
    folder = pipeline_component_dir(path, component, expected) or path
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(folder, "is a folder without config.json or model_index.json: not a diffusers "
                                      "pipeline or component folder.", expected)
    config = read_json(config_path, expected)
    files = _weight_files(folder, expected)
    header = read_headers(files, expected)
    return WeightSource(path=folder, files=files, config=config, header=header, info=inspect_shapes(header.shapes))
