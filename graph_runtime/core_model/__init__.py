"""The pack's runtime as the model function of ComfyUI's own samplers (KSampler, SamplerCustomAdvanced, ...).

    PrefixSource.from_conditioning(cond, extras)   one conditioning entry's prefix inputs, named by their content
    SamplingRun(engine)                            one sampling run's prefixes, released when it ends
    placement_from_options(transformer_options)    where a run keeps its prefixes (core's Qwen Image 2.1 Cache)
    ModelFunction(engine)(x, sigma, source, run)   normalized latents and sigma -> the flow prediction

The ComfyUI side (nodes/comfyui/core_model.py) wraps these in a `BaseModel` / `ModelPatcher`: it builds the sources
when core prepares the conditioning, opens a run around each sampling call and calls the model function for every
step.
"""

from .model_function import ModelFunction
from .prefix_options import placement_from_options
from .prefix_source import PrefixSource, content_digest
from .run import RunCounts, SamplingRun

__all__ = ["ModelFunction", "PrefixSource", "RunCounts", "SamplingRun", "content_digest", "placement_from_options"]
