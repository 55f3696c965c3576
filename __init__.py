"""KV-Graph: Qwen-Image-2.1 for ComfyUI with a prefix K/V prefill and CUDA-graph decode steps.

ComfyUI loads this folder (any folder name under custom_nodes) through `comfy_entrypoint` (V3) and serves
`WEB_DIRECTORY`. Outside ComfyUI (tests, the CLI, tooling) the import succeeds and exposes nothing ComfyUI-specific.
"""

import os

WEB_DIRECTORY = "./web"

try:
    import comfy_api.latest  # noqa: F401  (present only inside ComfyUI)
except ImportError:  # imported outside ComfyUI
    _IN_COMFYUI = False
else:
    _IN_COMFYUI = True

if _IN_COMFYUI:
    from .nodes import comfy_entrypoint  # noqa: F401
    from .nodes.loaders import start_kernel_preload
    from .nodes import example_inputs as _example_inputs
    from .nodes import server_routes as _server_routes

    # The folder as ComfyUI found it under custom_nodes (not resolved: a linked pack keeps the link's name).
    _server_routes.register(pack_dir=os.path.dirname(os.path.abspath(__file__)))
    # The edit examples' reference images, into ComfyUI's input folder where they are missing.
    _example_inputs.install_example_inputs(os.path.dirname(os.path.abspath(__file__)))
    # Triton's and the CUDA libraries' one-time set-up, in a thread now rather than in the first prompt.
    start_kernel_preload()

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"] if _IN_COMFYUI else ["WEB_DIRECTORY"]
