"""INT8 ConvRot layers: ComfyUI's `int8_tensorwise` weights kept as int8 and run W8A8 through comfy-kitchen.

The format (comfy-kitchen's `TensorWiseINT8Layout`, what ComfyUI's `comfy/ops.py` loads): each quantized weight was
rotated group-wise along its input dimension by a normalized Hadamard matrix of `group_size` (ConvRot), then
quantized to int8 with one fp32 scale per output row. At run time comfy-kitchen rotates the activations the same way,
quantizes them per row and runs an int8 GEMM (`int8_linear`): ComfyUI's own numerics. Dequantizing un-rotates.

The modules subclass `nn.Linear` / `nn.Embedding` so everything that looks for Linear children (the decode-graph
manager's structure watch, LoRA scans) finds them, but they never allocate a float weight: `weight` is the int8
Parameter itself and `weight_scale` an fp32 buffer `[out, 1]`.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .kitchen import INT8_EMBEDDING, int8_layout

from ..kernels.int8_gemm import int8_scaled_mm, int8_tensor_core_reason
from ..kernels.int8_quant import CONVROT_GROUP, is_int8_rows, quantize_rows_int8

logger = logging.getLogger("kvgraph")

# comfy-kitchen builds *regular* Hadamard matrices (Kronecker powers of a 4x4 one), so a ConvRot group is a power
# of 4; its fused CUDA quantizer is specialised for 256, the other sizes run its generic rotation.
HADAMARD_BASE = 4
# comfy-kitchen's custom ops take the output dtype as a code.
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def group_size_problem(group_size, in_features: int, convrot: bool = True) -> str | None:
    """Why `group_size` cannot rotate rows of `in_features` values, or None when it can."""
    if not convrot:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < HADAMARD_BASE:
        return f"group size {group_size!r} is not a power of 4 (comfy-kitchen's Hadamard sizes: 4, 16, 64, 256, ...)"
    size = group_size
    while size % HADAMARD_BASE == 0:
        size //= HADAMARD_BASE
    if size != 1:
        return f"group size {group_size} is not a power of 4 (comfy-kitchen's Hadamard sizes: 4, 16, 64, 256, ...)"
    if in_features % group_size:
        return f"group size {group_size} does not divide the layer's {in_features} input features"
    return None


def quantize_weight(weight: torch.Tensor, group_size: int, convrot: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A float `[out, in]` weight -> (int8 `[out, in]`, fp32 per-row scale `[out, 1]`), rotated first when `convrot`.

    Quantized from fp32 whatever the weight's dtype: rotating in bf16 would round the rotated values before they are
    quantized."""
    problem = group_size_problem(group_size, weight.shape[-1], convrot)
    if problem:
        raise ValueError(problem)
    q, params = int8_layout().quantize(weight.float(), is_weight=True, per_channel=True, convrot=convrot,
                                              convrot_groupsize=group_size)
    return q, params.scale.float().reshape(-1, 1)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, group_size: int, convrot: bool = True,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 `[out, in]` + per-row (or scalar) scale -> the float weight in `dtype`, un-rotated (comfy-kitchen computes
    it in fp32 and rounds once to `dtype`)."""
    layout = int8_layout()
    params = layout.Params(scale=scale.float(), orig_dtype=dtype, orig_shape=tuple(q.shape), convrot=convrot,
                           convrot_groupsize=group_size)
    return layout.dequantize(q, params)


class _KeepsScaleFp32:
    """`Module.to(dtype)` / `.half()` cast every floating buffer; the scales must stay fp32 (comfy-kitchen's CUDA
    kernels take fp32 scales only, and a bf16 scale would add its own rounding to every weight). Device moves still
    apply to them."""

    def _apply(self, fn, recurse=True):
        before = self._buffers["weight_scale"]
        result = super()._apply(fn, recurse)
        after = self._buffers["weight_scale"]
        if after is not None and after.dtype != torch.float32:
            self._buffers["weight_scale"] = before.to(device=after.device)
        return result


class ConvRotInt8Linear(_KeepsScaleFp32, torch.nn.Linear):
    """`y = x W^T + b` with W stored as ComfyUI's int8 ConvRot: `weight` int8 `[out, in]` (no gradient),
    `weight_scale` fp32 `[out, 1]`, `group_size` the rotation's group (ignored when `convrot` is False: plain row-wise
    int8). The bias, if any, stays a float Parameter.

    `forward` takes a float tensor or `Int8Rows` (made by our kernels, see kernels/int8_quant.py). On a GPU with
    int8 tensor cores the product is our INT8 GEMM (kernels/int8_gemm.py) on the same int8 weights and scales;
    elsewhere comfy-kitchen's `int8_linear` (the reason logged once)."""

    kvgraph_int8_linear = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = 256,
                 convrot: bool = True, device=None, dtype=None):
        # Not nn.Linear.__init__: it would allocate and randomly initialise a float weight of the full size.
        torch.nn.Module.__init__(self)
        int8_layout("An INT8 ConvRot layer kept int8")  # forward's custom op comes with it
        problem = group_size_problem(group_size, in_features, convrot)
        if problem:
            raise ValueError(problem)
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.convrot = int(group_size), bool(convrot)
        self.weight = torch.nn.Parameter(torch.zeros((out_features, in_features), dtype=torch.int8, device=device),
                                         requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((out_features, 1), dtype=torch.float32, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype or torch.float32, device=device),
                                           requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def __setstate__(self, state) -> None:
        # An unpickled layer skips __init__ (a worker process's copy of rank 0's model, graph_runtime/parallel):
        # forward's custom op must be registered in that process too.
        int8_layout("An INT8 ConvRot layer kept int8")
        super().__setstate__(state)

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, scale: torch.Tensor, group_size: int, convrot: bool = True,
                       bias: torch.Tensor | None = None) -> "ConvRotInt8Linear":
        """A layer holding these very tensors (no copy): int8 `[out, in]`, scale `[out, 1]` / `[out]` / scalar."""
        out_features, in_features = weight.shape
        module = cls(in_features, out_features, bias=bias is not None, group_size=group_size, convrot=convrot,
                     device="meta")
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        module.weight_scale = per_row_scale(scale, out_features).to(weight.device)
        if bias is not None:
            module.bias = bias if isinstance(bias, torch.nn.Parameter) else torch.nn.Parameter(bias,
                                                                                                requires_grad=False)
        return module

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int, convrot: bool = True) -> "ConvRotInt8Linear":
        """Quantize a float Linear with comfy-kitchen (on the Linear's device); its bias is shared."""
        q, scale = quantize_weight(linear.weight.detach(), group_size, convrot)
        return cls.from_quantized(q, scale, group_size, convrot, bias=linear.bias)

    @classmethod
    def sharing(cls, embedding: "ConvRotInt8Embedding") -> "ConvRotInt8Linear":
        """An output head tied to an int8 embedding table: the same int8 rows and scales, read as `[vocab, dim]`
        Linear weights (the table was rotated along `dim`, the head's input), so the tie costs no memory."""
        module = cls(embedding.embedding_dim, embedding.num_embeddings, bias=False, group_size=embedding.group_size,
                     convrot=embedding.convrot, device="meta")
        module.weight = embedding.weight
        module.weight_scale = embedding.weight_scale
        return module

    def reset_parameters(self) -> None:
        """Nothing to initialise: the weights come from a checkpoint or `requantize_`."""

    def our_kernel_reason(self, device: torch.device) -> str | None:
        """Why this layer's product does not run on our INT8 GEMM on `device` (None when it does)."""
        return _our_kernel_reason(device, self.in_features, self.out_features, self.group_size, self.convrot)

    def forward(self, x) -> torch.Tensor:
        if is_int8_rows(x):
            # Rows our kernels quantized (and rotated, for a ConvRot layer) where they were made.
            if x.rotated != self.convrot:
                raise ValueError(f"int8 rows {'rotated' if x.rotated else 'not rotated'} for a "
                                 f"{'ConvRot' if self.convrot else 'row-wise'} int8 layer")
            return int8_scaled_mm(x.data, x.scale, self.weight, self.weight_scale, self.bias, x.dtype)
        reason = self.our_kernel_reason(x.device)
        if reason is None:
            rows = quantize_rows_int8(x, self.convrot)
            return int8_scaled_mm(rows.data, rows.scale, self.weight, self.weight_scale, self.bias, x.dtype)
        _log_fallback_once(reason)
        # The custom op (what ComfyUI's int8 layout calls) dispatches to comfy-kitchen's CUDA, Triton or eager
        # backend and is opaque to torch.compile, so compiled blocks keep it as one call.
        return torch.ops.comfy_kitchen.int8_linear(x, self.weight, self.weight_scale, self.bias, _DTYPE_CODES[x.dtype],
                                                   self.convrot, self.group_size)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight this layer multiplies by, `[out, in]` in `dtype` (a new tensor)."""
        return dequantize_weight(self.weight, self.weight_scale, self.group_size, self.convrot, dtype)

    @torch.no_grad()
    def requantize_(self, weight: torch.Tensor) -> None:
        """Quantize the float `weight` `[out, in]` with comfy-kitchen into this layer's existing `weight` and
        `weight_scale` storages (`copy_`: same addresses, so captured CUDA graphs stay valid). The quantization runs
        where `weight` is (a streamed block's host copy is re-quantized on the GPU, its LoRA merge's device)."""
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"requantize_: weight of shape {list(weight.shape)} for a layer of shape "
                             f"{list(self.weight.shape)}")
        q, scale = quantize_weight(weight, self.group_size, self.convrot)
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)

    def extra_repr(self) -> str:
        rotation = f"convrot group {self.group_size}" if self.convrot else "row-wise"
        return f"{super().extra_repr()}, int8 {rotation}"


class ConvRotInt8Embedding(_KeepsScaleFp32, torch.nn.Embedding):
    """An int8 embedding table `[num, dim]` (rows rotated along `dim` when `convrot`), per-row fp32 scales. A lookup
    gathers and dequantizes only the requested rows (comfy-kitchen's `dequantize_embedding`), in `output_dtype`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 group_size: int = 256, convrot: bool = True, output_dtype: torch.dtype = torch.bfloat16,
                 device=None):
        torch.nn.Module.__init__(self)
        int8_layout("An INT8 ConvRot embedding table kept int8 (the text encoder's)", INT8_EMBEDDING,
                    "load the text encoder with int8_weights 'dequantize'")
        problem = group_size_problem(group_size, embedding_dim, convrot)
        if problem:
            raise ValueError(problem)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        self.group_size, self.convrot, self.output_dtype = int(group_size), bool(convrot), output_dtype
        self.weight = torch.nn.Parameter(torch.zeros((num_embeddings, embedding_dim), dtype=torch.int8,
                                                     device=device), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((num_embeddings, 1), dtype=torch.float32, device=device))

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, scale: torch.Tensor, group_size: int, convrot: bool = True,
                       padding_idx: int | None = None, output_dtype: torch.dtype = torch.bfloat16):
        module = cls(*weight.shape, padding_idx=padding_idx, group_size=group_size, convrot=convrot,
                     output_dtype=output_dtype, device="meta")
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        module.weight_scale = per_row_scale(scale, weight.shape[0]).to(weight.device)
        return module

    def _apply(self, fn, recurse=True):
        # The output dtype follows the module's dtype casts like a float table would: probe what `fn` does to one.
        self.output_dtype = fn(torch.empty(0, dtype=self.output_dtype)).dtype
        return super()._apply(fn, recurse)

    def reset_parameters(self) -> None:
        """Nothing to initialise: the table comes from a checkpoint."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        layout = int8_layout()
        params = layout.Params(scale=self.weight_scale, orig_dtype=self.output_dtype,
                               orig_shape=tuple(self.weight.shape), convrot=self.convrot,
                               convrot_groupsize=self.group_size)
        return layout.dequantize_embedding(self.weight, params, ids)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, self.group_size, self.convrot, dtype)

    def extra_repr(self) -> str:
        rotation = f"convrot group {self.group_size}" if self.convrot else "row-wise"
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 {rotation}"


@functools.cache
def _our_kernel_reason(device: torch.device, in_features: int, out_features: int, group_size: int,
                       convrot: bool) -> str | None:
    # Triton's interpreter runs our kernels on the CPU (the CPU tests' way to check them).
    reason = None if os.environ.get("TRITON_INTERPRET") == "1" else int8_tensor_core_reason(device)
    if reason is not None:
        return reason
    if convrot and group_size != CONVROT_GROUP:
        return f"ConvRot group {group_size} (our kernels rotate groups of {CONVROT_GROUP})"
    if in_features % 16 or out_features % 16:
        return f"a {out_features}x{in_features} weight (our GEMM takes multiples of 16)"
    return None


_logged_fallbacks: set[str] = set()


def _log_fallback_once(reason: str) -> None:
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.info("KV-Graph: INT8 Linears run through comfy-kitchen's int8_linear: %s.", reason)


def is_int8_linear(module) -> bool:
    """Whether `module` is an int8 Linear of any copy of the pack (the pack may be imported twice in a process)."""
    return getattr(type(module), "kvgraph_int8_linear", False)


def per_row_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's scale (`[rows, 1]`, `[rows]`, `[1]` or a scalar, any float dtype) as the fp32 `[rows, 1]` every
    layer here holds: a tensor-wide scale is the same value on every row, so the numerics are unchanged."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    return scale.reshape(rows, 1).contiguous()


def int8_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The int8 layers of `model` (a tied head and its table count once)."""
    seen, found = set(), []
    for module in model.modules():
        if isinstance(module, (ConvRotInt8Linear, ConvRotInt8Embedding)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            found.append(module)
    return found
