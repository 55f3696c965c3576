"""The pack's glue to ComfyUI itself, beside the node modules that use it: every module here imports ComfyUI
(its model management, server, progress bar, model folders or node API). Logic that needs no ComfyUI lives in
graph_runtime/ instead (tests/test_structure.py checks both).

- patcher, model_handles, core_model: the loaded models as ComfyUI manages and samples them (ModelPatcher, MODEL);
- model_cache: the loaded models kept across prompts within a bound, their status and their release;
- model_files: ComfyUI's model folders; example_inputs: the edit examples' images into ComfyUI's input folder;
- memory: what ComfyUI can give a sampling request (its free-memory figures, what it could unload);
- events, progress: websocket events, the progress bar, interrupts and live previews;
- server_routes: the HTTP routes (status, release, the pack's own files); types: socket types and categories.

This __init__ imports nothing, so importing one module here does not pull in the others.
"""
