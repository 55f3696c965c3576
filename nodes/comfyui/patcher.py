"""The ModelPatcher every model of the pack is managed by: whole on its compute device, or (the transformer only)
within the memory ComfyUI gives it, or not there at all.

ComfyUI's model management loads, sizes and unloads models through a `ModelPatcher` (comfy/model_patcher.py). Its
lowvram mode streams weights through ComfyUI's own cast-on-use layers, which diffusers' and transformers' layers are
not, and the pack's captured graphs read weights at fixed addresses; so these patchers load a model whole or not at
all (the transformer excepted, below), and tell the model's owner before its weights leave (`on_unload`).

ComfyUI asks for a partial load through the same call as a whole one (0.8.0 and 0.33.0 alike):
`LoadedModel.model_load` calls `partially_load(device, extra_memory)`, where `extra_memory` is what the model may add
on the device beyond what it holds now: 1e32 when it may load whole (`force_full_load`, or nothing smaller to
say), the free memory left after the request's own needs otherwise (`--lowvram`, or not enough room), and 0.1 under
`--novram`. Where that is less than the whole transformer, its owner streams blocks from the host through fixed
device slots (graph_runtime/streaming.py, stream_slots.py), and its steps still replay captured graphs; the text
encoder and the VAE still load whole. Under `KVGRAPH_EMULATE_CARD_GB` (graph_runtime/free_memory.py) the figure is
capped to what that card would have free.
"""

from __future__ import annotations

import logging

import torch

import comfy.model_patcher

from ...graph_runtime.free_memory import emulated_card_room
from ...graph_runtime.placement import PinnedWeights

logger = logging.getLogger("kvgraph")


class ModuleHost(torch.nn.Module):
    """Holds a diffusers / transformers model for a ModelPatcher.

    ModelPatcher keeps its bookkeeping in plain attributes of the module it manages (`device`,
    `model_loaded_weight_memory`, ...). diffusers and transformers models expose `device` as a read-only property,
    so they cannot be handed over directly; this host takes the attributes and owns the model as a submodule.
    """

    def __init__(self, inner: torch.nn.Module, device: torch.device):
        super().__init__()
        self.inner = inner
        self.device = device

    def get_dtype(self):
        return next(self.inner.parameters()).dtype


def same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.type == "cpu" or (a.index or 0) == (b.index or 0)


class FullLoadPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher that loads the whole model or none of it, unless `stream_owner()` can stream its blocks.

    ComfyUI's lowvram mode streams weights through its own cast-on-use layers, which diffusers' layers are not. When
    ComfyUI asks for part of a model that cannot stream, it gets all of it; part of the transformer is a streamed
    load within ComfyUI's figure. When ComfyUI frees part, it frees all of it. Moving weights also invalidates captured
    decode graphs (they read weights at fixed addresses), so unloading tells the owner through `on_unload`.
    """

    on_unload = None  # callable(patcher), set by the handle
    placement: PinnedWeights | None = None  # loads copy from its pinned host copy; unloads drop the device copy

    def _resident_on(self, device) -> bool:
        params = list(self.model.parameters())
        owner = self.stream_owner()
        return (bool(params) and all(same_device(p.device, device) for p in params) and self.loaded_size() > 0
                and self.stream_plan() is None and not (owner is not None and owner.wants_streaming))

    def clone(self, *args, **kwargs):
        # ComfyUI's clone copies the patcher's own state but not attributes set on an instance: a clone (a LoRA
        # node's, a sampler's) must still tell the owner when it unloads the shared weights.
        copy = super().clone(*args, **kwargs)
        copy.on_unload, copy.placement = self.on_unload, self.placement
        return copy

    def stream_owner(self):
        """The owner that can run this model partly loaded (graph_runtime/loaded.py `LoadedTransformer`), or None:
        this model loads whole or not at all."""
        return None

    def stream_plan(self):
        """The plan a partial load runs under now (graph_runtime/streaming.py), or None when loaded whole or not."""
        owner = self.stream_owner()
        return owner.streaming if owner is not None else None

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        if self._resident_on(device_to):
            self._swap_object_patches()
            return 0
        owner = self.stream_owner()
        if owner is not None and self.placement is None:
            room = emulated_card_room(device_to)
            extra = extra_memory if room is None else min(extra_memory, room)
            plan = owner.plan_within(self.loaded_size() + extra)
            if plan is not None:
                return self._load_streamed(owner, device_to, plan)
            self._end_streaming(owner)  # it fits whole now: ComfyUI's own move puts the streamed blocks there
        before = self.loaded_size()
        try:
            if self.placement is not None:
                self.placement.load(device_to)  # then ComfyUI's own move finds every weight in place
            self.patch_model(device_to, lowvram_model_memory=0, load_weights=True,
                             force_patch_weights=force_patch_weights)
        except BaseException:
            # An out-of-memory halfway through would leave the model split between devices: put it all back.
            self.detach(unpatch_all=True)
            raise
        return self.loaded_size() - before

    def _end_streaming(self, owner) -> None:
        if owner.streaming is not None:
            owner.stop_streaming()
            self.model.model_lowvram = False
            self.model.model_offload_buffer_memory = 0

    def _swap_object_patches(self) -> None:
        if getattr(self, "object_patches", None) or getattr(self, "object_patches_backup", None):
            # Another clone of this model may have run last: swap its object patches for this one's, as ComfyUI's
            # own partial load does, without moving a weight.
            self.unpatch_model(self.offload_device, unpatch_weights=False)
            self.patch_model(load_weights=False)

    def _load_streamed(self, owner, device_to, plan) -> int:
        """The partial load: the owner keeps what `plan` allows on the device and streams the other blocks; ComfyUI
        is told what is really there (`model_lowvram`, the loaded bytes, the streaming buffer)."""
        before = self.loaded_size()
        try:
            if owner.streaming is None:
                self.patch_model(device_to, lowvram_model_memory=0, load_weights=False)  # object patches only
            else:
                self._swap_object_patches()
            first = owner.load_streamed(device_to, plan)
            for child in self.model.children():  # what ComfyUI's model adds around the transformer (its sampling)
                if child is not owner.transformer:
                    child.to(device_to)
        except BaseException:
            self.detach(unpatch_all=True)
            raise
        model = self.model
        model.device = torch.device(device_to)
        model.model_loaded_weight_memory = plan.resident
        model.model_offload_buffer_memory = owner.streamer.buffer_bytes
        model.model_lowvram = True
        model.current_weight_patches_uuid = self.patches_uuid
        if first:
            logger.info("KV-Graph: ComfyUI can put %s.", plan.describe(device_to))
        return max(0, plan.resident - before)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = self.loaded_size()
        self.detach(unpatch_all=True)
        return freed

    def detach(self, unpatch_all=True):
        if unpatch_all and self.on_unload is not None:
            self.on_unload(self)
        owner = self.stream_owner() if unpatch_all else None
        if owner is not None:
            self._end_streaming(owner)  # then ComfyUI's own move to the offload device moves the resident part
        if unpatch_all and self.placement is not None:
            self.placement.offload()  # then ComfyUI's own move to the offload device finds nothing to copy
        return super().detach(unpatch_all)
