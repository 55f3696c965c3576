"""The text encoder's decoder layers: what a streamed-by-layer encode (encoding/streamed.py) moves one at a time, and
what the memory plan counts apart from the rest (embeddings, final norm, vision tower)."""

from __future__ import annotations

import torch

from .report import module_bytes


def decoder_layers(text_encoder: torch.nn.Module) -> torch.nn.ModuleList | None:
    """Qwen3-VL's language-model decoder layers (`model.language_model.layers`), or None for a module without
    them."""
    model = getattr(text_encoder, "model", text_encoder)
    text = getattr(model, "language_model", model)
    layers = getattr(text, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


def decoder_layer_bytes(text_encoder: torch.nn.Module) -> tuple[int, list[int]]:
    """(the whole encoder's bytes, each decoder layer's); no layers: an empty list."""
    layers = decoder_layers(text_encoder)
    return module_bytes(text_encoder), [] if layers is None else [module_bytes(layer) for layer in layers]
