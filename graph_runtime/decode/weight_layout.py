"""The blocks' Linear weights stored input-major ([in, out] in memory), as the decode step's GEMMs run fastest.

Why: `F.linear(x, W)` with PyTorch's usual [out, in] weight hands cuBLAS a transposed operand (its "TN" GEMM). The
same values stored [in, out], with the parameter a transposed view of that storage, make cuBLAS run the "NN" variant
of the same kernel: bit-equal products and, on the H200 at its power limit, a ~1% faster step at 1024x1024
(`bench/results/weight-layout-20261202T2005.log`). Nothing else changes: the parameter object, its shape
`[out, in]`, its values and the memory it takes stay the same, so `F.linear`, LoRA merges (in-place adds) and
moving the model between devices (`Module.to` keeps a dense tensor's strides) all work as before.

Only 16-bit weights on a CUDA device are re-homed: that is where the step was measured. A weight replaced later (a
patch, a reload) is contiguous again and is re-homed at the next request start.
"""

from __future__ import annotations

import torch

# Where the layout was measured to pay: 16-bit weights on a CUDA device (tests widen DEVICE_TYPES to run on CPU).
DEVICE_TYPES = ("cuda",)
DTYPES = (torch.bfloat16, torch.float16)


def block_linears(transformer: torch.nn.Module) -> list[torch.nn.Linear]:
    """Every `nn.Linear` of the transformer blocks: the projections and MLP layers both passes run."""
    return [m for block in transformer.transformer_blocks for m in block.modules() if type(m) is torch.nn.Linear]


def is_input_major(weight: torch.Tensor) -> bool:
    """Whether a 2-D `[out, in]` weight is stored [in, out]: its transpose is the contiguous tensor."""
    return weight.dim() == 2 and weight.t().is_contiguous() and not weight.is_contiguous()


def store_input_major(transformer: torch.nn.Module) -> int:
    """Re-home each eligible block weight in place as a transposed view of [in, out] storage; returns how many.

    One weight at a time, so the memory it needs beyond the model is one weight's copy (96 MiB at full size).
    """
    count = 0
    with torch.no_grad(), torch.inference_mode(False):
        for linear in block_linears(transformer):
            weight = linear.weight
            if (weight.device.type not in DEVICE_TYPES or weight.dtype not in DTYPES or weight.dim() != 2
                    or not weight.is_contiguous() or min(weight.shape) < 2):
                continue
            linear.weight.data = weight.detach().t().contiguous().t()
            count += 1
    return count
