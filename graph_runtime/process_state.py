"""State shared by every copy of the pack in one process.

The pack can be imported twice in one process under different module names: as `<folder>.graph_runtime` by
ComfyUI (any folder name under custom_nodes) and as the installed top-level `graph_runtime` (CLI, tests, other
packs). Module-level state would then exist twice, so what must be one per process (the engine registry, the custom
ops, the kernel preload) lives in a well-known entry of `sys.modules`, which both copies find.
"""

from __future__ import annotations

import sys
import types


def process_wide(name: str, make):
    """The object stored under `sys.modules[name]`, made by `make()` the first time any copy asks for it."""
    module = sys.modules.get(name)
    if module is None:
        fresh = types.ModuleType(name)
        fresh.value = make()
        # setdefault: if two threads race here, both end up with the first module stored.
        module = sys.modules.setdefault(name, fresh)
    return module.value
