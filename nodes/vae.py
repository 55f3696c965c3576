"""VAE nodes, so a workflow needs nothing outside the pack. LATENTs are raw VAE latents, as in core ComfyUI."""

from __future__ import annotations

import torch

import comfy.model_management as mm
from comfy_api.latest import io

from ..graph_runtime import memory
from ..graph_runtime.comfy_interop import (
    comfy_image_to_vae_pixels, crop_to_multiple, decode_raw_latents, encode_pixels_raw, latent_samples,
    vae_pixels_to_comfy_image,
)
from ..graph_runtime.vae_decode import should_tile
from .memory_budget import free_bytes
from .model_handles import same_device
from .types import LATENT, Vae

# Rough activation memory per input pixel of the Qwen-Image-2.1 VAE encoder, for ComfyUI's memory planning (the
# decoder's is computed from its config: graph_runtime/memory.py).
_BYTES_PER_PIXEL = 2400


@torch.no_grad()
def encode_raw(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[B, 4, 1, H, W] in [-1, 1] -> raw latents [B, 64, H/16, W/16] (the distribution's mode), on the
    intermediate device."""
    vae.ensure_loaded(memory_required=pixels.shape[-1] * pixels.shape[-2] * _BYTES_PER_PIXEL // 4)
    out = []
    for i in range(pixels.shape[0]):  # one image at a time bounds the VAE's activation memory
        out.append(encode_pixels_raw(vae.module, pixels[i:i + 1]).to(mm.intermediate_device()))
    return torch.cat(out)


@torch.no_grad()
def decode_raw(vae, raw: torch.Tensor) -> torch.Tensor:
    """Raw latents [B, 64, h, w] -> VAE output [B, 4, 16h, 16w] in [-1, 1], on the intermediate device.

    Whole images when that fits next to what is on the GPU (the transformer and its graphs stay), else tiled
    (graph_runtime/vae_decode.py); ComfyUI is asked for that much room."""
    module = vae.module
    dims = memory.VaeDims.of(module)
    height, width = raw.shape[-2] * dims.spatial_ratio, raw.shape[-1] * dims.spatial_ratio
    free = free_bytes(vae.patcher.load_device)
    if free is not None and not same_device(vae.device, vae.patcher.load_device):
        free -= dims.weight_bytes  # the VAE's own weights come first
    tiled = should_tile(module, height, width, free)
    vae.ensure_loaded(memory_required=memory.vae_decode_bytes(dims, width, height, tiled))
    out = []
    for i in range(raw.shape[0]):
        out.append(decode_raw_latents(module, raw[i:i + 1], tiled).float().to(mm.intermediate_device()))
    return torch.cat(out)


class KVGraphVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphVAEDecode",
            display_name="KV-Graph VAE Decode",
            category=LATENT,
            description=("Decodes Qwen-Image-2.1 latents (raw VAE space, from the KV-Graph sampler or core nodes) to "
                         "RGB images; the VAE's alpha channel is composited over white."),
            inputs=[
                Vae.Input("vae", tooltip="The KV-Graph VAE."),
                io.Latent.Input("latent", tooltip="Latents [batch, 64, height/16, width/16] to decode."),
            ],
            outputs=[io.Image.Output(display_name="image",
                                     tooltip="RGB images (alpha composited over white), e.g. for Save Image.")],
        )

    @classmethod
    def execute(cls, vae, latent) -> io.NodeOutput:
        raw = latent_samples(latent, "latent", vae.module.config.z_dim)
        return io.NodeOutput(vae_pixels_to_comfy_image(decode_raw(vae, raw)))


class KVGraphVAEEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphVAEEncode",
            display_name="KV-Graph VAE Encode",
            category=LATENT,
            description=("Encodes images to Qwen-Image-2.1 latents (raw VAE space), e.g. to start the sampler from an "
                         "image with denoise below 1. Sides are center-cropped to multiples of 16 px."),
            inputs=[
                Vae.Input("vae", tooltip="The KV-Graph VAE."),
                io.Image.Input("image", tooltip="Images to encode (RGB or RGBA)."),
            ],
            outputs=[io.Latent.Output(display_name="latent",
                                      tooltip="Raw VAE latents [batch, 64, height/16, width/16], e.g. for the "
                                              "sampler's latent with denoise below 1.")],
        )

    @classmethod
    def execute(cls, vae, image) -> io.NodeOutput:
        pixels = comfy_image_to_vae_pixels(crop_to_multiple(image), "image")
        return io.NodeOutput({"samples": encode_raw(vae, pixels)})


VAE_NODES = [KVGraphVAEDecode, KVGraphVAEEncode]
