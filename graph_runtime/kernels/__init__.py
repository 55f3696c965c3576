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

# Process-wide by nature: torch.library holds one `kvgraph::<name>` per process, and defining it again under the
# same name destroys the first definition's library (calls through the first op object then reach a deregistered
# kernel, seen as `std::bad_alloc`). The pack's root __init__ makes sure there is one `graph_runtime` per process,
# so this one table is the process's.
_OPS: dict = {}


def define_once(name: str, define):
    """The process's one `torch.library` op `kvgraph::<name>`, built by `define()` on first use (see `_OPS`)."""
    if name not in _OPS:
        _OPS[name] = define()
    return _OPS[name]
