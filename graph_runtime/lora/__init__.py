"""LoRA for the KV-Graph sampler: LoRA files read and checked against the loaded transformer, merged into its
weights in place (so captured decode and prefix-pass graphs keep replaying), restored exactly.

    read_lora(path, transformer) -> LoraFile          a file's changes, checked (CheckpointError otherwise)
    in_memory.lora_from_patches(label, patches, tr.)  changes already in memory (core's LoRA loaders), checked
    LoraChoice(lora, strength)                         one chained LoRA node's pick
    LoraMerge(transformer)                             a model's merged set (apply, using, describe)

The loaded model (graph_runtime/loaded.py) owns its `LoraMerge`: `loaded.loras_in_use(choices)` around a sampling
run, `loaded.merged_loras()` for the status route.
"""

from .file import LoraFile, WeightPatch, read_lora
from .merge import LoraChoice, LoraMerge, canonical

__all__ = ["LoraChoice", "LoraFile", "LoraMerge", "WeightPatch", "canonical", "read_lora"]
