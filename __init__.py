"""KV-Graph: Qwen-Image-2.1 for ComfyUI with a prefix K/V prefill and CUDA-graph decode steps.

ComfyUI loads this folder (any folder name under custom_nodes) through `comfy_entrypoint` (V3) and serves
`WEB_DIRECTORY`. Outside ComfyUI (tests, the CLI, tooling) the import succeeds and exposes nothing ComfyUI-specific.

One `graph_runtime` per process: ComfyUI imports this folder under its folder name, so the runtime would be
`<folder>.graph_runtime`, while the CLI, the benchmarks and other code import it as top-level `graph_runtime`. Two
copies would mean two of every piece of module-level state (loaded models, custom ops, the kernel preload). So the
pack's `graph_runtime` IS the top-level one: it is imported (from this folder) under that name once, and every
`<folder>.graph_runtime[.x]` the nodes import relatively resolves to the same module object.
"""

import importlib.abc
import importlib.util
import os
import sys

WEB_DIRECTORY = "./web"

_RUNTIME = "graph_runtime"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _import_the_one_runtime():
    """Top-level `graph_runtime` from this folder; a clear error if another copy was imported first."""
    init = os.path.join(_HERE, _RUNTIME, "__init__.py")
    runtime = sys.modules.get(_RUNTIME)
    if runtime is not None:
        found = getattr(runtime, "__file__", None)
        if not (found and os.path.exists(found) and os.path.samefile(found, init)):
            raise ImportError(
                f"KV-Graph at {_HERE} needs its own `{_RUNTIME}` package, but another copy is already imported from "
                f"{found}; remove one of the two installs (pip uninstall kv-graph, or the custom_nodes folder).")
        return runtime
    spec = importlib.util.spec_from_file_location(_RUNTIME, init, submodule_search_locations=[os.path.dirname(init)])
    runtime = importlib.util.module_from_spec(spec)
    sys.modules[_RUNTIME] = runtime
    try:
        spec.loader.exec_module(runtime)
    except BaseException:
        del sys.modules[_RUNTIME]
        raise
    return runtime


class _SameRuntime(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `<this pack>.graph_runtime.x` to the already-imported (or now imported) `graph_runtime.x`."""

    def __init__(self, alias: str):
        self.alias = alias + "."

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(self.alias):
            return None
        return importlib.util.spec_from_loader(name, self, is_package=False)

    def create_module(self, spec):
        return None  # a placeholder, replaced in exec_module

    def exec_module(self, module):
        # The import system returns whatever sys.modules holds under the name once this returns.
        real = importlib.import_module(_RUNTIME + module.__name__[len(self.alias) - 1:])
        sys.modules[module.__name__] = real


sys.modules[f"{__name__}.{_RUNTIME}"] = _import_the_one_runtime()
sys.meta_path.insert(0, _SameRuntime(f"{__name__}.{_RUNTIME}"))

try:
    import comfy_api.latest  # noqa: F401  (present only inside ComfyUI)
except ImportError:  # imported outside ComfyUI
    _IN_COMFYUI = False
else:
    _IN_COMFYUI = True

if _IN_COMFYUI:
    from .nodes.extension import comfy_entrypoint  # noqa: F401
    from .nodes.loaders import start_kernel_preload
    from .nodes.comfyui import example_inputs as _example_inputs
    from .nodes.comfyui import server_routes as _server_routes

    # The folder as ComfyUI found it under custom_nodes (not resolved: a linked pack keeps the link's name).
    _server_routes.register(pack_dir=os.path.dirname(os.path.abspath(__file__)))
    # The edit examples' reference images, into ComfyUI's input folder where they are missing.
    _example_inputs.install_example_inputs(os.path.dirname(os.path.abspath(__file__)))
    # Triton's and the CUDA libraries' one-time set-up, in a thread now rather than in the first prompt.
    start_kernel_preload()

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"] if _IN_COMFYUI else ["WEB_DIRECTORY"]
