"""KV-Graph Load ControlNet and KV-Graph Apply ControlNet: the Qwen-Image-2.1 Fun ControlNet Union (control and
inpaint) on a KV-Graph transformer or MODEL.

ComfyUI 0.38+ loads this file with core's Load Model Patch; ComfyUI 0.8.0 to 0.37 cannot (their Load Model Patch
knows no Qwen-Image-2.1 file), so the pack reads the released file itself, from the same models/model_patches
folder. The control stream runs inside the pack's decode step (graph_runtime/controlnet), whose graphs keep replaying.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..graph_runtime.comfy_interop.latents import latent_stats, raw_to_normalized
from ..graph_runtime.comfy_interop.pixels import comfy_image_to_vae_pixels
from ..graph_runtime.controlnet import ControlSpec, flow_percent_to_sigma, load_fun_controlnet
from ..graph_runtime.errors import InputError
from ..graph_runtime.sampling.schedule import dynamic_shift
from .comfyui import model_files
from .comfyui.core_controlnet import restoring_loaded_models
from .comfyui.core_model import kv_model, with_control
from .comfyui.model_handles import TransformerHandle
from .comfyui.types import LOADERS, SAMPLING, Vae
from .lora import MODEL_TEMPLATE
from .vae import encode_raw

ControlNet = io.Custom("KVGRAPH_CONTROLNET")
FOLDER = "model_patches"
# The name the example workflows load; `make-tiny --comfyui-models` writes a tiny file under it.
EXAMPLE_CONTROLNET = "qwen_image_2.1_fun_controlnet_union.safetensors"
MAX_STRENGTH = 10.0


class KVGraphLoadControlNet(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphLoadControlNet",
            display_name="KV-Graph Load ControlNet",
            category=LOADERS,
            description=("Loads the Qwen-Image-2.1 Fun ControlNet Union (control and inpaint) from models/model_patches, "
                         "the file ComfyUI 0.38+ loads with Load Model Patch, for KV-Graph Apply ControlNet. Other "
                         "ControlNet files are refused, naming the file and the key that does not match."),
            inputs=[io.Combo.Input("controlnet_name",
                                   options=model_files.file_choices(FOLDER, EXAMPLE_CONTROLNET),
                                   default=EXAMPLE_CONTROLNET,
                                   tooltip="A Fun ControlNet Union file for Qwen-Image-2.1 (.safetensors) in "
                                           "models/model_patches.")],
            outputs=[ControlNet.Output(display_name="controlnet", tooltip="For KV-Graph Apply ControlNet.")],
        )

    @classmethod
    def fingerprint_inputs(cls, controlnet_name):
        return model_files.fingerprint(FOLDER, controlnet_name)

    @classmethod
    def execute(cls, controlnet_name) -> io.NodeOutput:
        return io.NodeOutput(load_fun_controlnet(model_files.full_path(FOLDER, controlnet_name, "controlnet_name")))


class KVGraphApplyControlNet(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphApplyControlNet",
            display_name="KV-Graph Apply ControlNet",
            category=SAMPLING,
            description=("Applies a Qwen-Image-2.1 Fun ControlNet Union to a KV-Graph transformer (for the KV-Graph "
                         "Sampler) or MODEL (for core's samplers): a control image (canny, depth, pose, ...), and/or an "
                         "inpaint image with a mask (white = regenerate). Steps inside start/end replay their own "
                         "captured graphs with the control stream; the others run the plain model. Strength 0 returns "
                         "the model unchanged, as ComfyUI's own node does."),
            inputs=[
                io.MatchType.Input("model", template=MODEL_TEMPLATE,
                                   tooltip="A KV-Graph transformer or a KV-Graph MODEL."),
                ControlNet.Input("controlnet", tooltip="From KV-Graph Load ControlNet."),
                Vae.Input("vae", tooltip="The KV-Graph VAE: encodes the control and inpaint images."),
                io.Float.Input("strength", default=1.0, min=-MAX_STRENGTH, max=MAX_STRENGTH, step=0.01,
                               tooltip="How strongly the control steers: 1 as trained, 0 not at all."),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.001,
                               tooltip="Where in the schedule the control starts (0: the first step)."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.001,
                               tooltip="Where in the schedule the control ends (1: the last step)."),
                io.Image.Input("image", optional=True,
                               tooltip="The control image (an edge, depth or pose map), resized to the output."),
                io.Image.Input("inpaint_image", optional=True,
                               tooltip="The image to inpaint; regenerated pixels (the mask's white) are grayed out."),
                io.Mask.Input("mask", optional=True, tooltip="Where to regenerate (1) and keep (0), for inpainting."),
            ],
            outputs=[io.MatchType.Output(template=MODEL_TEMPLATE, display_name="model",
                                         tooltip="The same loaded model with the ControlNet, of the type connected.")],
        )

    @classmethod
    def execute(cls, model, controlnet, vae, strength, start_percent, end_percent, image=None, inpaint_image=None,
                mask=None) -> io.NodeOutput:
        if not -MAX_STRENGTH <= strength <= MAX_STRENGTH:
            raise InputError("strength", strength, f"a number in [-{MAX_STRENGTH:g}, {MAX_STRENGTH:g}]")
        if not 0.0 <= start_percent <= end_percent <= 1.0:
            raise InputError("start_percent", (start_percent, end_percent),
                             "0 <= start_percent <= end_percent <= 1")
        if strength == 0:
            return io.NodeOutput(model)
        handle = isinstance(model, TransformerHandle)
        transformer = model.module if handle else kv_model(model).diffusion_model
        controlnet.check_base(transformer)
        if handle:
            shift = dynamic_shift(model.scheduler_config, 1024, 1024)
            to_sigma = lambda p: flow_percent_to_sigma(p, shift)  # noqa: E731 - the MODEL's own mapping
        else:
            # The MODEL's sampling as core's own apply node reads it (a sampling patch on the MODEL included).
            get = getattr(model, "get_model_object", None)
            sampling = get("model_sampling") if get is not None else kv_model(model).model_sampling
            to_sigma = sampling.percent_to_sigma
        stats = latent_stats()

        def encode(pixels):
            return raw_to_normalized(encode_raw(vae, comfy_image_to_vae_pixels(pixels, "image")), stats)

        spec = ControlSpec(controlnet, restoring_loaded_models(encode), float(strength), sigma_start=float(to_sigma(start_percent)),
                           sigma_end=float(to_sigma(end_percent)), image=image, inpaint_image=inpaint_image,
                           mask=mask)
        return io.NodeOutput(model.with_control(spec) if handle else with_control(model, spec))


CONTROLNET_NODES = [KVGraphLoadControlNet, KVGraphApplyControlNet]
