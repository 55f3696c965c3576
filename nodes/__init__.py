"""The KV-Graph node pack: ComfyUI glue over graph_runtime. Imported only inside ComfyUI (its modules import
comfy_api); the node list and the entry point ComfyUI calls are extension.py's. This __init__ imports nothing, so
the modules here import each other without running back up through it.

Everything here uses relative imports: inside ComfyUI a top-level `nodes` module is ComfyUI's own.
"""
