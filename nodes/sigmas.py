"""KVGraphSigmas: the model's own schedule as SIGMAS, for SamplerCustomAdvanced and other core sampler nodes.

The same schedule the KV-Graph Sampler runs (graph_runtime/sampling/schedule.py): the resolution-dependent dynamic
shift diffusers' pipeline computes, or the Turbo checkpoint's fixed grid; with core's `euler` it gives the KV-Graph
Sampler's latents.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..graph_runtime.comfy_interop.latents import latent_samples
from ..graph_runtime.errors import InputError
from ..graph_runtime.loading.variant import AUTO, sigma_preset_for
from ..graph_runtime.sampling.schedule import TURBO_SIGMAS, schedule_for
from ..graph_runtime.validation import VAE_SCALE, check_count, check_size
from .comfyui.core_model import kv_model
from .sampler import NODE_SIGMA_PRESETS
from .comfyui.types import SAMPLING


class KVGraphSigmas(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphSigmas",
            display_name="KV-Graph Sigmas (Qwen-Image-2.1)",
            category=SAMPLING,
            description=("The Qwen-Image-2.1 schedule for core samplers (SamplerCustomAdvanced): the model's "
                         "resolution-dependent dynamic schedule, as the diffusers pipeline and the KV-Graph Sampler "
                         "compute it, or the Turbo checkpoint's 8-step grid."),
            inputs=[
                io.Model.Input("model", tooltip="A KV-Graph MODEL (its scheduler settings and whether it is Turbo)."),
                io.Int.Input("steps", default=40, min=1, max=1000,
                             tooltip="Steps of the dynamic schedule (40 is the model's default); the turbo preset "
                                     f"always has {len(TURBO_SIGMAS)}."),
                io.Combo.Input("sigma_preset", options=list(NODE_SIGMA_PRESETS), default=AUTO,
                               tooltip="auto: turbo for the Turbo checkpoint, dynamic otherwise. dynamic: shifted "
                                       "for the image size. turbo: the Turbo model's fixed grid, unshifted."),
                io.Int.Input("width", default=1024, min=16, max=8192, step=16,
                             tooltip="Image width in pixels: the dynamic shift depends on the image size. Ignored "
                                     "when a latent is connected."),
                io.Int.Input("height", default=1024, min=16, max=8192, step=16,
                             tooltip="Image height in pixels (ignored when a latent is connected)."),
                io.Float.Input("denoise", default=1.0, min=0.01, max=1.0, step=0.01,
                               tooltip="Below 1, the last steps of a longer schedule (image to image)."),
                io.Latent.Input("latent", optional=True,
                                tooltip="Optional: the latent to sample; its size sets the schedule's shift."),
            ],
            outputs=[io.Sigmas.Output(display_name="sigmas",
                                      tooltip="Sigmas from 1 down to 0, for a core sampler node.")],
        )

    @classmethod
    def execute(cls, model, steps, sigma_preset, width, height, denoise, latent=None) -> io.NodeOutput:
        inner = kv_model(model)
        if sigma_preset not in NODE_SIGMA_PRESETS:
            raise InputError("sigma_preset", sigma_preset, f"one of {', '.join(NODE_SIGMA_PRESETS)}")
        if latent is not None:
            _, _, tokens_h, tokens_w = latent_samples(latent, "latent", inner.latent_format.latent_channels).shape
        else:
            tokens_h = check_size("height", height) // VAE_SCALE
            tokens_w = check_size("width", width) // VAE_SCALE
        preset = sigma_preset_for(sigma_preset, inner.variant)
        steps = check_count("steps", steps)
        _, sigmas = schedule_for(preset, steps, tokens_h * tokens_w, inner.scheduler_config, float(denoise))
        return io.NodeOutput(sigmas.float().cpu())
