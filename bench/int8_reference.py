"""The quality bound of the FP8 path: ComfyUI's default INT8 ConvRot W8A8 Linears, through comfy-kitchen.

Weights are quantized as ComfyUI quantizes its `int8_convrot` checkpoints
(`TensorWiseINT8Layout.quantize(w, is_weight=True, per_channel=True, convrot=True, convrot_groupsize=256)`: a
group-wise Hadamard rotation, then INT8 with one scale per output channel) and run as ComfyUI runs them
(`comfy_kitchen.int8_linear(..., convrot=True, convrot_groupsize=256)`: the activation rotated and quantized per
row, an INT8 GEMM). Used by the benchmark only, to measure the error FP8 must not exceed on the same weights.
"""

from __future__ import annotations

import torch

CONVROT_GROUP = 256


def convrot_group(features: int) -> int:
    """256, ComfyUI's group, where it divides the input width; else the largest smaller power of 4 that does
    (comfy-kitchen's Hadamard sizes; the tiny test model's 32- and 96-wide Linears get 16)."""
    group = CONVROT_GROUP
    while features % group:
        group //= 4
    return group


class KitchenInt8Linear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout

        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group = convrot_group(linear.in_features)
        qdata, params = TensorWiseINT8Layout.quantize(linear.weight.detach(), is_weight=True, per_channel=True,
                                                      convrot=True, convrot_groupsize=self.group)
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", params.scale)

    # Set when comfy-kitchen's dispatched implementation failed here and its portable one ran instead (reported).
    fallback: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import comfy_kitchen

        rows = x.reshape(-1, x.shape[-1])
        kwargs = dict(out_dtype=x.dtype, convrot=True, convrot_groupsize=self.group)
        if KitchenInt8Linear.fallback is None:
            try:
                out = comfy_kitchen.int8_linear(rows, self.qdata, self.scale, **kwargs)
                return out.reshape(*x.shape[:-1], self.out_features)
            except Exception as exc:  # noqa: BLE001 - the bound is still measurable with the portable code
                KitchenInt8Linear.fallback = f"{type(exc).__name__}: {exc}"[:300]
        from comfy_kitchen.backends.eager.quantization import int8_linear

        return int8_linear(rows, self.qdata, self.scale, **kwargs).reshape(*x.shape[:-1], self.out_features)
