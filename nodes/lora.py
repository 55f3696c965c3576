"""KVGraphLoadLoRA: chains a LoRA onto a KV-Graph transformer handle or MODEL; the sampling run merges the chain into
the weights.

The node only reads and checks the file (so a wrong file fails here, naming it) and returns the same loaded model
with its LoRA list extended: a handle for the KV-Graph Sampler, or a clone of the MODEL carrying the chain for core's
samplers. Merging waits for the run: several workflows can share one loaded model with different LoRA sets, and each
run merges its own set in place (graphs keep replaying; see graph_runtime/lora).
"""

from __future__ import annotations

import math

from comfy_api.latest import io

from ..graph_runtime.errors import InputError
from ..graph_runtime.lora import LoraChoice, read_lora
from .comfyui import model_files
from .comfyui.core_model import kv_model, with_loras
from .comfyui.model_handles import TransformerHandle
from .comfyui.types import LOADERS, Transformer

# The model socket takes either kind of KV-Graph model and hands on the same kind.
MODEL_TEMPLATE = io.MatchType.Template("kvgraph_model", allowed_types=[Transformer, io.Model])

LORA_FOLDER = "loras"
# The name the example workflow uses; offered first so a fresh node shows what a LoRA file looks like.
EXAMPLE_LORA = "qwen_image_2.1_lora.safetensors"
MAX_STRENGTH = 10.0


def lora_choices() -> list[str]:
    """The .safetensors files in ComfyUI's loras folder (other formats cannot be read safely)."""
    return [n for n in model_files.file_choices(LORA_FOLDER, EXAMPLE_LORA) if n.endswith(".safetensors")]


class KVGraphLoadLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphLoadLoRA",
            display_name="KV-Graph Load LoRA",
            category=LOADERS,
            description=(
                "Adds a Qwen-Image-2.1 LoRA from models/loras to a KV-Graph transformer; chain several for several "
                "LoRAs; works on the transformer and on the MODEL. The sampler (KV-Graph's, or core's on the MODEL) "
                "merges them into the weights in place at the start of its run (once per change of LoRAs or "
                "strengths), so decode runs at full speed and captured CUDA graphs keep replaying."
            ),
            inputs=[
                io.MatchType.Input("model", template=MODEL_TEMPLATE,
                                   tooltip="A KV-Graph transformer or a KV-Graph MODEL, from a loader or another Load "
                                           "LoRA node."),
                io.Combo.Input("lora_name", options=lora_choices(), default=EXAMPLE_LORA,
                               tooltip="A Qwen-Image-2.1 LoRA (.safetensors) in models/loras: PEFT/diffusers, "
                                       "kohya/ComfyUI or DiffSynth key layouts, or full-weight diff files."),
                io.Float.Input("strength", default=1.0, min=-MAX_STRENGTH, max=MAX_STRENGTH, step=0.01,
                               tooltip="How much of the LoRA to merge: 1 as trained, 0 none (the original "
                                       "weights), negative values subtract it."),
            ],
            outputs=[io.MatchType.Output(template=MODEL_TEMPLATE, display_name="model",
                                         tooltip="The same loaded model, of the type connected, with this LoRA added "
                                                 "to its chain: a transformer for the KV-Graph sampler, a MODEL for "
                                                 "core's samplers, or another Load LoRA node.")],
        )

    @classmethod
    def fingerprint_inputs(cls, model, lora_name, strength):
        return model_files.fingerprint(LORA_FOLDER, lora_name, strength)

    @classmethod
    def execute(cls, model, lora_name, strength) -> io.NodeOutput:
        if not math.isfinite(strength) or abs(strength) > MAX_STRENGTH:
            raise InputError("strength", strength, f"a finite number in [-{MAX_STRENGTH:g}, {MAX_STRENGTH:g}]")
        handle = model if isinstance(model, TransformerHandle) else None
        transformer = handle.module if handle is not None else kv_model(model).diffusion_model  # checks the MODEL
        path = model_files.full_path(LORA_FOLDER, lora_name, "lora_name")
        choice = LoraChoice(read_lora(path, transformer), float(strength))
        return io.NodeOutput(handle.with_lora(choice) if handle is not None else with_loras(model, [choice]))


LORA_NODES = [KVGraphLoadLoRA]
