"""The ModelPatcher every model of the pack is managed by: whole on its compute device or not there at all.

ComfyUI's model management loads, sizes and unloads models through a `ModelPatcher` (comfy/model_patcher.py). Its
lowvram mode streams weights through ComfyUI's own cast-on-use layers, which diffusers' and transformers' layers are
not, and the pack's captured graphs read weights at fixed addresses; so these patchers load a model whole or not at
all, and tell the model's owner before its weights leave (`on_unload`).
"""

from __future__ import annotations

import torch

import comfy.model_patcher

from ...graph_runtime.placement import PinnedWeights


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
    """A ModelPatcher that loads the whole model or none of it.

    ComfyUI's lowvram mode streams weights through its own cast-on-use layers; diffusers' layers cannot stream, so a
    partial load would leave some weights on the CPU while the rest computes on the GPU. When ComfyUI asks for part
    of the model, it gets all of it; when it frees part, it frees all of it. Moving weights also invalidates captured
    decode graphs (they read weights at fixed addresses), so unloading tells the owner through `on_unload`.
    """

    on_unload = None  # callable(patcher), set by the handle
    placement: PinnedWeights | None = None  # loads copy from its pinned host copy; unloads drop the device copy

    def _resident_on(self, device) -> bool:
        params = list(self.model.parameters())
        return bool(params) and all(same_device(p.device, device) for p in params) and self.loaded_size() > 0

    def clone(self, *args, **kwargs):
        # ComfyUI's clone copies the patcher's own state but not attributes set on an instance: a clone (a LoRA
        # node's, a sampler's) must still tell the owner when it unloads the shared weights.
        copy = super().clone(*args, **kwargs)
        copy.on_unload, copy.placement = self.on_unload, self.placement
        return copy

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        if self._resident_on(device_to):
            if getattr(self, "object_patches", None) or getattr(self, "object_patches_backup", None):
                # Another clone of this model may have run last: swap its object patches for this one's, as
                # ComfyUI's own partial load does, without moving a weight.
                self.unpatch_model(self.offload_device, unpatch_weights=False)
                self.patch_model(load_weights=False)
            return 0
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

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = self.loaded_size()
        self.detach(unpatch_all=True)
        return freed

    def detach(self, unpatch_all=True):
        if unpatch_all and self.on_unload is not None:
            self.on_unload(self)
        if unpatch_all and self.placement is not None:
            self.placement.offload()  # then ComfyUI's own move to the offload device finds nothing to copy
        return super().detach(unpatch_all)
