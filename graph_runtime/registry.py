"""The process-wide registry of decode engines (and so of graph managers): exactly one per process.

The pack can be imported twice in one process under different module names: as `<folder>.graph_runtime` by
ComfyUI (any folder name under custom_nodes) and as the installed top-level `graph_runtime` (CLI, tests, other
packs). Module-level state would then exist twice, so the registry is process-wide (process_state.py). Engines
are attached to the transformer they serve, so whichever copy asks for a transformer's engine gets the same one.
"""

from __future__ import annotations

import threading
import weakref

from .process_state import process_wide

_MODULE_NAME = "_kvgraph_process_registry"
_ENGINE_ATTR = "_kvgraph_engine"


class EngineRegistry:
    def __init__(self):
        self._engines: "weakref.WeakSet" = weakref.WeakSet()
        self.lock = threading.RLock()

    def add(self, engine) -> None:
        with self.lock:
            self._engines.add(engine)

    def engines(self) -> list:
        with self.lock:
            return list(self._engines)

    def status(self) -> list[dict]:
        return [engine.status() for engine in self.engines()]

    def release_all(self) -> list[dict]:
        return [engine.release() for engine in self.engines()]


def process_registry() -> EngineRegistry:
    return process_wide(_MODULE_NAME, EngineRegistry)


def engine_for(transformer, **options):
    """The transformer's decode engine, created on first use and alive as long as the transformer is."""
    engine = getattr(transformer, _ENGINE_ATTR, None)
    if engine is None:
        from .decode import DecodeEngine

        registry = process_registry()
        with registry.lock:
            engine = getattr(transformer, _ENGINE_ATTR, None)
            if engine is None:
                engine = DecodeEngine(transformer, **options)
                # object.__setattr__: nn.Module.__setattr__ would try to register it; it is not a submodule.
                object.__setattr__(transformer, _ENGINE_ATTR, engine)
                registry.add(engine)
    return engine
