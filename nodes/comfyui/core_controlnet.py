"""Core's Qwen-Image-2.1 Fun ControlNet (ComfyUI 0.38+: *Load Model Patch*, then *ZImageFunControlnet* or
*QwenImageDiffsynthControlnet*) recognised on a KV-Graph MODEL and run by the pack.

Core's apply node registers the ControlNet as block replace patches (`patches_replace["dit"][("single_block", i)]`,
objects of its class `QwenImage21FunControlBlockPatch`) over one shared state object holding the loaded net, the VAE,
the images, the strength and the sigma range. A KV-Graph MODEL does not run core's block code, so instead of ignoring
those patches the pack reads that state and runs the same net in its own control stream (graph_runtime/controlnet).
Read by attribute, not by import: ComfyUI before 0.38 has no such class.
"""

from __future__ import annotations

import weakref

import comfy.model_management as mm

from ...graph_runtime.comfy_interop.latents import latent_stats, raw_to_normalized
from ...graph_runtime.controlnet import ControlSpec, FunControlNet
from ...graph_runtime.controlnet.file import check_shapes, to_module_state_dict
from ...graph_runtime.errors import InputError

PATCH_CLASS = "QwenImage21FunControlBlockPatch"
_nets: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # core's net module -> the pack's copy


def core_fun_control_patches(transformer_options: dict) -> dict:
    """Core's Fun ControlNet block patches among `transformer_options`' block replace patches, by key."""
    dit = (transformer_options.get("patches_replace") or {}).get("dit") or {}
    return {key: patch for key, patch in dit.items() if type(patch).__name__ == PATCH_CLASS}


def control_from_core(transformer_options: dict) -> ControlSpec | None:
    """The ControlSpec of core's Fun ControlNet on this MODEL, or None where core's apply node put none there."""
    patches = core_fun_control_patches(transformer_options)
    states = {id(p.control_patch): p.control_patch for p in patches.values()}
    if not states:
        return None
    if len(states) > 1:
        raise InputError("model", f"{len(states)} Fun ControlNets applied by core's nodes",
                         "one ControlNet per KV-Graph model")
    state = next(iter(states.values()))
    if any(getattr(p, "previous", None) is not None for p in patches.values()):
        raise InputError("model", "core's Fun ControlNet over other block patches", "the ControlNet alone")
    stats = latent_stats()

    def encode(pixels):
        return raw_to_normalized(state.vae.encode(pixels[..., :3]), stats)

    encode = restoring_loaded_models(encode)

    low, high = sorted(float(s) for s in state.sigma_range)
    return ControlSpec(_net_of(state.model_patch.model), encode, float(state.strength), sigma_start=high,
                       sigma_end=low, image=state.image, inpaint_image=state.inpaint_image, mask=state.mask)


def restoring_loaded_models(encode):
    """`encode` that leaves the models the running prompt uses loaded as it found them: the control images are
    encoded once the sampler has loaded the model, and loading the VAE may have made ComfyUI unload it (what core's
    own ControlNet nodes do around their encode)."""

    def wrapped(pixels):
        loaded = mm.loaded_models(only_currently_used=True)
        try:
            return encode(pixels)
        finally:
            if loaded:
                mm.load_models_gpu(loaded)

    return wrapped


def _net_of(module) -> FunControlNet:
    """The pack's copy of core's loaded net (made once per loaded net), checked as a file would be."""
    net = _nets.get(module)
    if net is None:
        tensors = {k: v.detach() for k, v in module.state_dict().items()}
        where = "core's Load Model Patch ControlNet"
        config = check_shapes({k: tuple(v.shape) for k, v in tensors.items()}, where)
        net = FunControlNet(**config, name=where)
        net.load_state_dict(to_module_state_dict({k: v.clone() for k, v in tensors.items()}), strict=True)
        net.to(next(iter(tensors.values())).dtype)
        _nets[module] = net
    return net
