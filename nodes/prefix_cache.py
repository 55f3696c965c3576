"""KVGraphPrefixCache: where the KV-Graph Sampler keeps a prompt's prefix K/V, as a patch node on the transformer.

ComfyUI's own Qwen-Image-2.1 cache node sets where its prefix cache lives (GPU, pinned host memory, quantized, or off)
on the MODEL; this one does the same for the KV-Graph transformer and its captured decode steps: the node checks the
choice and returns the same loaded model with it attached, as KV-Graph Step Cache does with its settings.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..graph_runtime.decode import PLACEMENT_CHOICES, check_placement
from ..graph_runtime.errors import InputError
from .comfyui.model_handles import TransformerHandle
from .comfyui.types import SAMPLING, Transformer


class KVGraphPrefixCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphPrefixCache",
            display_name="KV-Graph Prefix Cache",
            category=SAMPLING,
            description=(
                "Where the KV-Graph Sampler keeps the prompt's prefix K/V (text and reference images), computed once "
                "and read by every step. Without this node (or with auto) the memory plan decides: the fastest "
                "placement that fits the card (blocks streamed where needed), no cache only where no kept prefix "
                "fits. A placement set here is the only one planned."
            ),
            inputs=[
                Transformer.Input("model", tooltip="A KV-Graph transformer (from a loader or KV-Graph Load LoRA)."),
                io.Combo.Input("placement", options=list(PLACEMENT_CHOICES), default="auto",
                               tooltip="auto: the memory plan picks the fastest that fits (recompute only where no "
                                       "other does). gpu: bf16 on the GPU (fastest; 0.5 MiB a token). int8: int8 on the "
                                       "GPU with per-token scales, about half the memory, within the INT8 bound. "
                                       "host: pinned host memory, copied block by block behind the compute. "
                                       "recompute: no cache, every step runs the whole sequence eagerly (slowest, "
                                       "least memory)."),
            ],
            outputs=[Transformer.Output(display_name="model",
                                        tooltip="The same loaded transformer with the prefix placement, for the "
                                                "KV-Graph Sampler.")],
        )

    @classmethod
    def execute(cls, model, placement) -> io.NodeOutput:
        if not isinstance(model, TransformerHandle):
            raise InputError("model", type(model).__name__, "a KV-Graph transformer")
        placement = check_placement(placement, "placement")
        if model.gpus > 1 and placement not in ("auto", "gpu"):
            # Each rank keeps its share of the heads on its own GPU (graph_runtime/parallel).
            raise InputError("placement", placement, "auto or gpu for a transformer sampled on several GPUs")
        return io.NodeOutput(model.with_prefix_placement(placement))


PREFIX_CACHE_NODES = [KVGraphPrefixCache]
