"""Why a decode step cannot replay a captured graph. Each check returns a reason string, or None when fine.

Every reason here ends in an eager step that is still correct; the engine logs each reason once and counts it.
`ModelGuard` judges the model a request runs on and answers with a `Verdict`; it never touches the graph entries:
when the verdict says the captured graphs must go, the engine drops them.
"""

from __future__ import annotations

import functools
import operator
import weakref
from dataclasses import dataclass

import torch

from ..stream_slots import SlotBlock, streamer_of

# Reason strings double as statistics keys, so they are stable, short and human-readable.
NO_CUDA = "no CUDA"
ASYNC_ALLOCATOR = ("the CUDA allocator is cudaMallocAsync (ComfyUI's --cuda-malloc), under which a capture that runs "
                   "Triton kernels fails")
MODE_EAGER = "decode mode is eager"
# A partial load's blocks in device slots (stream_slots.py) are on the device at fixed addresses: not this.
WEIGHTS_OFF_GPU = "weights are not all on the CUDA device (offloaded or lowvram)"
OFFLOAD_HOOKS = "offload or streaming hooks can move weights after capture"
BLOCK_HOOKS = "forward hooks on the transformer blocks"
PARALLEL = "tensor, sequence or ring parallelism"
LORA = "dynamic LoRA wrappers"
PADDED_TEXT = "padded text mask (the masked path branches on mask contents)"
QUANTIZED_KV = "quantized prefix K/V"
COMPILING = "called while torch.compile is tracing"
OWNED = "graph entry owned by another live request"
WEIGHTS_MOVED = "weights moved since capture"
ALLOCATION_FAILED = "graph buffer allocation failed"
CAPTURE_FAILED = "graph capture failed"
LONG_PREFIX = "long prefix: its pass is GPU-bound, a captured one would not be faster"
# Other nodes' Python patches may read or change any row, so such a step runs the whole sequence (block_patches.py).
PYTHON_PATCHES = "block or attention patches from other nodes (Python functions run on every row)"
RECOMPUTE = "prefix placement recompute (no prefix cache: every step runs the whole joint sequence)"
STORED_PREFIX_PASS = "int8 or host prefix (its pass keeps each block's rows as they are written)"

_FLOAT_KV = (torch.bfloat16, torch.float16, torch.float32)


def static_reason(transformer: torch.nn.Module, params=None) -> str | None:
    """Checks that hold for the transformer as loaded (re-run for each prompt and whenever the weights' addresses or
    the module structure change). `params`: the model's parameters when the caller has already listed them."""
    if not torch.cuda.is_available():
        return NO_CUDA
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        # Memory allocated inside a capture is a graph allocation, not yet mapped: Triton's launcher asks the
        # driver for each pointer's device address, is refused and raises, and the aborted capture's frees then
        # fault the process. The pack's prestartup_script.py keeps ComfyUI on the native allocator for this.
        return ASYNC_ALLOCATOR
    if _has_offload_hooks(transformer):
        return OFFLOAD_HOOKS
    # The set of devices, collected by a C-level map (a meta tensor's device type is "meta").
    params = transformer.parameters() if params is None else params
    if any(device.type != "cuda" for device in set(map(operator.attrgetter("device"), params))):
        return WEIGHTS_OFF_GPU
    if _parallel(transformer):
        return PARALLEL
    return block_hooks_reason(transformer)


def block_hooks_reason(transformer: torch.nn.Module) -> str | None:
    """Hooks on the blocks that a captured step would not run: anyone's but a capturable slot streamer's."""
    # A slot streamer's pre-hooks (stream_slots.py) are not hooks of others: they fill a slot at fixed addresses,
    # and a captured step runs its own uploads. Its copies must be capturable, though.
    streamer = streamer_of(transformer.transformer_blocks)
    if streamer is not None and streamer.graph_reason is not None:
        return streamer.graph_reason
    for block in transformer.transformer_blocks:
        pre = block._forward_pre_hooks
        if pre and streamer is not None:
            pre = [h for h in pre.values() if not isinstance(h, SlotBlock)]
        if block._forward_hooks or pre or block.attn._forward_pre_hooks:
            return BLOCK_HOOKS
    return None


def request_reason(kv_dtype: torch.dtype, key_valid) -> str | None:
    """Checks that depend on the request (cheap: they run every step)."""
    if torch.compiler.is_compiling():
        return COMPILING
    if key_valid is not None:
        return PADDED_TEXT
    if kv_dtype not in _FLOAT_KV:
        return QUANTIZED_KV
    return None


class ModelScan:
    """One walk of the model's module tree, shared by the whole-model checks of a request start.

    A walk of the full module tree is a noticeable share of a short prompt's host time, so the checks of a request
    start (weights' addresses, devices, LoRA wrappers) read one walk instead of each taking its own.
    """

    def __init__(self, model: torch.nn.Module):
        self.modules = list(model.modules())
        slots = [(m._parameters, name) for m in self.modules for name, p in m._parameters.items() if p is not None]
        self._param_dicts = [params for params, _ in slots]
        self._param_names = [name for _, name in slots]
        # A tied weight is listed twice: harmless for an address fingerprint and a device check.
        self.params = [params[name] for params, name in slots]
        self.watch = StructureWatch(self.modules)
        self.tree = TreeWatch(self.modules)
        self.checked = False  # set once the static checks have judged the model as this scan saw it

    def fingerprint(self) -> tuple:
        """The weights' addresses (map: the loop runs in C, every step)."""
        return tuple(map(torch.Tensor.data_ptr, self.params))

    def changed(self) -> bool:
        """A Linear replaced or wrapped, or a parameter replaced by another tensor (as ComfyUI's weight patching
        does), since the scan: its fingerprint would read the old tensors. C-level loops, every step."""
        current = map(dict.get, self._param_dicts, self._param_names)
        return self.watch.changed() or not all(map(operator.is_, current, self.params))

    def stale(self) -> bool:
        """Whether a request start must walk the module tree again: anything `changed` sees, or any module added,
        removed, replaced, retyped or given a new attribute since the scan. Far cheaper than the walk and the LoRA
        scan it saves (docs/performance.md)."""
        return self.changed() or self.tree.changed()

    @functools.cached_property
    def lora_wrapped(self) -> bool:
        """`has_lora_wrappers` of the scanned modules, computed once: a scan is only reused while `stale` is False,
        and every place a LoRA wrapper can show up (submodules, parameters, buffers, attributes, the class) is
        among what `TreeWatch` compares."""
        return has_lora_wrappers(self.modules)


class StructureWatch:
    """Notices, cheaply enough to run every step, when a Linear of the model is replaced or grows submodules:
    how LoRA wrappers appear (PEFT swaps in its own layer; others hang `lora_*` modules on the Linear)."""

    def __init__(self, modules):
        """`modules`: every module of the model (`model.modules()`)."""
        self._parents, self._names, self._children = _child_slots(modules, torch.nn.Linear)
        self._grandchildren = [child._modules for child in self._children]

    def changed(self) -> bool:
        # map() and list comparison loop in C (modules compare by identity), cheap enough for every step.
        return list(map(dict.get, self._parents, self._names)) != self._children or any(self._grandchildren)


def _child_slots(modules, kind) -> tuple[list, list, list]:
    """Each child of `kind` as (its parent's `_modules`, its name, the child): `dict.get` over the first two finds
    what sits in the slot now."""
    slots = [(parent._modules, name, child) for parent in modules for name, child in parent._modules.items()
             if isinstance(child, kind)]
    return [parent for parent, _, _ in slots], [name for _, name, _ in slots], [child for _, _, child in slots]


_MEMBER_DICTS = (vars, *map(operator.attrgetter, ("_modules", "_parameters", "_buffers")))


class TreeWatch:
    """A snapshot of the whole module tree, compared at each request start so an unchanged model is not walked and
    judged again: each module's type, the sizes of its `__dict__`, `_modules`, `_parameters` and `_buffers`, and
    which module sits in each child slot. Comparisons are C-level maps over the modules listed once."""

    def __init__(self, modules):
        """`modules`: every module of the model (`model.modules()`)."""
        self._modules = modules
        self._parents, self._names, self._children = _child_slots(modules, torch.nn.Module)
        self._snapshot = self._take()

    def _take(self) -> tuple:
        # Sizes, not names: comparing every attribute name of the full model costs several times more. A name
        # removed and another added between two requests is the one change this misses, unless it swaps a child
        # module or a parameter, which the slots and `ModelScan.changed` compare by identity.
        modules = self._modules
        return (list(map(type, modules)), *(list(map(len, map(get, modules))) for get in _MEMBER_DICTS))

    def changed(self) -> bool:
        return (list(map(dict.get, self._parents, self._names)) != self._children
                or self._take() != self._snapshot)


def has_lora_wrappers(modules) -> bool:
    """True once PEFT (diffusers' LoRA loader) or any tuner layer wraps one of `modules` (`model.modules()`).

    A captured graph replays the layers that ran at capture time; an adapter bound or rescaled afterwards changes
    the math without changing any shape the graph is keyed on.
    """
    BaseTunerLayer = _peft_tuner_layer()
    for m in modules:
        if BaseTunerLayer is not None and isinstance(m, BaseTunerLayer):
            return True
        if _has_member(m, "lora_A") or _has_member(m, "lora_up"):
            return True
    return False


@functools.cache
def _peft_tuner_layer():
    """PEFT's layer base class, or None without PEFT (looked up once: a failing import searches every path entry)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    return BaseTunerLayer


def _has_member(module: torch.nn.Module, name: str) -> bool:
    """`hasattr(module, name)` without its cost: a miss goes through `Module.__getattr__` and raises, the bulk of a
    LoRA scan of the full model. Looks where `hasattr` would find it: submodules, parameters,
    buffers, the instance and its class."""
    return (name in module._modules or name in module._parameters or name in module._buffers
            or name in module.__dict__ or hasattr(type(module), name))


def _has_offload_hooks(module: torch.nn.Module) -> bool:
    # accelerate's cpu/sequential offload and diffusers' group offloading attach these to the modules they move.
    for m in (module, *module.transformer_blocks):
        if getattr(m, "_hf_hook", None) is not None:
            return True
        registry = getattr(m, "_diffusers_hook", None)
        if registry is not None and getattr(registry, "hooks", None):
            return True
    return False


def _parallel(transformer) -> bool:
    if getattr(transformer, "_parallel_config", None) is not None:
        return True
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size() > 1
    return False


@dataclass(frozen=True)
class Verdict:
    """The guard's answer for one request or step.

    `reason`: why it must run eagerly, None when it may replay. `fingerprint`: the weights' addresses its graphs are
    keyed on. `drop_graphs`: the model was judged anew and found wrapped for LoRA, so every captured graph replays
    layers that no longer compute what the model does; the caller must drop them all.
    """

    reason: str | None
    fingerprint: tuple
    drop_graphs: bool = False

    @property
    def ok(self) -> bool:
        return self.reason is None


class ModelGuard:
    """Judges whether the loaded model may replay captured graphs, cheaply enough for every decode step.

    The whole-model checks (devices, hooks, LoRA wrappers) run over one `ModelScan` at every request start
    (`new_request`), and again only when the weights' addresses or the Linear layers change; per step only the
    fingerprint and the structure watch run, plus the request's own checks. `backend.unavailable_reason` is the
    capture backend's static check (the CUDA one: `static_reason`).
    """

    def __init__(self, transformer: torch.nn.Module, backend):
        self._transformer = weakref.ref(transformer)
        self._backend = backend
        self.scan: ModelScan | None = None
        self._static: tuple = (None, None)  # (weights fingerprint judged, its reason or None)

    def new_request(self) -> None:
        """A request starts: modules may have been hooked or wrapped since the last one, so judge the model again,
        once. The module tree is walked again only when it changed; an unchanged one keeps its scan (and its LoRA
        verdict)."""
        if self.scan is None or self.scan.stale():
            self.scan = None
        else:
            self.scan.checked = False
        self._static = (None, None)

    def fingerprint(self) -> tuple:
        """The weights' addresses: a captured graph is valid only while this is unchanged."""
        if self.scan is None:
            self.scan = ModelScan(self._transformer())
        return self.scan.fingerprint()

    def check(self, kv_dtype: torch.dtype, key_valid) -> Verdict:
        """Whether a request with prefix K/V of `kv_dtype` and this text mask may replay, on the model as it is."""
        fingerprint = self.fingerprint()
        seen, reason = self._static
        drop = False
        if seen != fingerprint or self.scan.changed():
            transformer = self._transformer()
            if self.scan.checked:
                # The model changed after this scan was judged: scan the new module tree (once, not every step).
                self.scan = ModelScan(transformer)
                fingerprint = self.scan.fingerprint()
            reason = self._backend.unavailable_reason(transformer, self.scan.params)
            if reason is None and self.scan.lora_wrapped:
                reason = LORA
            self.scan.checked = True
            self._static = (fingerprint, reason)
            drop = reason == LORA
        return Verdict(reason or request_reason(kv_dtype, key_valid), fingerprint, drop)
