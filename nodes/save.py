"""KV-Graph Save Image: core's SaveImage (the same files, names, metadata and UI result) with each PNG deflated on
several CPU threads (graph_runtime/png_writer.py)."""

from __future__ import annotations

import folder_paths
from comfy.cli_args import args
from comfy_api.latest import io

from ..graph_runtime.comfy_interop.pixels import check_image
from ..graph_runtime.comfy_interop.saved_images import png_text, prefix_text, save_batch
from .comfyui.types import IMAGE


class KVGraphSaveImage(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphSaveImage",
            display_name="KV-Graph Save Image",
            category=IMAGE,
            description=("Saves the images to the ComfyUI output folder as core's Save Image does (the same file "
                         "names, counter, prompt and workflow metadata), with each PNG compressed on several CPU "
                         "threads; it never replaces an existing file, and a failed write leaves no partial PNG."),
            inputs=[
                io.Image.Input("images", tooltip="The images to save."),
                io.String.Input("filename_prefix", default="ComfyUI",
                                tooltip="The prefix for the files to save, as in core's Save Image: it may name a "
                                        "subfolder and include %date:yyyy-MM-dd%, %width%, %height% or "
                                        "%batch_num%."),
            ],
            outputs=[io.Image.Output(display_name="images",
                                     tooltip="The same images, passed through (as newer core Save Image does).")],
            hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, images, filename_prefix="ComfyUI") -> io.NodeOutput:
        check_image(images, "images")
        filename_prefix = prefix_text(filename_prefix)
        folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory(), images[0].shape[1], images[0].shape[0])
        hidden = cls.hidden
        text = None if args.disable_metadata or hidden is None else png_text(hidden.prompt, hidden.extra_pnginfo)
        results = save_batch(images, folder, filename, counter, subfolder, text)
        return io.NodeOutput(images, ui={"images": results})


SAVE_NODES = [KVGraphSaveImage]
