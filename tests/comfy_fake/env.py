"""The fake ComfyUI with the pack loaded and tiny model files in ComfyUI's layout, without pytest (scripts run by
ComfyUI's own Python use it too, e.g. tests/core_sampling_driver.py)."""

from __future__ import annotations

import functools
import tempfile
import types
from pathlib import Path

from . import FakeComfy, load_pack, unload_pack, write_tokenizer


@functools.lru_cache(maxsize=None)
def tiny_model_dirs() -> tuple[Path, Path]:
    """(models dir with ComfyUI's single files, bf16, INT8 ConvRot and GGUF, + a diffusers folder, folder holding
    qwen25_tokenizer), written once per test process."""
    from graph_runtime.tiny import (build_tiny_components, write_comfyui_files, write_comfyui_int8_files,
                                    write_diffusers_folder)
    from graph_runtime.tiny_gguf import write_comfyui_gguf_files

    root = Path(tempfile.mkdtemp(prefix="kvgraph-nodes-"))
    models = root / "models"
    write_comfyui_files(models)
    write_comfyui_int8_files(models)
    write_comfyui_gguf_files(models, build_tiny_components(0)["transformer"])
    write_diffusers_folder(models / "diffusers" / "qwen-image-2.1-tiny")
    tokenizer_parent = root / "text_encoders"
    write_tokenizer(tokenizer_parent)
    return models, tokenizer_parent


def make_env(device: str = "cpu", real_comfy=None, pack_root=None):
    models, tokenizer_parent = tiny_model_dirs()
    fake = FakeComfy(models, tokenizer_parent, device=device, real_comfy=real_comfy).install()
    try:
        pack = load_pack() if pack_root is None else load_pack(root=pack_root)
    except BaseException:
        fake.uninstall()
        raise
    nodes = {cls.define_schema().node_id: cls for cls in pack.nodes.extension.NODE_LIST}
    return types.SimpleNamespace(fake=fake, pack=pack, nodes=nodes, models=models)


def close_env(env) -> None:
    env.pack.nodes.comfyui.model_cache.forget_all("test finished")
    unload_pack(env.pack)
    env.fake.uninstall()
