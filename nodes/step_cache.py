"""KVGraphStepCache: the KV-Graph Sampler's step cache (EasyCache's rule) as a patch node on the transformer.

The node checks its settings and returns the same loaded model with them attached, as KV-Graph Load LoRA does with a
LoRA; the KV-Graph Sampler then skips the steps the cache predicts (graph_runtime/sampling/step_cache.py). On the
MODEL, core's own EasyCache and LazyCache nodes do the same for core's samplers.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..graph_runtime.errors import InputError
from ..graph_runtime.sampling.step_cache import MAX_THRESHOLD, StepCacheSettings
from .comfyui.model_handles import TransformerHandle
from .comfyui.types import SAMPLING, Transformer

DEFAULTS = StepCacheSettings()


class KVGraphStepCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphStepCache",
            display_name="KV-Graph Step Cache",
            category=SAMPLING,
            description=(
                "Lets the KV-Graph Sampler skip steps whose prediction the last computed step already gives "
                "(EasyCache's rule, with core's EasyCache settings): a skipped step runs no transformer at all, the "
                "computed ones replay the captured graph. Fewer steps' work for a small change of the image; for "
                "KSampler and other core samplers on the MODEL use core's EasyCache node."
            ),
            inputs=[
                Transformer.Input("model", tooltip="A KV-Graph transformer (from a loader or KV-Graph Load LoRA)."),
                io.Float.Input("reuse_threshold", default=DEFAULTS.reuse_threshold, min=0.0, max=MAX_THRESHOLD,
                               step=0.01, tooltip="How much estimated change of the prediction may build up before a "
                                                  "step is computed again: higher skips more steps."),
                io.Float.Input("start_percent", default=DEFAULTS.start_percent, min=0.0, max=1.0, step=0.01,
                               tooltip="Where in the schedule skipping may start (0 = the first step); steps before "
                                       "it are always computed."),
                io.Float.Input("end_percent", default=DEFAULTS.end_percent, min=0.0, max=1.0, step=0.01,
                               tooltip="Where skipping stops; the last steps, which settle the details, are always "
                                       "computed."),
            ],
            outputs=[Transformer.Output(display_name="model",
                                        tooltip="The same loaded transformer with the step cache, for the KV-Graph "
                                                "Sampler.")],
        )

    @classmethod
    def execute(cls, model, reuse_threshold, start_percent, end_percent) -> io.NodeOutput:
        if not isinstance(model, TransformerHandle):
            raise InputError("model", type(model).__name__, "a KV-Graph transformer (core's EasyCache node does this "
                                                            "for a MODEL)")
        if model.gpus > 1:
            # Every rank would decide on its own whether to skip; refused here, before anything loads.
            raise InputError("model", f"a transformer sampled on {model.gpus} GPUs",
                             "one sampled on 1 GPU (the loader's gpus 1): the step cache runs on one device for now")
        settings = StepCacheSettings(float(reuse_threshold), float(start_percent), float(end_percent))
        return io.NodeOutput(model.with_step_cache(settings))


STEP_CACHE_NODES = [KVGraphStepCache]
