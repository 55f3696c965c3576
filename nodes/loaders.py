"""Loader nodes: a diffusers pipeline folder, or ComfyUI's single files (INT8 ConvRot, as ComfyUI's templates load by
default, or bf16).

Weights load to the offload device (normally the CPU); ComfyUI's model management moves them to the GPU when a node
first needs them. Loaded models are cached by file identity for the life of the process (see model_cache).
"""

from __future__ import annotations

import logging

import comfy.model_management as mm
from comfy_api.latest import io

from ..graph_runtime.fp8 import (
    DEFAULT_PRECISION, PRECISION_CHOICES, apply_precision, check_precision, resolve_precision,
)
from ..graph_runtime.kernels.preload import start_preload
from ..graph_runtime.loading import (
    default_scheduler_config, load_pipeline_folder, load_text_encoder, load_transformer, load_vae,
)
from ..graph_runtime.decode.attention import ATTENTION_CHOICES, AUTO as AUTO_ATTENTION, check_attention
from ..graph_runtime.errors import CheckpointError, InputError
from ..graph_runtime.loading.gguf_files import is_gguf
from ..graph_runtime.loading.gguf_text_encoder import pick_vision_file
from ..graph_runtime.loading.gguf_transformer import int8_while_read
from ..graph_runtime.loading.transformer import transformer_is_quantized
from ..graph_runtime.loading.variant import transformer_variant
from ..graph_runtime.parallel import GPUS_HELP, check_gpus
from ..graph_runtime.parallel.plan import check_heads
from ..graph_runtime.quantized import KEEP_INT8, QUANTIZED_MODES, check_mode, int8_modules
from .comfyui import model_cache, model_files
from .comfyui.model_handles import TE_AUTO, TE_PLACEMENTS, TextEncoderHandle, TransformerHandle, VAEHandle
from .comfyui.types import DTYPE_TOOLTIP, DTYPES, LOADERS, TextEncoder, Transformer, Vae

logger = logging.getLogger("kvgraph")

# The files ComfyUI's own Qwen-Image-2.1 templates load by default, then the bf16 alternatives their notes name.
TRANSFORMER_FILE = "qwen_image_2.1_int8_convrot.safetensors"
TRANSFORMER_FILES = (TRANSFORMER_FILE, "qwen_image_2.1_turbo_int8_convrot.safetensors",
                     "qwen_image_2.1_bf16.safetensors", "qwen_image_2.1_turbo_bf16.safetensors")
TEXT_ENCODER_FILE = "qwen3vl_8b_int8_convrot.safetensors"
TEXT_ENCODER_FILES = (TEXT_ENCODER_FILE, "qwen3vl_8b_bf16.safetensors")
VAE_FILE = "qwen_image_2.1_vae_bf16.safetensors"

PLACEMENT_TOOLTIP = (
    "Where the Qwen3-VL text encoder (16.3 GB in bf16, 9.4 GB int8) lives. On a CUDA GPU it keeps one pinned copy "
    "in host RAM (the encoder's size, page-locked): loading copies from it, offloading just drops the GPU copy. "
    "'auto' (default): the memory plan's choice for each encode: 'gpu while encoding, then offload' where the whole "
    "encoder fits in VRAM for the encode, else 'streamed by layer', else 'cpu' (the log says which). "
    "'gpu while encoding, then offload': in VRAM only while a changed prompt is encoded; the upload from "
    "the pinned copy costs a fraction of a second per changed prompt, seconds without it (docs/memory.md); no VRAM "
    "between prompts. 'always gpu': stays in VRAM (its full size) for instant re-encoding; ComfyUI still unloads it "
    "(instantly) when another model needs the room. 'streamed by layer': for cards that cannot hold the whole "
    "encoder: only its embeddings, vision tower and two of its 36 decoder layers are in VRAM while it encodes "
    "(about 3 GB in bf16), each layer uploaded from the pinned copy while the one before it computes; the same "
    "result, slower per changed prompt. 'cpu': encodes on the CPU: no VRAM and no pinned RAM, "
    "seconds to minutes per changed prompt."
)


INT8_TOOLTIP = (
    "How an INT8 ConvRot file (ComfyUI's *_int8_convrot, the templates' default) runs; a bf16 file loads the same "
    "either way. int8: kept int8 and run W8A8 through comfy-kitchen, ComfyUI's own kernels, inside the captured "
    "steps; half the memory (DiT ~7 GB instead of ~14 GB, text encoder ~8.7 GB instead of ~16 GB), the choice for "
    "16-24 GB cards, and on RTX 40/50 the faster one. dequantize: expanded once at load into ordinary weights of "
    "'dtype' (bf16 memory, the bf16 fast path): with the memory to spare, the choice for the model's own "
    "bf16 rounding (speeds per GPU: docs/quantized.md)."
)

TRANSFORMER_OUT = "The Qwen-Image-2.1 transformer, for the KV-Graph sampler's model input."
MODEL_OUT = ("The same transformer as a ComfyUI MODEL, for core's samplers (KSampler, SamplerCustomAdvanced with "
             "KV-Graph Sigmas, ...); its steps replay the same captured graphs.")
TEXT_ENCODER_OUT = "The Qwen3-VL text encoder with its processor, for the KV-Graph text encode node."
VAE_OUT = "The Qwen-Image-2.1 VAE, for the KV-Graph VAE nodes and the text encode node's reference images."


PRECISION_TOOLTIP = (
    "The block Linears' precision. 'auto' (default): the fastest one within ComfyUI's INT8 ConvRot error on the same "
    "weights: 'int8' where the pack's INT8 GEMM runs (NVIDIA, compute capability 8.0+), else 'fp8-attn' on an FP8 "
    "GPU, else 'bf16'; an INT8 file keeps its own int8 weights. 'int8' quantizes a float file's block Linears once "
    "at load to INT8 ConvRot, as ComfyUI's INT8 files are made (half the memory of bf16). 'bf16' runs the Linears "
    "as loaded. 'fp8' quantizes them all to e4m3 with per-channel scales, but has about 2.5x INT8's error; "
    "'fp8-attn' keeps the MLP in bf16, 'fp8-no-out' the attention output projection. An explicit FP8 choice on an "
    "INT8 ConvRot file dequantizes it first whatever int8_weights says.")

ATTENTION_TOOLTIP = (
    "The decode step's attention kernel (the Linears' precision is the 'precision' input). 'auto' (default): "
    "FlashAttention-3 on a Hopper GPU (compute capability 9.0) where the [fa3] extra is installed (pip install "
    "comfyui-kv-graph[fa3]), else PyTorch's SDPA; with INT8 Linears it attends in FP8 (as 'fp8', which stays within "
    "the INT8 error those weights already have), else in bf16 (SDPA's results within bf16 rounding). 'sdpa': always "
    "SDPA. 'fa3': FlashAttention-3 bf16 whatever the Linears, a fallback to SDPA logged as a warning. 'fp8': "
    "FlashAttention-3's FP8 forward over e4m3 q/k/v with per-head scales, faster attention (docs/performance.md); it "
    "needs Hopper and the [fa3] extra, and elsewhere runs what auto picks, with the reason logged once and shown in "
    "the KV-Graph status. Changing it keeps the loaded weights: the decode step is rebuilt (graphs captured again) "
    "at the next run. Only 'auto' with gpus above 1.")


def _attention_input():
    # Optional, so workflows saved before it existed still validate (they get auto).
    return io.Combo.Input("attention", options=list(ATTENTION_CHOICES), default=AUTO_ATTENTION, optional=True,
                          tooltip=ATTENTION_TOOLTIP)


def check_attention_input(attention, gpus) -> str:
    """The loader's attention input, checked before anything loads (sequence-parallel ranks choose their own)."""
    check_attention(attention)
    if attention != AUTO_ATTENTION and gpus > 1:
        raise InputError("attention", attention, "auto with gpus above 1 (each GPU's decode step chooses as auto "
                                                 "does)")
    return attention


def _precision_input():
    # Optional, so workflows saved before it existed still validate (they get auto).
    return io.Combo.Input("precision", options=list(PRECISION_CHOICES), default=DEFAULT_PRECISION, optional=True,
                          tooltip=PRECISION_TOOLTIP)


def _gpus_input():
    # Optional, so workflows saved before it existed still validate (they get one device).
    return io.Int.Input("gpus", default=1, min=1, max=8, optional=True, tooltip=GPUS_HELP)


def with_gpus(handle: TransformerHandle, gpus) -> TransformerHandle:
    """The loaded transformer, to be sampled on `gpus` devices: checked against this machine and the model."""
    check_gpus(gpus, mm.get_torch_device())
    check_heads(gpus, handle.module.config.num_attention_heads)
    return handle.with_gpus(gpus)


def _dtype_input():
    return io.Combo.Input("dtype", options=list(DTYPES), default="bf16", tooltip=DTYPE_TOOLTIP)


def _int8_input():
    return io.Combo.Input("int8_weights", options=list(QUANTIZED_MODES), default=KEEP_INT8, tooltip=INT8_TOOLTIP)


def _placement_input():
    return io.Combo.Input("text_encoder_placement", options=list(TE_PLACEMENTS), default=TE_AUTO,
                          tooltip=PLACEMENT_TOOLTIP)


def weights_info(module, int8_weights: str) -> dict:
    """What the handle reports about its weights: "int8" (int8 layers kept), "dequantized" or "float"."""
    kept = len(int8_modules(module))
    if kept:
        return {"weights": "int8", "int8_layers": kept}
    return {"weights": "float" if int8_weights == KEEP_INT8 else "float (int8 files dequantized)"}


def start_kernel_preload() -> None:
    """Triton's and the CUDA libraries' one-time set-up in a thread (graph_runtime/kernels/preload.py), for the
    device ComfyUI computes on; nothing when that is not a CUDA device (`--cpu`, other backends)."""
    device = mm.get_torch_device()
    if getattr(device, "type", None) == "cuda":
        start_preload(device)


def transformer_handle(path: str, dtype_name: str, scheduler_config: dict | None = None,
                       int8_weights: str = KEEP_INT8, precision: str = DEFAULT_PRECISION) -> TransformerHandle:
    check_mode(int8_weights, "int8_weights")
    check_precision(precision)
    int8_file = transformer_is_quantized(path)
    resolved = resolve_precision(precision, mm.get_torch_device(), dtype=DTYPES[dtype_name],
                                 int8_file=int8_file and int8_weights == KEEP_INT8,
                                 dequantized=int8_file and int8_weights != KEEP_INT8)
    # A conversion quantizes from float weights: an INT8 file is dequantized first whatever `int8_weights` says
    # (`int8` on an INT8 file converts nothing: the file's own int8 weights run).
    quantized = "dequantize" if resolved.converts else int8_weights
    # a GGUF file turns int8 block by block while it is read (a peak near the int8 model's size, not the bf16 one's)
    early = int8_while_read(path, resolved)

    def load():
        start_kernel_preload()  # started at ComfyUI's start-up already, unless the pack was loaded otherwise
        module = load_transformer(path, dtype=DTYPES[dtype_name], device=mm.unet_offload_device(),
                                  quantized=quantized, dequantize_device=mm.get_torch_device(),
                                  gguf_int8_on=mm.get_torch_device() if early else None)
        if resolved.converts and not early:
            apply_precision(module, resolved.precision, device=mm.get_torch_device())
        logger.info("KV-Graph: transformer precision: %s", resolved.describe(module))
        info = {"variant": transformer_variant(path), **weights_info(module, quantized),
                "precision": resolved.precision}
        return TransformerHandle.create(
            "transformer", module, path, dtype_name, mm.get_torch_device(), mm.unet_offload_device(),
            scheduler_config=scheduler_config or default_scheduler_config(), info=info)

    # A load that converts nothing keeps the key it always had; an FP8 precision is another model (`auto` shares the
    # entry of what it resolved to).
    options = (resolved.precision,) if resolved.converts else ()
    return model_cache.get_or_load(model_cache.cache_key("transformer", path, dtype_name, quantized, *options), load)


def text_encoder_handle(path: str, dtype_name: str, placement: str, tokenizer_dir: str | None,
                        int8_weights: str = KEEP_INT8, vision: str | None = None):
    if placement not in TE_PLACEMENTS:
        from ..graph_runtime.errors import InputError

        raise InputError("text_encoder_placement", placement, f"one of {', '.join(TE_PLACEMENTS)}")
    check_mode(int8_weights, "int8_weights")

    def load():
        load_device = "cpu" if placement == "cpu" else mm.text_encoder_device()
        offload_device = "cpu" if placement == "cpu" else mm.text_encoder_offload_device()
        module, processor = load_text_encoder(path, dtype=DTYPES[dtype_name], device=offload_device,
                                              tokenizer_dir=tokenizer_dir, quantized=int8_weights,
                                              dequantize_device=load_device, vision=vision)
        return TextEncoderHandle.create("text_encoder", module, path, dtype_name, load_device, offload_device,
                                        processor=processor, placement=placement,
                                        info={"placement": placement, **weights_info(module, int8_weights)})

    key = model_cache.cache_key("text_encoder", path, dtype_name, placement, int8_weights, *([vision] if vision else []))
    return model_cache.get_or_load(key, load)


def vae_handle(path: str, dtype_name: str) -> VAEHandle:
    def load():
        module = load_vae(path, dtype=DTYPES[dtype_name], device=mm.vae_offload_device())
        return VAEHandle.create("vae", module, path, dtype_name, mm.vae_device(), mm.vae_offload_device())

    return model_cache.get_or_load(model_cache.cache_key("vae", path, dtype_name), load)


class KVGraphLoadTransformer(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphLoadTransformer",
            display_name="KV-Graph Load Transformer",
            category=LOADERS,
            description=("Loads the Qwen-Image-2.1 transformer from models/diffusion_models (ComfyUI's "
                         f"{TRANSFORMER_FILE}, its Turbo twin, the bf16 files, or ComfyUI-GGUF .gguf files). The loaded model, and the decode "
                         "graphs captured for it, stay cached across prompts and workflows until released."),
            inputs=[
                io.Combo.Input("transformer_name", options=model_files.file_choices("diffusion_models",
                                                                                    *TRANSFORMER_FILES),
                               default=TRANSFORMER_FILE,
                               tooltip="The transformer file in models/diffusion_models: ComfyUI's INT8 ConvRot file "
                                       "(the templates' default), the bf16 one, or a .gguf file (also from models/unet; "
                                       "dequantized at load, then run at the chosen precision); a file with 'turbo' "
                                       "in its name is "
                                       "the 8-step Turbo model (the sampler's auto preset follows it)."),
                _dtype_input(),
                _int8_input(),
                _precision_input(),
                _gpus_input(),
                _attention_input(),
            ],
            outputs=[Transformer.Output(display_name="transformer", tooltip=TRANSFORMER_OUT),
                     io.Model.Output(display_name="model", tooltip=MODEL_OUT)],
        )

    @classmethod
    def fingerprint_inputs(cls, transformer_name, dtype, int8_weights=KEEP_INT8, precision=DEFAULT_PRECISION,
                           gpus=1, attention=AUTO_ATTENTION):
        return model_files.fingerprint("diffusion_models", transformer_name, dtype, int8_weights, precision, gpus,
                                       attention)

    @classmethod
    def execute(cls, transformer_name, dtype, int8_weights=KEEP_INT8, precision=DEFAULT_PRECISION,
                gpus=1, attention=AUTO_ATTENTION) -> io.NodeOutput:
        check_gpus(gpus, mm.get_torch_device())
        check_attention_input(attention, gpus)
        path = model_files.full_path("diffusion_models", transformer_name, "transformer_name")
        handle = transformer_handle(path, dtype, int8_weights=int8_weights, precision=precision)
        # The attention rides on the handle and the MODEL, not in the cache key: one loaded model for every choice.
        handle = with_gpus(handle, gpus).with_attention(attention)
        return io.NodeOutput(handle, handle.model)


class KVGraphLoadTextEncoder(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphLoadTextEncoder",
            display_name="KV-Graph Load Text Encoder",
            category=LOADERS,
            description=("Loads the Qwen3-VL-8B text encoder from models/text_encoders (ComfyUI's "
                         f"{TEXT_ENCODER_FILE}), with ComfyUI's bundled Qwen tokenizer."),
            inputs=[
                io.Combo.Input("text_encoder_name", options=model_files.file_choices("text_encoders",
                                                                                     *TEXT_ENCODER_FILES),
                               default=TEXT_ENCODER_FILE,
                               tooltip="The Qwen3-VL-8B file in models/text_encoders: ComfyUI's INT8 ConvRot file "
                                       "(the templates' default), the bf16 one, or a GGUF language tower (also from "
                                       "models/clip; dequantized at load, its vision tower read from ComfyUI's "
                                       "Qwen3-VL file in models/text_encoders)."),
                _dtype_input(),
                _placement_input(),
                _int8_input(),
            ],
            outputs=[TextEncoder.Output(display_name="text_encoder", tooltip=TEXT_ENCODER_OUT)],
        )

    @classmethod
    def fingerprint_inputs(cls, text_encoder_name, dtype, text_encoder_placement, int8_weights=KEEP_INT8):
        return model_files.fingerprint("text_encoders", text_encoder_name, dtype, text_encoder_placement, int8_weights)

    @classmethod
    def execute(cls, text_encoder_name, dtype, text_encoder_placement, int8_weights=KEEP_INT8) -> io.NodeOutput:
        path = model_files.full_path("text_encoders", text_encoder_name, "text_encoder_name")
        vision = None
        if is_gguf(path):  # a GGUF language tower: the vision tower from the user's Qwen3-VL file beside it
            vision = pick_vision_file(model_files.files_in("text_encoders"))
            if vision is None:
                raise CheckpointError(path, "is a GGUF language tower, and models/text_encoders holds no Qwen3-VL "
                                            "safetensors file to take the vision tower from.",
                                      "qwen3vl_8b_bf16.safetensors (or its INT8 ConvRot twin) in models/text_encoders")
            logger.info("KV-Graph: vision tower for %s from %s", text_encoder_name, vision)
            vision = str(vision)
        handle = text_encoder_handle(path, dtype, text_encoder_placement, model_files.bundled_tokenizer_dir(),
                                     int8_weights, vision)
        return io.NodeOutput(handle)


class KVGraphLoadVAE(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphLoadVAE",
            display_name="KV-Graph Load VAE",
            category=LOADERS,
            description=f"Loads the Qwen-Image-2.1 VAE (RGBA, 16x) from models/vae (ComfyUI's {VAE_FILE}).",
            inputs=[
                io.Combo.Input("vae_name", options=model_files.file_choices("vae", VAE_FILE), default=VAE_FILE,
                               tooltip="The Qwen-Image-2.1 VAE file in models/vae (not the Qwen-Image 1.x VAE)."),
                _dtype_input(),
            ],
            outputs=[Vae.Output(display_name="vae", tooltip=VAE_OUT)],
        )

    @classmethod
    def fingerprint_inputs(cls, vae_name, dtype):
        return model_files.fingerprint("vae", vae_name, dtype)

    @classmethod
    def execute(cls, vae_name, dtype) -> io.NodeOutput:
        path = model_files.full_path("vae", vae_name, "vae_name")
        return io.NodeOutput(vae_handle(path, dtype))


class KVGraphLoadDiffusers(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="KVGraphLoadDiffusers",
            display_name="KV-Graph Load Diffusers Folder",
            category=LOADERS,
            description=("Loads a Qwen-Image-2.1 pipeline in the Hugging Face diffusers layout from models/diffusers "
                         "(transformer/, text_encoder/, vae/, processor/, scheduler/)."),
            inputs=[
                io.Combo.Input("folder", options=model_files.diffusers_choices(),
                               tooltip="A pipeline folder under models/diffusers (one holding model_index.json)."),
                _dtype_input(),
                _placement_input(),
                _precision_input(),
                _gpus_input(),
                _attention_input(),
            ],
            outputs=[
                Transformer.Output(display_name="transformer", tooltip=TRANSFORMER_OUT),
                TextEncoder.Output(display_name="text_encoder", tooltip=TEXT_ENCODER_OUT),
                Vae.Output(display_name="vae", tooltip=VAE_OUT),
                io.Model.Output(display_name="model", tooltip=MODEL_OUT),
            ],
        )

    @classmethod
    def execute(cls, folder, dtype, text_encoder_placement, precision=DEFAULT_PRECISION, gpus=1,
                attention=AUTO_ATTENTION) -> io.NodeOutput:
        check_gpus(gpus, mm.get_torch_device())
        check_attention_input(attention, gpus)
        root = model_files.diffusers_path(folder)
        scheduler = load_pipeline_folder(root, dtype=DTYPES[dtype], device="meta", components=()).scheduler_config
        transformer = with_gpus(transformer_handle(root, dtype, scheduler, precision=precision), gpus)
        transformer = transformer.with_attention(attention)
        text_encoder = text_encoder_handle(root, dtype, text_encoder_placement, tokenizer_dir=None)
        vae = vae_handle(root, dtype)
        return io.NodeOutput(transformer, text_encoder, vae, transformer.model)


LOADER_NODES = [KVGraphLoadTransformer, KVGraphLoadTextEncoder, KVGraphLoadVAE, KVGraphLoadDiffusers]
