"""Memory budgeting: what a request needs on its device and on the host, checked before anything is allocated.

- `sizes`: the byte math per model part (weights, prefix K/V, graph buffers and pool, prefill, VAE decode).
- `free` (graph_runtime/free_memory.py, below the decode package, which reads it before a capture): how much
  memory a new allocation can get, on the host and on a CUDA device.
- `plan`: where each part lives on a given card (resident blocks, prefix placement, text encoder, VAE decode) and
  what a step costs; `budget.check_sampling_request` plans every request and refuses only when no plan fits.
- `budget`: refusing what cannot fit and saying what would; `check_sampling_request` is the one check of a
  sampling request, which the command line (`check_runtime_request`) and the ComfyUI sampler node
  (nodes/comfyui/memory.py, which adds what ComfyUI could unload) both go through.

Tests pin the host's memory by patching `memory.free.host_available_bytes`: every reader here calls it through
that module.
"""

from .. import free_memory as free  # noqa: F401 - what a new allocation can get (graph_runtime/free_memory.py)
from . import budget, plan, sizes  # noqa: F401 - the modules, for callers that reach one by name
from .budget import (  # noqa: F401
    Available, MemoryBudgetError, RequestPlan, alternatives, bytes_on, check, check_decoded_on_host,
    check_runtime_request, check_sampling_request, largest_fitting_batch, largest_fitting_size, plan_request,
    request_shape,
)
from .plan import MemoryPlan, ModelSizes, TextEncoderSize, plan_memory  # noqa: F401
from .sizes import (  # noqa: F401 - the byte math, as `memory.<name>`
    GiB, MiB, STEP_HIDDEN_TENSORS, STEP_MLP_TENSORS, VAE_DTYPE_TENSORS, VAE_FP32_TENSORS, VAE_TILE_PIXELS,
    VAE_TILE_CACHE_FACTOR, VAE_ENCODE_BYTES_PER_PIXEL, LATENT_COPIES, MARGIN_BYTES, MARGIN_FRACTION, gib,
    module_bytes, compute_dtype, TransformerDims, VaeDims, kv_bytes_per_token, step_activation_bytes,
    entry_buffer_bytes, placement_bytes, recompute_step_bytes, prefix_graph_bytes, prefill_bytes, eager_step_bytes, vae_decode_bytes, latent_bytes,
    IMAGE_BYTES_PER_PIXEL, MASK_BYTES_PER_PIXEL, decoded_images_bytes, vae_encode_bytes, GenerationShape, MemoryBudget,
    estimate,
    fitting_estimate, available_bytes, eager_free_bytes, graph_bytes_held, graph_pool_bytes,
)
from ..free_memory import device_free_bytes, host_available_bytes, host_total_bytes  # noqa: F401
