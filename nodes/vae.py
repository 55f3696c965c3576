"""VAE nodes, so a workflow needs nothing outside the pack. LATENTs are raw VAE latents, as in core ComfyUI."""

from __future__ import annotations

import torch

import comfy.model_management as mm
import comfy.utils
from comfy_api.latest import io

from ..graph_runtime import in_flight, memory
from ..graph_runtime.memory import check_decoded_on_host
from ..graph_runtime.comfy_interop.latents import latent_samples
from ..graph_runtime.comfy_interop.pixels import (
    comfy_image_to_vae_pixels, crop_to_multiple, vae_pixels_to_comfy_image, vae_pixels_to_comfy_mask,
)
from ..graph_runtime.encoding.images import decode_each, encode_each
from ..graph_runtime.validation import check_finite
from ..graph_runtime.vae_decode import check_decoded, plan_decode
from .comfyui.memory import free_bytes
from .comfyui.model_handles import VAEHandle, expect_handle, same_device
from .comfyui.types import LATENT, Vae


def encode_raw(vae, pixels: torch.Tensor) -> torch.Tensor:
    """[B, 4, 1, H, W] in [-1, 1] -> raw latents [B, 64, H/16, W/16] (the distribution's mode), on the
    intermediate device; ComfyUI is asked for the room one image's encode needs (they are encoded one at a time)."""
    with in_flight.using(vae):  # a release of models meanwhile waits for the encode to end
        vae.ensure_loaded(memory_required=memory.vae_encode_bytes(pixels.shape[-1], pixels.shape[-2]))
        device = mm.intermediate_device()
        return encode_each(vae.module, pixels, finish=lambda latent: latent.to(device))


def decode_to_images(vae, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw latents [B, 64, h, w] -> ComfyUI IMAGE [B, 16h, 16w, 3] (alpha over white) and the alpha channel as a MASK
    [B, 16h, 16w] (1 - alpha, as core's Load Image gives it), on the intermediate device.

    Whole images when that fits next to what is on the GPU (the transformer and its graphs stay), else tiled
    (graph_runtime/vae_decode.py); ComfyUI is asked for that much room. The whole batch's IMAGE and MASK must fit in
    host memory (with one image's decode, when the VAE runs on the CPU), or nothing is decoded and the refusal names
    the largest batch that fits. Images are decoded one at a time, each converted and written into the IMAGE and the
    MASK as soon as it is made, with an interrupt check and a progress update between them."""
    plan = plan_decode(vae.module, raw.shape[-2], raw.shape[-1], free_bytes(vae.patcher.load_device),
                       weights_to_load=not same_device(vae.device, vae.patcher.load_device))
    on_cpu = same_device(vae.patcher.load_device, "cpu")
    check_decoded_on_host(plan.width, plan.height, raw.shape[0],
                          memory.IMAGE_BYTES_PER_PIXEL + memory.MASK_BYTES_PER_PIXEL,
                          plan.bytes if on_cpu else 0, name="a latent batch", free=free_bytes(torch.device("cpu")))
    device = mm.intermediate_device()
    bar = comfy.utils.ProgressBar(raw.shape[0])

    def before(index: int, total: int) -> None:
        bar.update_absolute(index, total)  # also ComfyUI's interrupt check
        mm.throw_exception_if_processing_interrupted()

    masks, done = None, 0  # the batch's MASK, allocated with the first image (as decode_each allocates the IMAGE)

    def finish(image: torch.Tensor) -> torch.Tensor:
        nonlocal masks, done
        mask = vae_pixels_to_comfy_mask(image).to(device)
        if masks is None:
            masks = mask.new_empty((raw.shape[0], *mask.shape[1:]))
        masks[done:done + 1] = mask
        done += 1
        return vae_pixels_to_comfy_image(image).to(device)

    with in_flight.using(vae):  # a release of models meanwhile waits for the decode to end
        vae.ensure_loaded(memory_required=plan.bytes)
        images = decode_each(vae.module, raw, plan.tiled, before=before,
                             check=lambda image, index, count: check_decoded(image, vae.source, (index, count)),
                             finish=finish)
    return images, masks


class KVGraphVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphVAEDecode",
            display_name="KV-Graph VAE Decode",
            category=LATENT,
            description=("Decodes Qwen-Image-2.1 latents (raw VAE space, from the KV-Graph sampler or core nodes) to "
                         "RGB images with the VAE's alpha channel composited over white, and that alpha channel as a "
                         "mask (as core's Load Image gives it: 1 where transparent), e.g. for Join Image with Alpha "
                         "and a transparent PNG."),
            inputs=[
                Vae.Input("vae", tooltip="The KV-Graph VAE."),
                io.Latent.Input("latent", tooltip="Latents [batch, 64, height/16, width/16] to decode."),
            ],
            outputs=[io.Image.Output(display_name="image",
                                     tooltip="RGB images (alpha composited over white), e.g. for Save Image."),
                     io.Mask.Output(display_name="mask",
                                    tooltip="The VAE's alpha channel as core's Load Image gives a mask: 1 - alpha, so "
                                            "1 where the image is transparent. Join Image with Alpha (image + this "
                                            "mask) makes an RGBA image, which Save Image writes as a transparent "
                                            "PNG.")],
        )

    @classmethod
    def execute(cls, vae, latent) -> io.NodeOutput:
        expect_handle("vae", vae, VAEHandle)
        raw = latent_samples(latent, "latent", vae.module.config.z_dim)
        # Checked before decoding, so that a bad image afterwards can only come from the VAE.
        check_finite("latent", raw, "NaN/inf in a latent come from where it was made: a file read by Load Latent, "
                                    "or the node that produced it")
        return io.NodeOutput(*decode_to_images(vae, raw))


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
        expect_handle("vae", vae, VAEHandle)
        pixels = comfy_image_to_vae_pixels(crop_to_multiple(image), "image")
        return io.NodeOutput({"samples": encode_raw(vae, pixels)})


VAE_NODES = [KVGraphVAEDecode, KVGraphVAEEncode]
