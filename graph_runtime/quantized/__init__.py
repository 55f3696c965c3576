"""ComfyUI's INT8 ConvRot checkpoints (`*_int8_convrot.safetensors`): the format's records and the int8 layers.

Public API:
    ConvRotInt8Linear, ConvRotInt8Embedding      int8 layers over comfy-kitchen (no ComfyUI import)
    quantize_weight, dequantize_weight           comfy-kitchen's ConvRot (de)quantizers on plain tensors
    LayerQuant, read_layers, record_tensor       the per-layer `.comfy_quant` records
    KEEP_INT8, DEQUANTIZE, QUANTIZED_MODES       how a loader treats an int8 file
    quantize_linears_, dequantize_linears_       make a float model's Linear layers int8 and back (benchmarks, GPU tests)
"""

from .comfy_quant import INT8_TENSORWISE, LayerQuant, describe_format, read_layers, record_tensor
from .int8_convrot import (
    ConvRotInt8Embedding, ConvRotInt8Linear, dequantize_weight, group_size_problem, int8_modules, quantize_weight,
)
from .modes import DEQUANTIZE, KEEP_INT8, QUANTIZED_MODES, check_mode, dequantize_linears_, quantize_linears_

__all__ = [
    "DEQUANTIZE", "INT8_TENSORWISE", "KEEP_INT8", "QUANTIZED_MODES", "ConvRotInt8Embedding", "ConvRotInt8Linear",
    "LayerQuant", "check_mode", "dequantize_linears_", "dequantize_weight", "describe_format", "group_size_problem", "int8_modules",
    "quantize_linears_", "quantize_weight", "read_layers", "record_tensor",
]
