"""Build a model with no weight memory, check a checkpoint against it, then hand it the checkpoint's tensors.

The full transformer is 14 GB in bf16: building it normally and then copying weights in would hold it twice (plus a
random init of 7B parameters on the CPU). Parameters are therefore created on the `meta` device, and
`load_state_dict(assign=True)` makes the loaded tensors *be* the parameters. Buffers are still built for real: they
are small and mostly computed in `__init__` (RoPE tables, timestep frequencies) rather than stored in checkpoints.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Callable, Iterable, Mapping

import torch

from ..errors import CheckpointError

_SHOW = 3  # how many offending keys an error names


_active = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_original_register = None


def _register_parameter(module, name, param):
    _original_register(module, name, param)
    if getattr(_active, "on", False) and param is not None and param.device.type != "meta":
        module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def empty_parameters():
    """Within this block every nn.Parameter this thread creates is moved to `meta` as soon as a module registers it.

    The hook has to sit on nn.Module itself, but it acts only for the thread inside the block: ComfyUI builds other
    models on other threads, and those must get real parameters."""
    global _patch_users, _original_register
    with _patch_lock:
        if _patch_users == 0:
            # whatever is installed now (torch's own, or another library's hook) is what gets restored
            _original_register = torch.nn.Module.register_parameter
            torch.nn.Module.register_parameter = _register_parameter
        _patch_users += 1
    _active.on = True
    try:
        yield
    finally:
        _active.on = False
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                torch.nn.Module.register_parameter = _original_register


def build_empty(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with empty_parameters():
        return factory()


def _first(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_SHOW])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _SHOW else "")


def check_against_model(model: torch.nn.Module, shapes: Mapping[str, tuple], path: str | os.PathLike,
                        expected: str, may_be_absent: Iterable[str] = (),
                        file_key: Callable[[str], str] = lambda key: key,
                        file_shapes: Mapping[str, tuple] | None = None) -> None:
    """Raise CheckpointError naming the first few missing, unexpected or mis-shaped tensors. `shapes` are in the
    model's key names; `file_key` turns one back into the file's own name, whose shape in the file is looked up in
    `file_shapes`, for the message."""
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    absent_ok = set(may_be_absent)
    missing = [k for k in wanted if k not in shapes and k not in absent_ok]
    unexpected = [k for k in shapes if k not in wanted]
    misshaped = [k for k in shapes if k in wanted and tuple(shapes[k]) != wanted[k]]
    if missing:
        missing = sorted({file_key(k) for k in missing})
        raise CheckpointError(path, f"is missing {len(missing)} tensor(s) the model needs: {_first(missing)}. The "
                                    "file is incomplete or from another variant of the model.", expected)
    if misshaped:
        # one file tensor can feed several model tensors (a fused gate_up): report it once
        by_file_key = {}
        for k in sorted(misshaped):
            by_file_key.setdefault(file_key(k), k)
        def describe(name, k):
            stored = (file_shapes or {}).get(name)
            if name == k or stored is None:
                return f"{name}: file {list(shapes[k])}, model {list(wanted[k])}"
            # a renamed or reshaped tensor: show it as stored and as the model reads it
            return f"{name}: file {list(stored)}, read as {k} {list(shapes[k])}, model {list(wanted[k])}"

        detail = "; ".join(describe(name, k) for name, k in list(by_file_key.items())[:_SHOW])
        raise CheckpointError(path, f"has {len(by_file_key)} tensor(s) of the wrong shape: {detail}.", expected)
    if unexpected:
        raise CheckpointError(path, f"has {len(unexpected)} tensor(s) this model does not have: "
                                    f"{_first(file_key(k) for k in unexpected)}.", expected)


def load_bytes(header, dtype: torch.dtype) -> int:
    """What a file's weights take once loaded in `dtype`: float tensors cast to it, int8 layers (and their records)
    as stored. The least a load needs."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(info.shape) * (1 if info.dtype in ("I8", "U8") else itemsize)
               for info in header.tensors.values())


def check_fits(path: str | os.PathLike, header, dtype: torch.dtype, device, expected: str) -> None:
    """Refuse, before any weight is read, a checkpoint whose weights alone exceed all the memory of the device they
    load to (the host's RAM or its memory cgroup's limit, a GPU's memory): such a load can only fail, after minutes,
    or get the process killed."""
    from ..free_memory import host_total_bytes
    from ..report import gib

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        total, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    elif device.type == "cpu":
        total, where = host_total_bytes(), "the host's memory (or its memory cgroup's limit)"
    else:
        return
    needed = load_bytes(header, dtype)
    if total is not None and needed > total:
        raise CheckpointError(path, f"holds {gib(needed)} of weights in {str(dtype).removeprefix('torch.')}, more "
                                    f"than all of {where}, {gib(total)}.", expected)


def assign_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Make the tensors of `state_dict` the model's parameters (no copy)."""
    model.load_state_dict(dict(state_dict), strict=False, assign=True)


def finish(model: torch.nn.Module, path, expected: str, device: str | torch.device) -> torch.nn.Module:
    """Fail on any parameter still on `meta`, move what was built on the CPU (buffers) to `device`, and set the
    model up for inference."""
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise CheckpointError(path, f"left {len(left)} parameter(s) without weights: {_first(left)}.", expected)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model
