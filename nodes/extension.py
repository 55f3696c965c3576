"""The pack's node list and the V3 extension ComfyUI asks for it (`comfy_entrypoint`)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .cache import CACHE_NODES
from .controlnet import CONTROLNET_NODES
from .encode import KVGraphTextEncode
from .loaders import LOADER_NODES
from .lora import LORA_NODES
from .prefix_cache import PREFIX_CACHE_NODES
from .sampler import KVGraphSampler
from .save import SAVE_NODES
from .sigmas import KVGraphSigmas
from .step_cache import STEP_CACHE_NODES
from .vae import VAE_NODES

NODE_LIST: list[type[io.ComfyNode]] = [*LOADER_NODES, *LORA_NODES, KVGraphTextEncode, KVGraphSampler, KVGraphSigmas,
                                       *STEP_CACHE_NODES, *PREFIX_CACHE_NODES, *VAE_NODES, *SAVE_NODES, *CACHE_NODES,
                                       *CONTROLNET_NODES]


class KVGraphExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODE_LIST)


async def comfy_entrypoint() -> KVGraphExtension:
    return KVGraphExtension()
