"""An encode with the text encoder streamed by layer: its embeddings, final norm and vision tower on the device, its
decoder layers visiting one or two at a time (layer_stream.py), from the one host copy it keeps anyway
(placement.PinnedWeights). For a card that cannot hold the whole encoder (16.3 GB in bf16) next to an encode."""

from __future__ import annotations

import contextlib

import torch

from ..layer_stream import LayerStream
from ..placement import PinnedWeights
from ..text_encoder_layers import decoder_layers

# Layers uploaded ahead of the one running: one, so an upload overlaps a layer's compute with two layers on the device.
AHEAD = 1


def layer_stream(text_encoder: torch.nn.Module, device, weights: PinnedWeights | None = None,
                 ahead: int = AHEAD) -> LayerStream:
    """The (not yet started) stream of `text_encoder`'s decoder layers onto `device`, from `weights` (its host copy;
    None: a pageable one is made now, which the module keeps pointing at afterwards)."""
    layers = decoder_layers(text_encoder)
    if layers is None:
        raise TypeError(f"{type(text_encoder).__name__} has no decoder layers to stream (expected a Qwen3-VL model)")
    if weights is None:
        weights = PinnedWeights(text_encoder, device, pin=False, log=False)
    return LayerStream(weights, layers, device, ahead=ahead, name="the text encoder")


@contextlib.contextmanager
def streamed_by_layer(text_encoder: torch.nn.Module, device, weights: PinnedWeights | None = None,
                      ahead: int = AHEAD):
    """Inside: `text_encoder` runs on `device` with its decoder layers streamed; after: every weight back on the
    host copy and no hook left, whatever happened inside."""
    stream = layer_stream(text_encoder, device, weights, ahead).start()
    try:
        yield stream
    finally:
        stream.stop()
