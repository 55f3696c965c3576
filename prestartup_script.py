"""Run by ComfyUI before it imports torch (custom_nodes/<this folder>/prestartup_script.py): keeps the process on
PyTorch's native CUDA allocator, which captured decode steps need.

ComfyUI asks for the cudaMallocAsync allocator by default (its cuda_malloc.py puts `backend:cudaMallocAsync` in
PYTORCH_CUDA_ALLOC_CONF unless `--disable-cuda-malloc`). Under it, memory allocated inside a CUDA graph capture is a
graph allocation that is not mapped until the graph runs; Triton's launcher asks the driver for every pointer's device
address, is refused, and the capture fails (and its aborted allocations fault the process when freed). The decode
step runs Triton kernels on such memory, so KV-Graph takes the allocator ComfyUI's own `--disable-cuda-malloc` gives:
the entry is removed before torch reads it, and ComfyUI's flag is set to match (its ops then use their cast buffers,
as with that flag). An explicit `--cuda-malloc`, or KVGRAPH_KEEP_CUDA_MALLOC=1, keeps cudaMallocAsync; decode steps
then run eagerly, a reason counted in the statistics (graph_runtime/decode/eligibility.py).

No torch or pack imports here: this runs before either is imported.
"""

from __future__ import annotations

import logging
import os
import sys

ASYNC_ENTRY = "backend:cudaMallocAsync"
CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
KEEP_VARIABLE = "KVGRAPH_KEEP_CUDA_MALLOC"


def without_async_entry(conf: str) -> str:
    """`conf` (PyTorch's comma-separated allocator settings) without its cudaMallocAsync backend entries."""
    return ",".join(e for e in conf.split(",") if e.strip() and e.strip().replace(" ", "") != ASYNC_ENTRY)


def keep_native_allocator(environ=os.environ, argv=sys.argv, modules=sys.modules) -> str | None:
    """Remove the cudaMallocAsync entry from `environ` when it is there, torch is not yet imported and the user did
    not ask for it (`--cuda-malloc`, KVGRAPH_KEEP_CUDA_MALLOC). Returns what it did, for the log, else None."""
    if environ.get(KEEP_VARIABLE, "").strip() not in ("", "0") or "--cuda-malloc" in argv or "torch" in modules:
        return None
    changed = []
    for name in CONF_VARIABLES:
        conf = environ.get(name)
        rest = None if conf is None else without_async_entry(conf)
        if rest == conf:
            continue
        if rest:
            environ[name] = rest
        else:
            del environ[name]
        changed.append(name)
    if not changed:
        return None
    cli_args = modules.get("comfy.cli_args")
    if cli_args is not None and hasattr(cli_args, "args"):
        cli_args.args.cuda_malloc = False
    return (f"KV-Graph: the native CUDA allocator instead of cudaMallocAsync ({', '.join(changed)}): captured decode "
            f"steps run Triton kernels, which fail under cudaMallocAsync; start ComfyUI with --cuda-malloc or set "
            f"{KEEP_VARIABLE}=1 to keep it (decode steps then run eagerly).")


_message = keep_native_allocator()
if _message:
    logging.info(_message)
