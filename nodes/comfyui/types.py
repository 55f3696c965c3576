"""The pack's socket types and the constants every node shares."""

from __future__ import annotations

import torch
from comfy_api.latest import io

CATEGORY = "KV-Graph"
LOADERS = f"{CATEGORY}/loaders"
CONDITIONING = f"{CATEGORY}/conditioning"
SAMPLING = f"{CATEGORY}/sampling"
LATENT = f"{CATEGORY}/latent"
CACHE = f"{CATEGORY}/cache"
IMAGE = f"{CATEGORY}/image"

# Handles to models loaded by this pack. They are not core MODEL/CLIP/VAE objects (those are ComfyUI's own model
# classes), so they get their own socket types and cannot be wired into core nodes by mistake.
Transformer = io.Custom("KVGRAPH_TRANSFORMER")
TextEncoder = io.Custom("KVGRAPH_TEXT_ENCODER")
Vae = io.Custom("KVGRAPH_VAE")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_TOOLTIP = ("Weight precision. bf16 is what the model was trained in and halves memory against fp32; fp16 can "
                 "overflow in some layers; fp32 doubles memory and time.")
