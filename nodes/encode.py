"""KVGraphTextEncode: prompt (+ up to 10 reference images) -> positive / negative CONDITIONING and an empty LATENT.

The CONDITIONING is in core ComfyUI's Qwen-Image-2.1 format (vision rows dropped, `image_slots`, raw
`reference_latents`), so core's sampler can read it too; the KV-Graph sampler reads it back losslessly.
"""

from __future__ import annotations

import torch

import comfy.model_management as mm
from comfy_api.latest import io

from ..graph_runtime.comfy_interop.conditioning import conditioning_to, prompt_to_conditioning
from ..graph_runtime.comfy_interop.latents import empty_latent
from ..graph_runtime.comfy_interop.pixels import check_image, comfy_image_to_pil
from ..graph_runtime.encoding.images import prepare_references
from ..graph_runtime.errors import InputError
from ..graph_runtime.validation import MAX_REFERENCES, check_size
from .comfyui.memory import encode_placement
from .comfyui.model_handles import TextEncoderHandle, VAEHandle, expect_handle
from .comfyui.types import CONDITIONING, TextEncoder, Vae
from .vae import encode_raw

MAX_SIZE = 8192


REFERENCE_SOCKETS = [f"image{i}" for i in range(1, MAX_REFERENCES + 1)]


GROUP = "images."  # how ComfyUI names a reference socket in a prompt: "images.image1"


def check_sockets(images, others) -> None:
    """Refuse reference sockets that do not exist (`images.image0`, `images.image11`, `images.imagefoo` sent
    through the API): in `images` itself, or handed over as separate inputs (ComfyUI passes a socket it does not
    know under its prompt name, `others` here)."""
    names = set(images or {}) | {k[len(GROUP):] for k in others if k.startswith(GROUP)}
    unknown = sorted(names - set(REFERENCE_SOCKETS))
    if unknown:
        raise InputError("images", unknown, f"at most {MAX_REFERENCES} reference images, at sockets "
                                            f"{REFERENCE_SOCKETS[0]} to {REFERENCE_SOCKETS[-1]}")
    strays = sorted(k for k in others if not k.startswith(GROUP))
    if strays:
        raise InputError("inputs", strays, "only the inputs KV-Graph Text Encode has")


def reference_images(images, others=()) -> list:
    """The connected reference sockets' images in socket order (image1, image2, ...), each checked to be an IMAGE.
    A socket left empty between connected ones is skipped, so the prompt's image numbers follow the images actually
    given."""
    check_sockets(images, others)
    images = images or {}
    return [check_image(images[name], f"{GROUP}{name}") for name in REFERENCE_SOCKETS
            if images.get(name) is not None]


class KVGraphTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphTextEncode",
            display_name="KV-Graph Text Encode (Qwen-Image-2.1)",
            category=CONDITIONING,
            description=(
                "Encodes the prompt (and the negative prompt) with Qwen3-VL exactly as the Qwen-Image-2.1 pipeline "
                "does. Connect reference images (and the VAE) to edit them. Also outputs an empty latent of the "
                "image size to sample."
            ),
            inputs=[
                TextEncoder.Input("text_encoder", tooltip="From a KV-Graph text encoder or diffusers loader."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="What to generate, or for an edit, what to change in the reference images "
                                        "(refer to them as image 1, image 2...)."),
                io.String.Input("negative_prompt", multiline=True, default="",
                                tooltip="What to steer away from; leave empty for none. Used only when the sampler's "
                                        "cfg is above 1."),
                io.Int.Input("width", default=1024, min=16, max=MAX_SIZE, step=16,
                             tooltip="Output width in pixels, a multiple of 16 (the VAE works on a 16 px grid)."),
                io.Int.Input("height", default=1024, min=16, max=MAX_SIZE, step=16,
                             tooltip="Output height in pixels, a multiple of 16."),
                io.Boolean.Input("size_from_reference", default=True,
                                 tooltip="With reference images connected, size the output like the last reference "
                                         "(at reference_resolution), as the Qwen-Image-2.1 pipeline does; other "
                                         "sizes shift the edit. Off: always use width and height."),
                io.Int.Input("reference_resolution", default=1024, min=64, max=4096, step=32,
                             tooltip="Reference images are resized to about this many pixels squared, keeping "
                                     "their aspect ratio, in multiples of 32."),
                Vae.Input("vae", optional=True,
                          tooltip="The KV-Graph VAE; needed when reference images are connected (they enter the "
                                  "transformer as latents)."),
                # min 0: every socket optional (ComfyUI 0.33 requires the first `min`); the template input itself
                # must not be optional (ComfyUI 0.8 reads only a required one). web/reference_sockets.js gives
                # frontends that show no socket for min 0 their first one.
                io.Autogrow.Input("images", optional=True, template=io.Autogrow.TemplateNames(
                    io.Image.Input("image", tooltip="A reference image: image N in the prompt is the one at socket "
                                                    "imageN."),
                    names=REFERENCE_SOCKETS, min=0),
                    tooltip=f"Up to {MAX_REFERENCES} reference images; connecting one adds the next socket. The "
                            "prompt calls them image 1, image 2, ... in socket order (the first image of each "
                            "batch is used)."),
            ],
            outputs=[
                io.Conditioning.Output(display_name="positive",
                                       tooltip="The prompt (and reference images), for the sampler's positive."),
                io.Conditioning.Output(display_name="negative",
                                       tooltip="The negative prompt (and the same reference images), for the "
                                               "sampler's negative; it only matters with cfg above 1."),
                io.Latent.Output(display_name="latent",
                                 tooltip="An empty latent of the output size (connect it to the sampler)."),
            ],
        )

    @classmethod
    def validate_inputs(cls, width=None, height=None, images=None, **others):
        """Checked when the prompt is queued, before any loader runs: ComfyUI answers POST /prompt with this node's
        error. ComfyUI skips its own min/max check for inputs validated here, so the bounds are checked too. A side
        linked from another node is not known yet (None) and is checked by execute; so are the other inputs. The
        reference sockets' names are known: one beyond the limit is refused here."""
        try:
            check_sockets(images if isinstance(images, dict) else None,
                          [k for k in others if k.startswith(GROUP)])
            for name, value in (("width", width), ("height", height)):
                if value is not None:
                    check_size(name, value, MAX_SIZE)
        except InputError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, text_encoder, prompt, negative_prompt, width, height, size_from_reference, reference_resolution,
                vae=None, images=None, **others) -> io.NodeOutput:
        encoder = expect_handle("text_encoder", text_encoder, TextEncoderHandle).encoder
        width, height = check_size("width", width, MAX_SIZE), check_size("height", height, MAX_SIZE)
        if not isinstance(reference_resolution, int) or reference_resolution < 32:
            raise InputError("reference_resolution", reference_resolution, "an integer of at least 32 pixels")
        images = reference_images(images, others)
        if images and vae is None:
            raise InputError("vae", None, "a KV-Graph VAE connected: reference images enter the transformer as "
                                          "VAE latents")
        if vae is not None:
            expect_handle("vae", vae, VAEHandle)
        references = prepare_references([comfy_image_to_pil(img) for img in images], reference_resolution)
        vision_images = [r.vision_image for r in references]

        # Both texts are checked before the text encoder is loaded onto the device.
        encoder.check_prompt(prompt, len(images), "prompt")
        encoder.check_prompt(negative_prompt or "", len(images), "negative_prompt")
        tokens = max(encoder.token_bound(p, vision_images) for p in (prompt, negative_prompt or ""))
        text_encoder.before_encode(*encode_placement(text_encoder, tokens))
        try:
            device = text_encoder.encode_device
            positive = encoder.encode(prompt, vision_images, device=device)
            negative = encoder.encode(negative_prompt or "", vision_images, device=device, name="negative_prompt")
        except torch.OutOfMemoryError as exc:
            raise text_encoder.out_of_memory(exc) from exc
        finally:
            text_encoder.after_encode()

        raw_refs = []
        if references:
            raw_refs = [encode_raw(vae, r.vae_pixels) for r in references]
        if references and size_from_reference:
            width, height = references[-1].width, references[-1].height
        # The outputs outlive this node (ComfyUI caches them): keep them off the GPU, as core's encoders do.
        device = mm.intermediate_device()
        latent = empty_latent(width, height)
        latent["samples"] = latent["samples"].to(device)
        return io.NodeOutput(conditioning_to(prompt_to_conditioning(positive, raw_refs), device),
                             conditioning_to(prompt_to_conditioning(negative, raw_refs), device), latent)
