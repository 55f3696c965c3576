"""Load a whole diffusers Qwen-Image-2.1 pipeline folder, or the parts of it a caller asks for."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ..errors import CheckpointError
from .processor import tokenizer_folder
from .scheduler_config import read_scheduler_config
from .sources import pipeline_component_dir

COMPONENTS = ("transformer", "vae", "text_encoder")
EXPECTED = "a diffusers Qwen-Image-2.1 pipeline folder (model_index.json, transformer/, vae/, text_encoder/, processor/)"


def default_scheduler_config() -> dict[str, Any]:
    """The flow-matching Euler schedule Qwen-Image-2.1 samples with: dynamic (resolution-dependent) exponential
    shift between 0.5 at 256 tokens and 0.9 at 8192, terminal shift 0.02. Used when a folder has no scheduler/."""
    return {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 0.9,
        "base_image_seq_len": 256,
        "max_image_seq_len": 8192,
        "shift_terminal": 0.02,
        "time_shift_type": "exponential",
    }


@dataclass
class QwenImageModels:
    """What `load_pipeline_folder` returns; components not asked for stay None. `sources` maps each loaded component
    (and "processor", and "scheduler" when read from disk) to the absolute folder it came from."""

    transformer: Any = None
    vae: Any = None
    text_encoder: Any = None
    processor: Any = None
    scheduler_config: dict = field(default_factory=default_scheduler_config)
    sources: dict[str, str] = field(default_factory=dict)


def load_pipeline_folder(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                         device: str | torch.device = "cpu",
                         components: Iterable[str] = COMPONENTS,
                         text_encoder_device: str | torch.device | None = None) -> QwenImageModels:
    """Load the requested components of a diffusers pipeline folder (the text encoder comes with its processor, on
    `text_encoder_device`, default `device`)."""
    from .text_encoder import load_text_encoder
    from .transformer import load_transformer
    from .vae import load_vae

    root = Path(path).expanduser()
    components = tuple(components)
    unknown = [c for c in components if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"components={unknown!r}: expected some of {COMPONENTS}")
    if not os.path.isdir(root):  # os.path: False, not an OSError, for a name too long for the file system
        raise CheckpointError(root, "does not exist." if not os.path.exists(root) else "is a file, not a folder.", EXPECTED)
    if not (root / "model_index.json").is_file():
        raise CheckpointError(root, "has no model_index.json: not a diffusers pipeline folder.", EXPECTED)

    models = QwenImageModels()
    for name in components:
        folder = pipeline_component_dir(root, name, EXPECTED)
        models.sources[name] = str(folder.resolve())
    if "transformer" in components:
        models.transformer = load_transformer(root, dtype=dtype, device=device)
    if "vae" in components:
        models.vae = load_vae(root, dtype=dtype, device=device)
    if "text_encoder" in components:
        models.text_encoder, models.processor = load_text_encoder(root, dtype=dtype,
                                                                device=text_encoder_device or device)
        models.sources["processor"] = str(tokenizer_folder(root).resolve())
    scheduler = read_scheduler_config(root)
    if scheduler is not None:
        models.scheduler_config = scheduler
        models.sources["scheduler"] = str((root / "scheduler").resolve())
    return models
