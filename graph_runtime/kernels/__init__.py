"""Hand-written kernels for the decode step where inductor's own code falls short (each file says by how much)."""

from __future__ import annotations

import sys
import types

_OPS_MODULE = "_kvgraph_process_kernel_ops"


def define_once(name: str, define):
    """The process's one `torch.library` op `kvgraph::<name>`, built by `define()` on first use.

    The pack can be imported twice in one process (as ComfyUI's custom node folder and as the top-level
    `graph_runtime`; see registry.py). Defining a custom op again under the same name destroys the first
    definition's library, and calls through the first copy's op object then reach a deregistered kernel (seen as
    `std::bad_alloc`). So both copies take the op from one well-known entry of `sys.modules`.
    """
    holder = sys.modules.get(_OPS_MODULE)
    if holder is None:
        holder = sys.modules.setdefault(_OPS_MODULE, types.ModuleType(_OPS_MODULE))
    ops = holder.__dict__.setdefault("ops", {})
    if name not in ops:
        ops[name] = define()
    return ops[name]
