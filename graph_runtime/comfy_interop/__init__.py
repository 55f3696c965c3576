"""Pure conversions between ComfyUI's data conventions and the runtime's. No ComfyUI import here: these modules
speak ComfyUI's data formats (as core ComfyUI's Qwen-Image-2.1 support uses them) without importing ComfyUI.

- latents: LATENT dicts, raw <-> normalized latent space, empty latents;
- conditioning: CONDITIONING <-> PromptEmbeds and reference latents;
- pixels: IMAGE tensors <-> VAE pixels, cropping, PIL;
- previews: the latent -> RGB projection for live previews;
- files: a model file's identity (the loaded-model cache key);
- saved_images: IMAGE batches saved as core's SaveImage saves them, through the threaded PNG writer.

Every name is re-exported here, so `from graph_runtime.comfy_interop import X` works for all of them.
"""

# The raw VAE calls (no latent normalization), under names that say which side of the conversion they are on.
from ..encoding.images import vae_decode as decode_raw_latents, vae_encode as encode_pixels_raw
from .conditioning import (
    ParsedConditioning, conditioning_to, conditioning_to_prompt, prompt_to_conditioning,
)
from .files import file_identity
from .latents import (
    LATENT_CHANNELS, VAE_SCALE, LatentStats, empty_latent, latent_noise_mask, latent_samples, latent_stats,
    normalized_to_raw, raw_to_normalized,
)
from .pixels import (
    check_image, comfy_image_to_pil, comfy_image_to_vae_pixels, crop_to_multiple, to_pil, vae_pixels_to_comfy_image,
    vae_pixels_to_comfy_mask,
)
from .previews import PreviewProjection, fit_preview_projection, gray_projection, preview_image
from .saved_images import (
    BATCH_NUM, next_free_counter, png_text, prefix_text, save_batch, saved_pixels,
)

__all__ = [
    "LATENT_CHANNELS", "VAE_SCALE", "LatentStats", "ParsedConditioning", "PreviewProjection", "check_image", "comfy_image_to_pil",
    "comfy_image_to_vae_pixels", "conditioning_to", "conditioning_to_prompt", "crop_to_multiple", "decode_raw_latents", "empty_latent",
    "encode_pixels_raw", "file_identity", "fit_preview_projection", "gray_projection", "latent_noise_mask", "latent_samples",
    "latent_stats", "normalized_to_raw", "png_text", "preview_image", "prompt_to_conditioning", "raw_to_normalized",
    "save_batch", "saved_pixels", "to_pil", "vae_pixels_to_comfy_image", "vae_pixels_to_comfy_mask", "BATCH_NUM",
    "next_free_counter", "prefix_text",
]
