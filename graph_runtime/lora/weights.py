"""One merged weight: its original kept on the host, a merge computed from that original, and an exact restore.

Every write goes into the weight's existing storage (`copy_`), so captured CUDA graphs, which read weights at fixed
addresses, see the merged values on their next replay without a new capture. The original is copied out before the
first merge (pinned host memory when the weight is on a GPU, so restoring is a fast copy back) and every later merge
starts from it: the result never depends on which LoRA sets came before, and restoring copies the original bits back
rather than subtracting a delta (which would round).

Two kinds of weight:
- a plain floating-point Parameter: `W = round(fp32(W0) + delta)`, rounded once to the weight's dtype;
- a module that stores its weight quantized and exposes `dequantized_weight(dtype)` and `requantize_(weight)` (the
  INT8 ConvRot Linear: `requantize_` writes into the existing int8 weight and scale storages): the original
  quantized tensors are restored, dequantized to fp32, the delta added, and the sum re-quantized in place.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("kvgraph")
_warned_unpinned = []


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory: pinned for a GPU tensor (a plain copy if pinning fails), plain on the CPU."""
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    try:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    except RuntimeError as exc:  # the host could not lock that much memory: slower restores, same results
        if not _warned_unpinned:
            _warned_unpinned.append(True)
            logger.warning("KV-Graph: could not pin host memory for the LoRA originals (%s); keeping pageable "
                           "copies, which restore more slowly.", exc)
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
    out.copy_(tensor.detach())
    return out


def writable(tensor: torch.Tensor):
    """The grad mode in which `tensor` may be written in place: ComfyUI loads models under inference mode, so their
    weights are inference tensors, which only inference mode may change; weights loaded elsewhere are normal
    tensors, which must not become inference tensors' dependents."""
    return torch.inference_mode(tensor.is_inference())


def _owned(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` of `module` as it is now: looked up at each use, because moving a module
    between devices replaces its buffers (and, with some settings, its parameters) by new tensors."""
    tensor = module._parameters.get(name)
    return module._buffers[name] if tensor is None else tensor


class PlainWeight:
    """A floating-point weight: merged as one fp32 sum rounded once to its dtype."""

    def __init__(self, module: torch.nn.Module, name: str):
        self.module, self.name = module, name
        self.original = host_copy(self.param)
        self.pristine = True  # the weight holds its original values

    @property
    def param(self) -> torch.Tensor:
        return _owned(self.module, self.name)

    @property
    def device(self) -> torch.device:
        return self.param.device

    @property
    def nbytes(self) -> int:
        return self.original.numel() * self.original.element_size()

    def merge(self, delta: torch.Tensor) -> torch.Tensor:
        """`weight = original + delta`, with `delta` fp32 on the weight's device (consumed). Returns whether the
        merged weight is finite in its dtype (a 0-d bool on the device: read it once for all weights)."""
        param = self.param
        # A pristine weight is its own original: no host-to-device copy. `delta` may be on another device than the
        # weight (a streamed block's host copy is merged on the GPU, then copied back).
        original = param if self.pristine else self.original
        with writable(param):
            param.copy_(delta.add_(original.to(delta.device, non_blocking=True)))
        self.pristine = False
        return finite(param)

    def restore(self) -> None:
        if not self.pristine:
            param = self.param
            with writable(param):
                param.copy_(self.original)
            self.pristine = True


class QuantizedWeight:
    """A module whose weight is stored quantized: dequantize the original, add, re-quantize into the same storage.

    What is kept to restore is every tensor the module owns directly (the quantized weight and its scales).
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        owned = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        self.originals = {name: host_copy(t) for name, t in owned}
        self.pristine = True

    @property
    def device(self) -> torch.device:
        return self.module.weight.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.originals.values())

    def merge(self, delta: torch.Tensor) -> torch.Tensor:
        """Returns whether the merged weight (before quantization, which would hide an overflow in its scales) is
        finite, as a 0-d bool on the device."""
        self.restore()  # start from the file's quantized weight, not an earlier merge's re-quantization
        weight = self.module.dequantized_weight(torch.float32).to(delta.device).add_(delta)
        ok = finite(weight)
        with writable(self.module.weight):
            self.module.requantize_(weight)
        self.pristine = False
        return ok

    def restore(self) -> None:
        if not self.pristine:
            for name, original in self.originals.items():
                tensor = _owned(self.module, name)
                with writable(tensor):
                    tensor.copy_(original)
            self.pristine = True


def finite(tensor: torch.Tensor) -> torch.Tensor:
    """Whether every value of `tensor` is finite, as a 0-d bool on its device (no host sync)."""
    return torch.isfinite(tensor).all()


def is_quantized(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "dequantized_weight", None)) and callable(getattr(module, "requantize_", None))


def weight_slot(model: torch.nn.Module, param_name: str):
    """The slot that merges into `param_name` of `model`: the quantized path for a module exposing
    `dequantized_weight`/`requantize_` (for its `weight`), else the plain path."""
    module_name, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf == "weight" and is_quantized(module):
        return QuantizedWeight(module)
    return PlainWeight(module, leaf)
