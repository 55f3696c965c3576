"""Writes the example workflows from one graph description each, so their two formats stay the same graph:
example_workflows/<title>.json (ComfyUI UI format, named by the title its template card shows), its thumbnail
example_workflows/<title>.jpg, and example_workflows/api/<name>.json (API format). Run from the repository root:

    python tests/e2e/make_workflows.py

Node positions, sizes and the view each workflow opens with come from workflow_layout.py, the thumbnails from
workflow_cards.py. tests/test_workflows.py checks the written files against the node schemas and the layout rules,
independently of this script.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workflow_cards  # noqa: E402
import workflow_layout  # noqa: E402
from workflow_cards import Card  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "example_workflows"

# The files ComfyUI's own Qwen-Image-2.1 templates load by default (INT8 ConvRot); each UI workflow's note names
# the bf16 alternatives.
TRANSFORMER_FILE = "qwen_image_2.1_int8_convrot.safetensors"
TURBO_TRANSFORMER_FILE = "qwen_image_2.1_turbo_int8_convrot.safetensors"
TEXT_ENCODER_FILE = "qwen3vl_8b_int8_convrot.safetensors"
VAE_FILE = "qwen_image_2.1_vae_bf16.safetensors"
# The LoRA workflow's file in models/loras: a stand-in for the user's own LoRA (`make-tiny --comfyui-models` writes a
# tiny one under this name, so the example runs as shipped on the tiny files).
LORA_FILE = "qwen_image_2.1_lora.safetensors"
# The ControlNet workflows' file in models/model_patches (`make-tiny --comfyui-models` writes a tiny one under it).
CONTROLNET_FILE = "qwen_image_2.1_fun_controlnet_union.safetensors"
# The GGUF example's transformer: a ComfyUI-GGUF Q8_0 file (`make-tiny --comfyui-models` writes a tiny one under
# this name, so the example runs as shipped on the tiny files).
GGUF_FILE = "qwen_image_2.1-Q8_0.gguf"
BF16_ALTERNATIVES = {TRANSFORMER_FILE: "qwen_image_2.1_bf16.safetensors",
                     TURBO_TRANSFORMER_FILE: "qwen_image_2.1_turbo_bf16.safetensors",
                     TEXT_ENCODER_FILE: "qwen3vl_8b_bf16.safetensors"}
# The edit workflows load these from ComfyUI's input folder. They ship in example_workflows/inputs/ (drawn by
# draw_reference_images below), and the pack copies them into the input folder at start-up where they are missing.
# Short names: Load Image nodes showing them side by side fit a column.
REFERENCE_IMAGES = tuple(f"kvgraph_edit_{i}.png" for i in range(1, 6))
INPUTS = OUT / "inputs"

# Per node type: (widget name, value) in the order the frontend lays the widgets out, the socket inputs
# (name, type) in schema order, and the outputs (name, type). The seed widget is followed by its
# control_after_generate value in the UI format only.
OUTPUTS = {
    "KVGraphLoadTransformer": [("transformer", "KVGRAPH_TRANSFORMER"), ("model", "MODEL")],
    "KVGraphLoadTextEncoder": [("text_encoder", "KVGRAPH_TEXT_ENCODER")],
    "KVGraphLoadVAE": [("vae", "KVGRAPH_VAE")],
    "KVGraphLoadLoRA": [("model", "KVGRAPH_TRANSFORMER")],
    "KVGraphStepCache": [("model", "KVGRAPH_TRANSFORMER")],
    "EasyCache": [("MODEL", "MODEL")],
    "KVGraphTextEncode": [("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent", "LATENT")],
    "KVGraphSampler": [("latent", "LATENT")],
    "KVGraphVAEDecode": [("image", "IMAGE"), ("mask", "MASK")],
    "LoadImage": [("IMAGE", "IMAGE"), ("MASK", "MASK")],
    "SaveImage": [],
    # Core's sampling nodes, which the core-sampling examples run on the transformer loader's MODEL.
    "KVGraphSigmas": [("sigmas", "SIGMAS")],
    "KVGraphVAEEncode": [("latent", "LATENT")],
    "KSampler": [("LATENT", "LATENT")],
    "RandomNoise": [("NOISE", "NOISE")],
    "KSamplerSelect": [("SAMPLER", "SAMPLER")],
    "CFGGuider": [("GUIDER", "GUIDER")],
    "SamplerCustomAdvanced": [("output", "LATENT"), ("denoised_output", "LATENT")],
    "SetLatentNoiseMask": [("LATENT", "LATENT")],
    "KVGraphLoadControlNet": [("controlnet", "KVGRAPH_CONTROLNET")],
    "KVGraphApplyControlNet": [("model", "KVGRAPH_TRANSFORMER")],
    # Core's LoRA loader on the MODEL, and the background-removal example's nodes.
    "LoraLoaderModelOnly": [("MODEL", "MODEL")],
    "JoinImageWithAlpha": [("IMAGE", "IMAGE")],
    "KVGraphSaveImage": [("images", "IMAGE")],
    "SkipLayerGuidanceDiT": [("MODEL", "MODEL")],
}
SOCKETS = {
    # A socket that takes either kind of KV-Graph model (MatchType): the frontend types it with the allowed types.
    "KVGraphLoadLoRA": [("model", "KVGRAPH_TRANSFORMER,MODEL")],
    "KVGraphApplyControlNet": [("model", "KVGRAPH_TRANSFORMER,MODEL"), ("controlnet", "KVGRAPH_CONTROLNET"),
                               ("vae", "KVGRAPH_VAE"), ("image", "IMAGE"), ("inpaint_image", "IMAGE"),
                               ("mask", "MASK")],
    "KVGraphStepCache": [("model", "KVGRAPH_TRANSFORMER")],
    "EasyCache": [("model", "MODEL")],
    # The reference sockets grow as they are connected (see encode_sockets).
    "KVGraphTextEncode": [("text_encoder", "KVGRAPH_TEXT_ENCODER"), ("vae", "KVGRAPH_VAE")],
    "KVGraphSampler": [("model", "KVGRAPH_TRANSFORMER"), ("positive", "CONDITIONING"),
                       ("negative", "CONDITIONING"), ("latent", "LATENT")],
    "KVGraphVAEDecode": [("vae", "KVGRAPH_VAE"), ("latent", "LATENT")],
    "SaveImage": [("images", "IMAGE")],
    "KVGraphSigmas": [("model", "MODEL"), ("latent", "LATENT")],
    "KVGraphVAEEncode": [("vae", "KVGRAPH_VAE"), ("image", "IMAGE")],
    "KSampler": [("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                 ("latent_image", "LATENT")],
    "CFGGuider": [("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING")],
    "SamplerCustomAdvanced": [("noise", "NOISE"), ("guider", "GUIDER"), ("sampler", "SAMPLER"), ("sigmas", "SIGMAS"),
                              ("latent_image", "LATENT")],
    "SetLatentNoiseMask": [("samples", "LATENT"), ("mask", "MASK")],
    "LoraLoaderModelOnly": [("model", "MODEL")],
    "JoinImageWithAlpha": [("image", "IMAGE"), ("alpha", "MASK")],
    "KVGraphSaveImage": [("images", "IMAGE")],
    "SkipLayerGuidanceDiT": [("model", "MODEL")],
}
# Widgets followed in the UI format by their control_after_generate value.
SEED_WIDGETS = ("seed", "noise_seed")


def encode_sockets(links) -> list:
    """The encode node's sockets: its fixed ones, then the reference sockets connected (`images.imageN`) and the
    empty one the frontend adds after the last connected socket."""
    connected = sum(name.startswith("images.") for name in links)
    return SOCKETS["KVGraphTextEncode"] + [(f"images.image{i}", "IMAGE") for i in range(1, connected + 2)]


def sockets_of(node_type, links) -> list:
    return encode_sockets(links) if node_type == "KVGraphTextEncode" else SOCKETS.get(node_type, [])


def outputs_of(node_type, links, nodes) -> list:
    """A node's outputs; the LoRA node's takes the type of the model connected to it (MatchType)."""
    if node_type in ("KVGraphLoadLoRA", "KVGraphApplyControlNet"):
        source, slot = links["model"]
        source_type = next(t for i, t, *_ in nodes if i == source)
        return [("model", outputs_of(source_type, {}, nodes)[slot][1])]
    return OUTPUTS[node_type]
# What each node is called in the workflows: what it does for the user, not its class name (the node's type, and
# ComfyUI's "Node name for S&R", still name the class).
TITLES = {
    "KVGraphLoadTransformer": "Load transformer (INT8 ConvRot)",
    "KVGraphLoadTextEncoder": "Load text encoder (Qwen3-VL-8B, INT8 ConvRot)",
    "KVGraphLoadVAE": "Load VAE", "KVGraphLoadLoRA": "Load LoRA", "KVGraphTextEncode": "Prompt",
    "KVGraphSampler": "KV-Graph sampler", "KVGraphVAEDecode": "Decode", "SaveImage": "Save image",
    "LoadImage": "Reference image", "MarkdownNote": "Model files",
    "KVGraphSigmas": "Schedule (sigmas)", "KVGraphVAEEncode": "Encode the image", "KSampler": "Sample (KSampler)",
    "RandomNoise": "Noise", "KSamplerSelect": "Sampler", "CFGGuider": "Guider (CFG)",
    "SamplerCustomAdvanced": "Sample (custom advanced)", "SetLatentNoiseMask": "Inpaint mask",
    "KVGraphLoadControlNet": "Load ControlNet (Fun Union)", "KVGraphApplyControlNet": "Apply ControlNet",
    "KVGraphStepCache": "Step cache", "EasyCache": "EasyCache (core)",
    "LoraLoaderModelOnly": "Load LoRA (core)", "JoinImageWithAlpha": "Join image with alpha",
    "KVGraphSaveImage": "Save transparent PNG",
    "SkipLayerGuidanceDiT": "Skip layer guidance",
}
# Frontend-only nodes: in the UI format, not in the API format (the frontend leaves them out of a prompt).
UI_ONLY = {"MarkdownNote"}
OUTPUTS["MarkdownNote"] = []


def files_note(transformer: str) -> str:
    if transformer == GGUF_FILE:
        return (
            "## Model files\n\n"
            f"The transformer is a ComfyUI-GGUF file (`{GGUF_FILE}` stands for yours: any `qwen_image21` `.gguf` in "
            "`models/diffusion_models` or `models/unet`, Q8_0, Q4_K_M, ...), with ComfyUI's own text encoder and "
            f"VAE:\n\n- `text_encoders/{TEXT_ENCODER_FILE}`\n- `vae/{VAE_FILE}`\n\n"
            "The GGUF weights are dequantized once, at load; `precision` **auto** then quantizes them to INT8 "
            "ConvRot where the pack's INT8 GEMM runs (bf16 elsewhere), so every step runs at the 8-bit rate "
            "instead of dequantizing each layer per step (docs/quantized.md). The text encoder's bf16 file works "
            f"too (`{BF16_ALTERNATIVES[TEXT_ENCODER_FILE]}`)."
        )
    return (
        "## Model files\n\n"
        "The loaders default to the INT8 ConvRot files ComfyUI's own Qwen-Image-2.1 templates download:\n\n"
        f"- `diffusion_models/{transformer}`\n- `text_encoders/{TEXT_ENCODER_FILE}`\n- `vae/{VAE_FILE}`\n\n"
        "The bf16 files work too: pick them in the loaders instead "
        f"(`{BF16_ALTERNATIVES[transformer]}`, `{BF16_ALTERNATIVES[TEXT_ENCODER_FILE]}`).\n\n"
        "`int8_weights` on the loaders: **int8** keeps an INT8 file int8 (half the VRAM; 16-24 GB cards), "
        "**dequantize** expands it to bf16 at load (the faster choice on Hopper GPUs with the memory to spare)."
    )


LORA_NOTE = (
    "\n\n## LoRA\n\n"
    "Put a Qwen-Image-2.1 LoRA (`.safetensors`) in ComfyUI's `models/loras` folder and pick it in **Load LoRA**: "
    f"`{LORA_FILE}` stands for yours. Read: PEFT / diffusers, kohya / ComfyUI (`lora_down`/`lora_up`/`alpha`, "
    "`img_mlp.gate_up`), DiffSynth-Studio, LyCORIS LoRA names and full-weight `.diff` files; not DoRA, LoHa, LoKr "
    "or OFT, nor LoRAs for Qwen-Image 1.x or other models (docs/lora.md)."
)


CORE_LORA_NOTE = (
    "\n\n## LoRA (core's loader)\n\n"
    "Core's **Load LoRA** nodes work on the KV-Graph MODEL: the LoRA is merged into the weights in place for the run, "
    f"as KV-Graph Load LoRA merges it, and graphs keep replaying. `{LORA_FILE}` in `models/loras` stands for yours. "
    "On this MODEL core's loader reads `diffusion_model.` and `lora_unet_` names (kohya / ComfyUI); for PEFT / "
    "diffusers files use KV-Graph Load LoRA (docs/lora.md)."
)


def graph(name, prompt, negative="", steps=40, cfg=1.0, preset="auto", references=0, seed=42,
          transformer=TRANSFORMER_FILE, sampler_title=TITLES["KVGraphSampler"],
          transformer_title=TITLES["KVGraphLoadTransformer"]):
    """Nodes as (id, type, widgets [(name, value)], links {input: (source id, slot)}, title), and the layout's
    columns of rows of node ids (see workflow_layout.place)."""
    nodes = [
        (1, "KVGraphLoadTransformer", [("transformer_name", transformer), ("dtype", "bf16"),
                                       ("int8_weights", "int8"), ("precision", "auto"), ("gpus", 1),
                                       ("attention", "auto")], {},
         transformer_title),
        (2, "KVGraphLoadTextEncoder", [("text_encoder_name", TEXT_ENCODER_FILE), ("dtype", "bf16"),
                                       ("text_encoder_placement", "gpu while encoding, then offload"),
                                       ("int8_weights", "int8")], {}, TITLES["KVGraphLoadTextEncoder"]),
        (3, "KVGraphLoadVAE", [("vae_name", VAE_FILE), ("dtype", "bf16")], {}, TITLES["KVGraphLoadVAE"]),
        (20, "MarkdownNote", [("text", files_note(transformer))], {}, TITLES["MarkdownNote"]),
    ]
    encode_links = {"text_encoder": (2, 0)}
    for i in range(references):
        node_id = 10 + i
        nodes.append((node_id, "LoadImage", [("image", REFERENCE_IMAGES[i])], {}, f"Reference image {i + 1}"))
        encode_links[f"images.image{i + 1}"] = (node_id, 0)
    if references:
        encode_links["vae"] = (3, 0)
    nodes.append((4, "KVGraphTextEncode", [
        ("prompt", prompt), ("negative_prompt", negative), ("width", 1024), ("height", 1024),
        ("size_from_reference", True), ("reference_resolution", 1024)], encode_links,
        "Prompt and negative prompt" if negative else "Prompt and reference images" if references else "Prompt"))
    sampler_links = {"model": (1, 0), "positive": (4, 0), "latent": (4, 2)}
    if cfg > 1.0:
        sampler_links["negative"] = (4, 1)
    nodes.append((5, "KVGraphSampler", [
        ("seed", seed), ("steps", steps), ("cfg", cfg), ("sigma_preset", preset), ("denoise", 1.0),
        ("decode_mode", "auto"), ("compile", "off")], sampler_links, sampler_title))
    nodes.append((6, "KVGraphVAEDecode", [], {"vae": (3, 0), "latent": (5, 0)}, TITLES["KVGraphVAEDecode"]))
    nodes.append((7, "SaveImage", [("filename_prefix", f"KVGraph/{name}")], {"images": (6, 0)},
                  TITLES["SaveImage"]))
    # The sampler's column is the shortest: a frontend that centres the graph in the window (1.58's template browser)
    # then leaves the graph's bottom-right corner, where its minimap sits, free of the Save Image preview.
    reference_row = [10 + i for i in range(references)]
    columns = [
        [[1], [2], [3], reference_row if references else [20]],  # what the prompt reads (or the note on the files)
        [[4], [6]] + ([[20]] if references else []),  # the prompt, and the decode of the sampler's latent
        [[5], [7]],  # the sampler and the image
    ]
    return nodes, columns


def with_model_patch(workflow, patch, note=""):
    """`workflow` with `patch` (a node taking and giving the model) between the transformer loader and the sampler
    (placed above the prompt, on the way from the one to the other), and `note` added to the files note."""
    nodes, columns = workflow
    patch_id, source = patch[0], patch[3]["model"]
    out = []
    for node_id, node_type, widgets, links, title in nodes:
        if links.get("model") == source and node_id != patch_id:
            links = {**links, "model": (patch_id, 0)}
        if node_type == "MarkdownNote":
            widgets = [(name, value + note) for name, value in widgets]
        out.append((node_id, node_type, widgets, links, title))
        if node_id == 3:
            out.append(patch)
    loaders, middle, *rest = columns
    return out, [loaders, [[patch_id]] + middle, *rest]


def with_lora(workflow, lora_name=LORA_FILE, strength=1.0):
    """`workflow` with a KV-Graph Load LoRA between the transformer loader and the sampler, and the note saying where
    LoRAs go and which files are read."""
    lora = (8, "KVGraphLoadLoRA", [("lora_name", lora_name), ("strength", strength)], {"model": (1, 0)},
            TITLES["KVGraphLoadLoRA"])
    return with_model_patch(workflow, lora, LORA_NOTE)


STEP_CACHE_NOTE = (
    "\n\n## Step cache\n\n"
    "The cache skips the steps whose prediction the last computed step already gives (EasyCache's rule): a skipped "
    "step runs no transformer, the others replay the captured graph. Raise the threshold to skip more; the log and "
    "the KV-Graph panel say how many steps were skipped."
)
CACHE_SETTINGS = [("reuse_threshold", 0.2), ("start_percent", 0.15), ("end_percent", 0.95)]


def with_step_cache(workflow):
    """`workflow` with the KV-Graph Step Cache on the transformer its KV-Graph sampler runs."""
    cache = (9, "KVGraphStepCache", CACHE_SETTINGS, {"model": (1, 0)}, TITLES["KVGraphStepCache"])
    return with_model_patch(workflow, cache, STEP_CACHE_NOTE)


def with_easycache(workflow):
    """`workflow` (a core sampler on the MODEL) with core's EasyCache on that MODEL, at its default settings."""
    cache = (9, "EasyCache", [*CACHE_SETTINGS, ("verbose", False)], {"model": (1, 1)}, TITLES["EasyCache"])
    return with_model_patch(workflow, cache, STEP_CACHE_NOTE.replace("The cache", "Core's EasyCache"))


def on_the_model(workflow, sampler, columns):
    """`workflow` with its KV-Graph sampler (id 5) replaced by `sampler`'s nodes (which run on the core MODEL the
    transformer loader also outputs), the decode node reading the latent of the one with id 5, laid out in `columns`."""
    nodes, _ = workflow
    out = [n for n in nodes if n[0] != 5]
    out = [(i, t, w, {**lk, "latent": (5, 0)} if t == "KVGraphVAEDecode" else lk, title) for i, t, w, lk, title in out]
    decode = [n for n in out if n[1] in ("KVGraphVAEDecode", "SaveImage")]
    return [n for n in out if n not in decode] + sampler + decode, columns


def ksampler(seed=42, steps=40, cfg=1.0, sampler_name="euler", latent=(4, 2)):
    """Core's KSampler on the MODEL (scheduler simple: the model's shift at 1024x1024)."""
    return [(5, "KSampler", [("seed", seed), ("steps", steps), ("cfg", cfg), ("sampler_name", sampler_name),
                             ("scheduler", "simple"), ("denoise", 1.0)],
             {"model": (1, 1), "positive": (4, 0), "negative": (4, 1), "latent_image": latent}, TITLES["KSampler"])]


def custom_advanced(seed=42, steps=40, cfg=4.0):
    """SamplerCustomAdvanced with core's noise, sampler and CFG guider, over KV-Graph Sigmas (the KV-Graph Sampler's
    schedule for the latent's size)."""
    return [
        (30, "KVGraphSigmas", [("steps", steps), ("sigma_preset", "auto"), ("width", 1024), ("height", 1024),
                               ("denoise", 1.0)], {"model": (1, 1), "latent": (4, 2)}, TITLES["KVGraphSigmas"]),
        (31, "RandomNoise", [("noise_seed", seed)], {}, TITLES["RandomNoise"]),
        (32, "KSamplerSelect", [("sampler_name", "euler")], {}, TITLES["KSamplerSelect"]),
        (33, "CFGGuider", [("cfg", cfg)], {"model": (1, 1), "positive": (4, 0), "negative": (4, 1)},
         TITLES["CFGGuider"]),
        (5, "SamplerCustomAdvanced", [], {"noise": (31, 0), "guider": (33, 0), "sampler": (32, 0),
                                          "sigmas": (30, 0), "latent_image": (4, 2)},
         TITLES["SamplerCustomAdvanced"]),
    ]


def core_lora(workflow, lora_name=LORA_FILE, strength=1.0):
    """`workflow` (KSampler on the MODEL) with core's LoraLoaderModelOnly on the loader's MODEL, feeding KSampler."""
    lora = (8, "LoraLoaderModelOnly", [("lora_name", lora_name), ("strength_model", strength)], {"model": (1, 1)},
            TITLES["LoraLoaderModelOnly"])
    return with_model_patch(workflow, lora, CORE_LORA_NOTE)


def remove_background(workflow):
    """An edit of the cut-out reference image (image 2: its transparent background reads as black) asked to remove
    the background; the decode's alpha MASK joined to its IMAGE with core's Join Image with Alpha, saved as an RGBA
    PNG by KV-Graph Save Image."""
    nodes, _ = workflow
    out = []
    for node_id, node_type, widgets, links, title in nodes:
        if node_type == "LoadImage":
            widgets, title = [("image", REFERENCE_IMAGES[1])], "Image with a background"
        if node_type == "SaveImage":
            node_id, node_type, links, title = (7, "KVGraphSaveImage", {"images": (9, 0)},
                                                TITLES["KVGraphSaveImage"])
            out.append((9, "JoinImageWithAlpha", [], {"image": (6, 0), "alpha": (6, 1)},
                        TITLES["JoinImageWithAlpha"]))
        out.append((node_id, node_type, widgets, links, title))
    return out, [[[1], [2], [3], [20]], [[10], [4], [6, 9]], [[5], [7]]]


def inpaint(workflow, seed=42, steps=40):
    """Inpainting with KSampler: the cut-out reference image (image 2) encoded, its transparent background as the
    noise mask (Load Image's MASK is 1 where the image is transparent), so the object stays and the rest is
    painted anew. The image, its encoding and the mask stand above the prompt."""
    image = (11, "LoadImage", [("image", REFERENCE_IMAGES[1])], {}, "Image to inpaint")
    encode = (35, "KVGraphVAEEncode", [], {"vae": (3, 0), "image": (11, 0)}, TITLES["KVGraphVAEEncode"])
    mask = (36, "SetLatentNoiseMask", [], {"samples": (35, 0), "mask": (11, 1)}, TITLES["SetLatentNoiseMask"])
    nodes, columns = on_the_model(workflow, ksampler(seed, steps, latent=(36, 0)),
                                  [[[1], [2], [3], [20]], [[11], [35], [36], [4], [6]], [[5], [7]]])
    return [*nodes[:4], image, encode, mask, *nodes[4:]], columns


CONTROLNET_NOTE = (
    "\n\n## ControlNet\n\n"
    f"Put the Qwen-Image-2.1 Fun ControlNet Union (`{CONTROLNET_FILE}`, the file ComfyUI 0.38+ loads with Load Model "
    "Patch) in ComfyUI's `models/model_patches` folder. The control image is an edge, depth or pose map; for "
    "inpainting, the mask's white (Load Image: the transparent area) is painted anew (docs/controlnet.md)."
)


def with_controlnet(workflow, model_slot, sampler_id, image_links, widgets=()):
    """`workflow` with a KV-Graph Load ControlNet and a KV-Graph Apply ControlNet between the transformer loader's
    output `model_slot` (0: the transformer, for the KV-Graph Sampler; 1: the MODEL, for core's samplers) and the
    sampler `sampler_id`; `image_links` wire the apply node's images and mask."""
    nodes, columns = workflow
    load = (40, "KVGraphLoadControlNet", [("controlnet_name", CONTROLNET_FILE)], {},
            TITLES["KVGraphLoadControlNet"])
    apply = (41, "KVGraphApplyControlNet", [("strength", 1.0), ("start_percent", 0.0), ("end_percent", 1.0),
                                            *widgets],
             {"model": (1, model_slot), "controlnet": (40, 0), "vae": (3, 0), **image_links},
             TITLES["KVGraphApplyControlNet"])
    out = []
    for node_id, node_type, node_widgets, links, title in nodes:
        if node_id == sampler_id:
            links = {**links, "model": (41, 0)}
        if node_type == "MarkdownNote":
            node_widgets = [(name, value + CONTROLNET_NOTE) for name, value in node_widgets]
        out.append((node_id, node_type, node_widgets, links, title))
    return out[:4] + [load, apply] + out[4:], columns


def controlnet_control(workflow):
    """The KV-Graph Sampler steered by a control image (reference image 1 stands in for an edge or depth map)."""
    image = (10, "LoadImage", [("image", REFERENCE_IMAGES[0])], {}, "Control image")
    nodes, _ = with_controlnet(workflow, 0, 5, {"image": (10, 0)})
    return ([*nodes[:4], image, *nodes[4:]],
            [[[1], [2], [3], [40], [20]], [[10], [41], [4]], [[5], [6], [7]]])


def controlnet_inpaint(workflow, seed=42, steps=40):
    """KSampler on the MODEL with the ControlNet's inpainting: the cut-out image 2 as the inpaint image, its
    transparent background (Load Image's MASK) as the area to paint anew."""
    image = (11, "LoadImage", [("image", REFERENCE_IMAGES[1])], {}, "Image to inpaint")
    nodes, columns = on_the_model(workflow, ksampler(seed, steps), [])
    nodes, _ = with_controlnet((nodes, columns), 1, 5, {"inpaint_image": (11, 0), "mask": (11, 1)})
    return ([*nodes[:4], image, *nodes[4:]],
            [[[1], [2], [3], [40], [20]], [[11], [41], [4]], [[5], [6], [7]]])
SLG_NOTE = (
    "\n\n## Skip layer guidance\n\n"
    "Core's **SkipLayerGuidanceDiT** adds a pass with the listed single-stream blocks skipped and guides away from it "
    "(`scale`) between `start_percent` and `end_percent` of the schedule. Qwen-Image-2.1 has single-stream blocks "
    "0 to 31 (`double_layers` stays empty). That pass replays a captured graph of its own. Layer 1 here also exists "
    "in the small test model; pick the layers you want."
)


def skip_layer_guidance(workflow):
    """`workflow` (KSampler on the MODEL) with core's SkipLayerGuidanceDiT between the MODEL and the sampler,
    placed above the prompt, and the note saying what it does."""
    slg = (40, "SkipLayerGuidanceDiT", [("double_layers", ""), ("single_layers", "1"), ("scale", 3.0),
                                        ("start_percent", 0.01), ("end_percent", 0.15), ("rescaling_scale", 0.0)],
           {"model": (1, 1)}, TITLES["SkipLayerGuidanceDiT"])
    return with_model_patch(workflow, slg, SLG_NOTE)


def five_references(workflow):
    """Five reference images need the room: they stand in rows of two at the left (the note beside the last), the
    loaders and the prompt they feed next, then the sampler, the decode and the saved image."""
    nodes, _ = workflow
    return nodes, [[[10, 11], [12, 13], [14, 20]], [[1], [2], [3], [4]], [[5], [6], [7]]]


WORKFLOWS = {
    "qwen_image_2.1_text_to_image": graph(
        "text_to_image", "A capybara wearing a wizard hat, reading a spell book by candlelight, oil painting."),
    # The Turbo checkpoint: the sampler's auto preset runs its fixed 8-step grid (cfg 1, as ComfyUI's template).
    "qwen_image_2.1_turbo_8_steps": graph(
        "turbo", "A red vintage bicycle leaning against a sunlit brick wall, 35mm photo.", steps=8,
        transformer=TURBO_TRANSFORMER_FILE, transformer_title="Load Turbo transformer (INT8 ConvRot)",
        sampler_title="KV-Graph sampler (Turbo, 8 steps)"),
    "qwen_image_2.1_edit_one_reference": graph(
        "edit_one_reference", "Make the sky in image 1 a deep purple sunset and add a small sailing boat.",
        references=1),
    "qwen_image_2.1_edit_two_references": graph(
        "edit_two_references", "Place the object from image 2 on the table in image 1, matching its lighting.",
        references=2),
    "qwen_image_2.1_cfg_negative_prompt": graph(
        "cfg_negative", "A cozy reading nook with a large window, soft morning light, watercolor.",
        negative="blurry, low quality, distorted, text, watermark", cfg=4.0, sampler_title="KV-Graph sampler (true CFG)"),
    "qwen_image_2.1_lora": with_lora(graph(
        "lora", "A lighthouse on a rocky coast at dusk, dramatic clouds, in the style the LoRA was trained on.")),
    # Core sampling on the MODEL the transformer loader also outputs: the same captured graphs replay. Laid out as the
    # text-to-image example.
    "qwen_image_2.1_ksampler": on_the_model(graph(
        "ksampler", "A capybara wearing a wizard hat, reading a spell book by candlelight, oil painting."),
        ksampler(), [[[1], [2], [3], [20]], [[4], [6]], [[5], [7]]]),
    # The loaders and the note; the image, the prompt and the two settings nodes; the schedule and the guider, the
    # sampler and the decode, the image saved (the short right column leaves the minimap's corner free).
    "qwen_image_2.1_edit_custom_sampler": on_the_model(graph(
        "custom_sampler", "Make the sky in image 1 a deep purple sunset and add a small sailing boat.",
        negative="blurry, low quality, distorted", references=1), custom_advanced(),
        [[[1], [2], [3], [20]], [[10], [4], [31], [32]], [[30, 33], [5, 6], [7]]]),
    "qwen_image_2.1_skip_layer_guidance": skip_layer_guidance(on_the_model(graph(
        "skip_layer_guidance", "A glass teapot with blooming tea on a linen tablecloth, macro photo, sharp detail."),
        ksampler(), [[[1], [2], [3], [20]], [[4], [6]], [[5], [7]]])),
    "qwen_image_2.1_inpaint": inpaint(graph(
        "inpaint", "A red teapot on a wooden kitchen counter beside a window, morning light, photo.")),
    "qwen_image_2.1_controlnet": controlnet_control(graph(
        "controlnet", "A glass greenhouse full of tropical plants, following the shapes of the control image.")),
    "qwen_image_2.1_controlnet_inpaint": controlnet_inpaint(graph(
        "controlnet_inpaint", "A red teapot on a wooden kitchen counter beside a window, morning light, photo.")),
    # Core's LoRA loader on the MODEL, under KSampler.
    "qwen_image_2.1_core_lora": core_lora(on_the_model(graph(
        "core_lora", "A lighthouse on a rocky coast at dusk, dramatic clouds, in the style the LoRA was trained on."),
        ksampler(), [[[1], [2], [3], [20]], [[4], [6]], [[5], [7]]])),
    # The VAE's alpha channel kept: an edit asked to remove the background, saved as a transparent PNG.
    "qwen_image_2.1_remove_background": remove_background(graph(
        "remove_background", "Remove the background of image 1, keep the red teapot.", references=1)),
    # A ComfyUI-GGUF transformer, dequantized at load onto the int8 path; laid out as the text-to-image example.
    "qwen_image_2.1_gguf": graph(
        "gguf", "A capybara wearing a wizard hat, reading a spell book by candlelight, oil painting.",
        transformer=GGUF_FILE, transformer_title="Load transformer (GGUF)"),
    "qwen_image_2.1_edit_five_references": five_references(graph(
        "five_references", "Put the objects from images 2, 3, 4 and 5 on the table in image 1, side by side, "
        "matching its lighting.", references=5)),
    "qwen_image_2.1_step_cache": with_step_cache(graph(
        "step_cache", "A capybara wearing a wizard hat, reading a spell book by candlelight, oil painting.")),
    "qwen_image_2.1_easycache": with_easycache(on_the_model(graph(
        "easycache", "A capybara wearing a wizard hat, reading a spell book by candlelight, oil painting."),
        ksampler(), [[[1], [2], [3], [20]], [[4], [6]], [[5], [7]]])),
}


# Each example's template card: ComfyUI's template browser titles a pack's example by its file name, so the UI-format
# file is named by the card's title (workflow_cards.py says why); its API-format twin keeps the key as its name.
CARDS = {
    "qwen_image_2.1_text_to_image": Card(
        "Qwen-Image-2.1 text to image", "Text to image", "A prompt becomes a 1024x1024 picture"),
    "qwen_image_2.1_turbo_8_steps": Card(
        "Qwen-Image-2.1 Turbo, 8 steps", "Turbo, 8 steps", "The Turbo checkpoint on its fixed 8-step grid"),
    "qwen_image_2.1_edit_one_reference": Card(
        "Qwen-Image-2.1 edit an image", "Edit an image", "A prompt says what to change in image 1"),
    "qwen_image_2.1_edit_two_references": Card(
        "Qwen-Image-2.1 combine images", "Combine images", "Put the object of image 2 into image 1"),
    "qwen_image_2.1_cfg_negative_prompt": Card(
        "Qwen-Image-2.1 negative prompt", "Negative prompt", "True CFG steers away from what you list"),
    "qwen_image_2.1_lora": Card(
        "Qwen-Image-2.1 with a LoRA", "With a LoRA", "A LoRA from models/loras, merged once"),
    "qwen_image_2.1_ksampler": Card(
        "Qwen-Image-2.1 KSampler", "KSampler", "Core's KSampler on the KV-Graph MODEL"),
    "qwen_image_2.1_edit_custom_sampler": Card(
        "Qwen-Image-2.1 custom sampler", "Custom sampler", "SamplerCustomAdvanced with KV-Graph Sigmas"),
    "qwen_image_2.1_skip_layer_guidance": Card(
        "Qwen-Image-2.1 skip layers", "Skip layers", "Core's SkipLayerGuidanceDiT with KSampler"),
    "qwen_image_2.1_inpaint": Card(
        "Qwen-Image-2.1 inpainting", "Inpainting", "Paint anew where the image is transparent"),
    "qwen_image_2.1_controlnet": Card(
        "Qwen-Image-2.1 ControlNet", "ControlNet", "A control image steers the KV-Graph sampler"),
    "qwen_image_2.1_controlnet_inpaint": Card(
        "Qwen-Image-2.1 CN inpainting", "CN inpainting", "The Fun ControlNet paints the masked area"),
    "qwen_image_2.1_core_lora": Card(
        "Qwen-Image-2.1 core LoRA", "Core LoRA", "Core's Load LoRA on the KV-Graph MODEL"),
    "qwen_image_2.1_remove_background": Card(
        "Qwen-Image-2.1 transparent PNG", "No background", "A transparent PNG from the VAE's alpha"),
    "qwen_image_2.1_gguf": Card(
        "Qwen-Image-2.1 GGUF file", "GGUF file", "A ComfyUI-GGUF file, run at the int8 rate"),
    "qwen_image_2.1_edit_five_references": Card(
        "Qwen-Image-2.1 five references", "Five references", "Put the objects of images 2 to 5 into image 1"),
    "qwen_image_2.1_step_cache": Card(
        "Qwen-Image-2.1 step cache", "Step cache", "Skip the steps the last one predicts"),
    "qwen_image_2.1_easycache": Card(
        "Qwen-Image-2.1 EasyCache", "EasyCache", "Core's EasyCache and KSampler on the MODEL"),
}


def card(name: str) -> Card:
    if name not in CARDS:
        raise KeyError(f"example {name!r} has no template card: give it a title, headline and description in CARDS "
                       "(tests/e2e/make_workflows.py)")
    return CARDS[name]


def ui_path(name: str) -> Path:
    """The UI-format file of example `name` (its template card's title); its thumbnail is beside it as .jpg."""
    return OUT / f"{card(name).title}.json"


def api_path(name: str) -> Path:
    return OUT / "api" / f"{name}.json"


def note_height(text: str, width: int) -> int:
    """The height a MarkdownNote `width` wide needs to show `text` without scrolling, as the frontend renders its
    markdown (measured in 1.35 to 1.58: 10 px text in 12 px lines, 15 px headings 19 px high, 10 px between blocks,
    about 6 px a character in code spans, list items indented 25 px, 22 px of the node around the text), rounded
    up to whole lines per paragraph and list item."""
    text_width = width - 20
    blocks = []
    for block in text.split("\n\n"):
        if block.startswith("## "):
            blocks.append(19)
        elif block.startswith("- "):
            per_line = (text_width - 25) // 6.2
            blocks.append(sum(12 * math.ceil(len(item) / per_line) for item in block.split("\n")))
        else:
            blocks.append(12 * math.ceil(len(block) / (text_width // 6.2)))
    return sum(blocks) + 10 * (len(blocks) - 1) + 22 + 10  # and 10 to spare


def ui_workflow(workflow) -> dict:
    nodes, columns = workflow
    notes = {node_id: dict(widgets)["text"] for node_id, node_type, widgets, *_ in nodes if node_type == "MarkdownNote"}
    encode = {node_id: len(sockets_of(node_type, links)) for node_id, node_type, _, links, _ in nodes
              if node_type == "KVGraphTextEncode"}

    def height_for(node_id, width):
        if node_id in notes:
            return note_height(notes[node_id], width)
        return workflow_layout.encode_height(encode[node_id]) if node_id in encode else 0

    placed = workflow_layout.place(columns, {node_id: node_type for node_id, node_type, *_ in nodes}, height_for)
    links, ui_nodes, link_id = [], [], 0
    outgoing = {}
    for node_id, node_type, _, node_links, _ in nodes:
        sockets = sockets_of(node_type, node_links)
        for input_name, (source, slot) in node_links.items():
            link_id += 1
            input_slot = [n for n, _ in sockets].index(input_name)
            source_type, source_links = next((t, lk) for i, t, _, lk, _ in nodes if i == source)
            link_type = outputs_of(source_type, source_links, nodes)[slot][1]
            links.append([link_id, source, slot, node_id, input_slot, link_type])
            outgoing.setdefault((source, slot), []).append(link_id)
    order = {node_id: i for i, (node_id, *_) in
             enumerate(sorted(nodes, key=lambda n: n[0] not in (1, 2, 3, 10, 11, 20)))}
    for node_id, node_type, widgets, node_links, title in nodes:
        inputs = []
        for slot, (input_name, input_type) in enumerate(sockets_of(node_type, node_links)):
            link = next((lk[0] for lk in links if lk[3] == node_id and lk[4] == slot), None)
            inputs.append({"name": input_name, "type": input_type, "link": link})
        outputs = [{"name": out_name, "type": out_type, "links": outgoing.get((node_id, slot), []),
                    "slot_index": slot} for slot, (out_name, out_type) in enumerate(
                        outputs_of(node_type, node_links, nodes))]
        values = []
        for widget_name, value in widgets:
            values.append(value)
            if widget_name in SEED_WIDGETS:
                values.append("fixed")
            if node_type == "LoadImage" and widget_name == "image":
                values.append("image")  # the upload button's widget value
        pos, size = placed[node_id]
        ui_nodes.append({
            "id": node_id, "type": node_type, "pos": list(pos), "size": list(size),
            "flags": {}, "order": order[node_id], "mode": 0, "inputs": inputs, "outputs": outputs,
            "title": title,
            "properties": {} if node_type in UI_ONLY else {"Node name for S&R": node_type},
            "widgets_values": values,
        })
    return {"last_node_id": max(n[0] for n in nodes), "last_link_id": link_id, "nodes": ui_nodes, "links": links,
            "groups": [], "config": {}, "extra": {"ds": workflow_layout.view(placed)}, "version": 0.4}


def api_workflow(workflow) -> dict:
    nodes, _ = workflow
    api = {}
    for node_id, node_type, widgets, node_links, title in nodes:
        if node_type in UI_ONLY:
            continue
        inputs = dict(widgets)
        inputs.update({name: [str(source), slot] for name, (source, slot) in node_links.items()})
        api[str(node_id)] = {"class_type": node_type, "inputs": inputs, "_meta": {"title": title}}
    return api


def draw_reference_images():
    """The edit examples' two reference images, drawn with flat shapes (a few KB each, the same on every run):
    image 1 a sea view from a table under a blue sky (the edits repaint its sky, add a boat, put something on
    the table), image 2 a red teapot on a transparent background (RGBA, as an image cut out of its photo is)."""
    from PIL import Image, ImageDraw

    scene = Image.new("RGB", (512, 384), (120, 180, 235))
    draw = ImageDraw.Draw(scene)
    for y in range(0, 200, 8):  # the sky, lighter towards the horizon, in bands
        shade = y * 60 // 200
        draw.rectangle([0, y, 512, y + 8], fill=(110 + shade, 170 + shade // 2, 235))
    draw.ellipse([380, 40, 440, 100], fill=(255, 236, 150))  # the sun
    draw.rectangle([0, 200, 512, 290], fill=(40, 100, 160))  # the sea
    draw.polygon([(0, 200), (90, 150), (180, 200)], fill=(90, 120, 90))  # a headland
    draw.rectangle([0, 290, 512, 384], fill=(150, 100, 60))  # the table top
    draw.line([(0, 290), (512, 290)], fill=(110, 70, 40), width=4)
    for x in (0, 128, 256, 384):
        draw.line([(x + 40, 300), (x + 100, 380)], fill=(135, 90, 55), width=2)  # the wood's grain

    teapot = Image.new("RGBA", (256, 256), (0, 0, 0, 0))
    draw = ImageDraw.Draw(teapot)
    red, dark = (200, 40, 40, 255), (140, 25, 25, 255)
    draw.ellipse([48, 80, 208, 220], fill=red)  # the body
    draw.polygon([(200, 130), (246, 96), (250, 108), (206, 160)], fill=red)  # the spout
    draw.arc([26, 104, 96, 190], start=90, end=270, fill=dark, width=10)  # the handle
    draw.rectangle([98, 62, 158, 84], fill=dark)  # the lid
    draw.ellipse([116, 44, 140, 68], fill=dark)  # the knob
    draw.ellipse([90, 110, 130, 140], fill=(235, 120, 120, 255))  # a highlight
    return dict(zip(REFERENCE_IMAGES, (scene, teapot, *draw_more_objects())))


def draw_more_objects():
    """The five-reference example's images 3 to 5: a potted plant, a mug and a desk lamp, each cut out (RGBA)."""
    from PIL import Image, ImageDraw

    plant = Image.new("RGBA", (256, 256), (0, 0, 0, 0))
    draw = ImageDraw.Draw(plant)
    for box in ([70, 40, 150, 130], [110, 30, 190, 120], [90, 80, 170, 160]):  # the leaves
        draw.ellipse(box, fill=(60, 150, 70, 255))
    draw.polygon([(80, 150), (176, 150), (160, 236), (96, 236)], fill=(170, 90, 50, 255))  # the pot

    mug = Image.new("RGBA", (256, 256), (0, 0, 0, 0))
    draw = ImageDraw.Draw(mug)
    draw.rectangle([60, 70, 170, 210], fill=(50, 90, 190, 255))  # the body
    draw.arc([150, 100, 220, 180], start=270, end=90, fill=(50, 90, 190, 255), width=14)  # the handle
    draw.ellipse([60, 58, 170, 82], fill=(30, 60, 140, 255))  # the rim

    lamp = Image.new("RGBA", (256, 256), (0, 0, 0, 0))
    draw = ImageDraw.Draw(lamp)
    draw.polygon([(70, 40), (160, 40), (190, 110), (40, 110)], fill=(235, 200, 60, 255))  # the shade
    draw.rectangle([112, 110, 124, 210], fill=(90, 90, 90, 255))  # the stem
    draw.rectangle([72, 210, 164, 226], fill=(70, 70, 70, 255))  # the base
    return plant, mug, lamp


def thumbnail(name: str):
    """The template card's thumbnail of example `name` (a PIL image), drawn from its graph and the shipped inputs."""
    return workflow_cards.draw_thumbnail(card(name), WORKFLOWS[name][0], INPUTS)


def main() -> None:
    (OUT / "api").mkdir(parents=True, exist_ok=True)
    INPUTS.mkdir(exist_ok=True)
    for name, image in draw_reference_images().items():
        image.save(INPUTS / name, optimize=True)
        print(f"wrote inputs/{name}")
    for name, workflow in WORKFLOWS.items():
        ui_path(name).write_text(json.dumps(ui_workflow(workflow), indent=1) + "\n")
        workflow_cards.save_thumbnail(thumbnail(name), ui_path(name).with_suffix(".jpg"))
        api_path(name).write_text(json.dumps(api_workflow(workflow), indent=1) + "\n")
        print(f"wrote {ui_path(name).name} (and its .jpg), api/{api_path(name).name}")


if __name__ == "__main__":
    main()
