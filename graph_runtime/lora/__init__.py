"""LoRA for the KV-Graph sampler: LoRA files read and checked against the loaded transformer, merged into its
weights in place (so captured decode and prefix-pass graphs keep replaying), restored exactly.

    read_lora(path, transformer) -> LoraFile          a file's changes, checked (CheckpointError otherwise)
    LoraChoice(lora, strength)                         one chained LoRA node's pick
    loras_in_use(transformer, choices)                 context manager around a sampling run: merges the set
    merge_state(transformer) -> LoraMerge              the merged set of a transformer (apply, using, describe)
    merged_loras(transformer) -> dict                  what the status route shows
"""

from .file import LoraFile, WeightPatch, read_lora
from .merge import LoraChoice, LoraMerge, canonical, loras_in_use, merge_state, merged_loras

__all__ = ["LoraChoice", "LoraFile", "LoraMerge", "WeightPatch", "canonical", "loras_in_use", "merge_state",
           "merged_loras", "read_lora"]
