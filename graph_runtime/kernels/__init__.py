"""Hand-written kernels for the decode step where inductor's own code falls short (docs/performance.md says by how much).

Compiled code and restarts: Triton compiles a kernel once per *specialization* of its arguments (dtypes,
constexprs, and for each integer whether it is 1 or a multiple of 16) and keeps the binary in its on-disk cache
(`~/.triton/cache`, or `TRITON_CACHE_DIR`), which survives restarts. Arguments that change with the prompt (token
counts, the prefix length, element counts) are therefore marked `do_not_specialize`: a prompt of 137 tokens after
one of 128 would otherwise compile a second variant (a compile per kernel on a first prompt), and a restart would
recompile whichever variant the cache did not hold yet. They are only compared and multiplied, never used for
alignment, so the kernels lose nothing by it. Strides and widths that depend only on the model stay specialized.
"""

from __future__ import annotations

from ..process_state import process_wide

_OPS_MODULE = "_kvgraph_process_kernel_ops"


def define_once(name: str, define):
    """The process's one `torch.library` op `kvgraph::<name>`, built by `define()` on first use.

    The pack can be imported twice in one process (as ComfyUI's custom node folder and as the top-level
    `graph_runtime`; see registry.py). Defining a custom op again under the same name destroys the first
    definition's library, and calls through the first copy's op object then reach a deregistered kernel (seen as
    `std::bad_alloc`). So both copies take the op from one process-wide table (process_state.py).
    """
    ops = process_wide(_OPS_MODULE, dict)
    if name not in ops:
        ops[name] = define()
    return ops[name]
