"""Refusing a request that cannot fit, before anything is allocated, and saying what would fit.

`check_sampling_request` is the one check of a sampling request. `RequestPlan` holds what its budget is computed
from (sizes.py), so every alternative setting is priced the same way; `MemoryBudgetError` names the settings that
change the budget, each with what it would need, those that fit first. The ComfyUI sampler node adds what ComfyUI
can unload to what is available (nodes/comfyui/memory.py); the runtime alone (`check_runtime_request`, used by the
CLI) has only what the device has free and what its own models and graphs hold."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..errors import KVGraphError
from .. import free_memory
from ..decode import PLACEMENTS, TOKENS_PER_SLOT
from ..decode.prefix_store import AUTO, GPU
from . import sizes as memory
from .sizes import (
    GenerationShape, MemoryBudget, TransformerDims, VaeDims, available_bytes, estimate, fitting_estimate, gib,
    graph_bytes_held, module_bytes,
)

logger = logging.getLogger("kvgraph")


# -- the refusal ---------------------------------------------------------------------------------------------------


class MemoryBudgetError(KVGraphError):
    """A request that cannot fit in the device memory available, refused before anything is allocated."""

    def __init__(self, budget: MemoryBudget, available: int, device, where: str, options: list[str]):
        self.budget, self.available, self.where, self.options = budget, available, where, options
        message = (f"KV-Graph: this request needs {budget.describe()} on {device}, and {gib(available)} is available "
                   f"there ({where}). Nothing was allocated.")
        if options:
            message += " Change one of: " + "; ".join(options) + "."
        else:
            message += " No setting of this request fits: free memory on the device (close other programs)."
        super().__init__(message)


def alternatives(dims: TransformerDims, shape: GenerationShape, weights: dict[str, int], vae: VaeDims | None,
                 available: int) -> list[str]:
    """Settings that would change the budget, each with what it would need, those that fit first."""
    options: list[tuple[bool, str]] = []

    def option(text: str, new_shape=shape, new_weights=weights, new_dims=dims) -> None:
        need = fitting_estimate(new_dims, new_shape, new_weights, vae, available).total
        fits = need <= available
        options.append((fits, f"{text}: needs {gib(need)}" + (" (fits)" if fits else "")))

    for name, value in weights.items():
        if name.startswith("text encoder"):
            option("text_encoder_placement 'gpu while encoding, then offload' or 'cpu' (the text encoder leaves the "
                   "GPU before sampling)", new_weights={k: v for k, v in weights.items() if k != name})
    if "transformer" in weights and not dims.int8:
        option("the int8 ConvRot transformer in weights mode int8 (half the weight bytes)",
               new_weights={**weights, "transformer": dims.int8_weight_bytes(weights["transformer"])},
               new_dims=dataclasses.replace(dims, int8=True))
    for placement, why in PLACEMENT_OPTIONS.items():
        if placement != shape.prefix_placement:
            option(f"prefix_placement {placement} ({why})", dataclasses.replace(shape, prefix_placement=placement))
    if shape.decode_mode != "eager":
        option("decode_mode eager (no graph buffers or pool; each step ~20% slower)",
               dataclasses.replace(shape, decode_mode="eager"))
    if shape.branches > 1:
        option("cfg 1 (no negative prompt: one branch instead of two)",
               dataclasses.replace(shape, prefix_tokens=shape.prefix_tokens[:1]))
    if shape.batch > 1:
        most = largest_fitting_batch(dims, shape, weights, vae, available)
        option(f"batch {most}" if most > 1 else "batch 1", dataclasses.replace(shape, batch=most))
    size = largest_fitting_size(dims, shape, weights, vae, available)
    if size is not None:
        option(f"width x height at most {size[0]}x{size[1]} (same aspect)",
               dataclasses.replace(shape, width=size[0], height=size[1]))
    return [text for fits, text in sorted(options, key=lambda o: not o[0])]


# What each prefix placement trades, as a refusal offers it.
PLACEMENT_OPTIONS = {
    "int8": "the prefix K/V int8 on the GPU, about half the bytes, within the INT8 bound",
    "host": "the prefix K/V in pinned host memory, copied per block behind the compute",
    "recompute": "no prefix cache: every step runs the whole sequence eagerly, several times slower",
}


def choose_placement(dims: TransformerDims, shape: GenerationShape, weights: dict[str, int], vae: VaeDims | None,
                     available: int, host_free: int | None = None) -> str:
    """What `auto` resolves to: the first of gpu, int8, host, recompute whose budget fits `available` (and, for
    host, whose pinned rows fit `host_free` when known); gpu when none does (the refusal then names them all)."""
    for placement in PLACEMENTS:
        budget = fitting_estimate(dims, dataclasses.replace(shape, prefix_placement=placement), weights, vae,
                                  available)
        if budget.total <= available and (host_free is None or budget.host_total <= host_free):
            return placement
    return PLACEMENTS[0]


def largest_fitting_batch(dims, shape, weights, vae, available: int) -> int:
    """The largest smaller batch that fits (the budget grows with the batch), or 1 when none does."""
    low, high = 1, shape.batch - 1
    while low < high:
        mid = (low + high + 1) // 2
        if fitting_estimate(dims, dataclasses.replace(shape, batch=mid), weights, vae, available).total <= available:
            low = mid
        else:
            high = mid - 1
    return low


def largest_fitting_size(dims, shape, weights, vae, available: int) -> tuple[int, int] | None:
    """The largest output size of the same aspect ratio (multiples of 16 px) that fits, if any smaller one does."""
    long_side = max(shape.width, shape.height)
    for side in range(long_side - 16, 15, -16):
        width = max(16, round(shape.width * side / long_side / 16) * 16)
        height = max(16, round(shape.height * side / long_side / 16) * 16)
        trial = dataclasses.replace(shape, width=width, height=height)
        if fitting_estimate(dims, trial, weights, vae, available).total <= available:
            return width, height
    return None


@dataclass(frozen=True)
class Available:
    """What a request may use on its device: the memory free now plus what would be freed for it, named (e.g.
    "of its models": weights already on the device that the request reuses)."""

    free: int
    freeable: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        return self.free + sum(n for _, n in self.freeable)

    def describe(self) -> str:
        """The `where` of a refusal: "<free> free + <n> <label> + ..."."""
        return " + ".join([f"{gib(self.free)} free", *(f"{gib(n)} {label}" for label, n in self.freeable)])


def check(budget: MemoryBudget, available: int, device, where: str, options) -> None:
    """Raise MemoryBudgetError when `budget` (margin included) exceeds `available`; `options()` lists settings."""
    if budget.total > available:
        raise MemoryBudgetError(budget, available, device, where, options())


# -- one sampling request -------------------------------------------------------------------------------------------


def request_shape(request, graphs: bool = True) -> GenerationShape:
    """The memory-relevant shape of a `SamplingRequest` (prefix tokens per branch as its token layouts count them);
    `graphs=False` where the decode cannot replay graphs (off CUDA), which then runs eagerly."""
    branches = [request.positive] + ([request.negative] if request.do_cfg else [])
    # Each image slot of the encoder sequence becomes TOKENS_PER_SLOT latent tokens of its reference (layout.py).
    prefixes = tuple(int(e.image_mask.shape[-1] + (TOKENS_PER_SLOT - 1) * e.num_image_slots) for e in branches)
    mode = request.decode_mode if graphs else "eager"
    return GenerationShape(width=request.latent_width * 16, height=request.latent_height * 16,
                           batch=request.batch_size, prefix_tokens=prefixes, decode_mode=mode,
                           prefix_placement=request.placement())


@dataclass
class RequestPlan:
    """Everything a request's budget is computed from, so alternatives can be priced the same way."""

    dims: TransformerDims
    shape: GenerationShape
    weights: dict[str, int]
    vae: VaeDims | None

    @classmethod
    def for_request(cls, transformer, request, vae: VaeDims | None, graphs: bool,
                    other_weights: dict[str, int] | None = None) -> "RequestPlan":
        weights = {"transformer": module_bytes(transformer)}
        if vae is not None:
            weights["VAE"] = vae.weight_bytes
        weights.update(other_weights or {})
        return cls(TransformerDims.of(transformer), request_shape(request, graphs), weights, vae)

    def budget(self, available: int | None = None) -> MemoryBudget:
        if available is None:
            return estimate(self.dims, self.shape, self.weights, self.vae)
        return fitting_estimate(self.dims, self.shape, self.weights, self.vae, available)

    def check_available(self, available: Available, device, more_options=lambda: []) -> MemoryBudget:
        """`check` against `available`'s total, a refusal saying what it is made of."""
        return self.check(available.total, device, available.describe(), more_options)

    def check(self, available: int, device, where: str, more_options=lambda: []) -> MemoryBudget:
        """The budget, or MemoryBudgetError naming the settings to change (then `more_options()`, e.g. what the
        caller could release) when it exceeds `available`."""
        budget = self.budget(available)
        check(budget, available, device, where,
              lambda: alternatives(self.dims, self.shape, self.weights, self.vae, available) + more_options())
        return budget


def check_sampling_request(transformer, request, available: Available | None, device, vae: VaeDims | None = None,
                           other_weights: dict[str, int] | None = None, decoded_bytes_per_pixel: int = 0,
                           more_options=lambda: [], *, host_free: int | None = None, vae_assumed: bool = False,
                           kept_text_encoder: tuple[str, int] | None = None) -> MemoryBudget:
    """The one memory check of a sampling request, before anything is allocated; the command line
    (`check_runtime_request`) and the ComfyUI sampler node (nodes/comfyui/memory.py) differ only in what they count
    as `available`, in `more_options` and in what they ask to be noted.

    `transformer` and `vae` (its dims; None: not counted) are priced with `other_weights` (e.g. a text encoder kept
    on the device); `decoded_bytes_per_pixel`: the decoded images kept on `device` until the request ends (the CPU's
    images), 0 where they leave it. Returns the budget (unchecked where `available` is None: nothing reports free
    memory), or raises MemoryBudgetError naming the settings that would fit, then `more_options()`.

    Noted on a budget that fits (and logged with it): ComfyUI's float32 IMAGE of the whole batch beyond `host_free`
    (the host's available memory; None: not checked), a VAE sized as the standard one (`vae_assumed`: none loaded
    yet), and a text encoder kept on the device that does not fit next to the request (`kept_text_encoder`: its
    placement and size; not counted in the budget, as ComfyUI unloads it to make room).
    """
    device = torch.device(device)
    plan = RequestPlan.for_request(transformer, request, vae, graphs=device.type == "cuda",
                                   other_weights=other_weights)
    if decoded_bytes_per_pixel:
        plan.shape = dataclasses.replace(plan.shape, decoded_bytes_per_pixel=decoded_bytes_per_pixel)
    if available is None:
        return plan.budget()
    if request.prefix_placement == AUTO:
        # Until a planner decides more, `auto` keeps the prefix on the GPU where the request fits, else the first
        # placement that does; the run reads the choice from the request.
        placement = choose_placement(plan.dims, plan.shape, plan.weights, plan.vae, available.total, host_free)
        request.planned_placement = placement
        plan.shape = dataclasses.replace(plan.shape, prefix_placement=placement)
    budget = plan.check_available(available, device, more_options)
    shape = plan.shape
    if shape.prefix_placement != GPU:
        how = "auto: the GPU prefix does not fit" if request.prefix_placement == AUTO else "as asked"
        budget.notes.append(f"prefix K/V placement {shape.prefix_placement} ({how})")
    if host_free is not None and budget.host_total > host_free:
        # A host prefix asked for by name that the host cannot pin: refused before anything is allocated.
        pinned = MemoryBudget(parts=list(budget.host_parts), margin=0)
        check(pinned, host_free, "cpu", "host memory, for the pinned prefix", lambda: [
            f"prefix_placement {p} ({why})" for p, why in PLACEMENT_OPTIONS.items() if p != shape.prefix_placement])
    image = memory.decoded_images_bytes(shape.width, shape.height, shape.batch, memory.IMAGE_BYTES_PER_PIXEL)
    if host_free is not None and image > host_free:
        budget.notes.append(f"decoding all {shape.batch} images needs {gib(image)} of host memory for the IMAGE, "
                            f"more than the {gib(host_free)} available: KV-Graph VAE Decode will refuse it (decode a "
                            "smaller part of the batch at a time)")
    if vae_assumed:
        budget.notes.append("VAE sized as the standard Qwen-Image-2.1 VAE (none loaded yet)")
    if kept_text_encoder is not None and budget.total + kept_text_encoder[1] > available.total:
        placement, size = kept_text_encoder
        budget.notes.append(f"the text encoder ('{placement}', {gib(size)}) does not fit next to this request: "
                            "ComfyUI unloads it, and encoding a changed prompt then unloads the transformer and its "
                            "graphs")
    logger.info("KV-Graph: memory budget for %dx %dx%d: %s of %s available on %s%s", shape.batch, shape.width,
                shape.height, budget.describe(), gib(available.total), device,
                "".join(f"; {note}" for note in budget.notes))
    return budget


def check_runtime_request(loaded, request, vae=None, text_encoder=None,
                          image_bytes_per_pixel: int = 3) -> MemoryBudget | None:
    """The runtime's own check (no ComfyUI to unload anything), for the whole request: sampling, the VAE decode and
    the decoded images (`image_bytes_per_pixel`: 3 for RGB, 4 for RGBA, kept on the host until the request ends).

    On CUDA the request must fit in what the device has free plus what its models and graphs already hold there, and
    the decoded images in the host's available memory; on the CPU everything must fit in the host's available memory
    plus what its models already hold. Returns the device budget, or None where the device reports no free memory.
    `loaded`: the transformer's owner (graph_runtime/loaded.py), whose graphs count as memory it holds.
    """
    transformer = loaded.transformer
    device = next(transformer.parameters()).device
    free = available_bytes(device, loaded.engines())
    if free is None:
        return None
    on_cpu = device.type == "cpu"
    others = {}
    if not on_cpu and text_encoder is not None and any(p.device == device for p in text_encoder.parameters()):
        others["text encoder"] = module_bytes(text_encoder)  # its placement keeps it on the GPU: it competes
    models = [m for m in (transformer, vae) if m is not None] + ([text_encoder] if others else [])
    resident = sum(module_bytes(m) for m in models if next(m.parameters()).device == device)
    available = Available(free, (("of its models", resident), ("of graphs", graph_bytes_held(loaded.engines()))))
    vae_dims = VaeDims.of(vae) if vae is not None else None
    budget = check_sampling_request(transformer, request, available, device, vae_dims, others,
                                    decoded_bytes_per_pixel=image_bytes_per_pixel if on_cpu else 0)
    if not on_cpu:
        shape = request_shape(request)
        check_decoded_on_host(shape.width, shape.height, shape.batch, image_bytes_per_pixel)
    return budget


def check_decoded_on_host(width: int, height: int, batch: int, bytes_per_pixel: int, per_image_bytes: int = 0,
                          name: str = "batch", free: int | None = None) -> MemoryBudget | None:
    """A batch of decoded images (each `width` x `height`, `bytes_per_pixel`) kept in host memory, plus
    `per_image_bytes` to make one of them (a VAE decode on the CPU): MemoryBudgetError when it exceeds the host's
    available memory (`free`, else read now), offering the largest `name` that fits. None when the host reports
    nothing."""
    free = free_memory.host_available_bytes() if free is None else free
    if free is None:
        return None

    def budget_for(count: int) -> MemoryBudget:
        need = memory.decoded_images_bytes(width, height, count, bytes_per_pixel) + per_image_bytes
        parts = [(f"decoded images ({count}x {width}x{height})",
                  memory.decoded_images_bytes(width, height, count, bytes_per_pixel))]
        if per_image_bytes:
            parts.append(("one image's VAE decode", per_image_bytes))
        return MemoryBudget(parts=parts, margin=int(memory.MARGIN_BYTES + memory.MARGIN_FRACTION * need))

    budget = budget_for(batch)

    def options() -> list[str]:
        image = memory.decoded_images_bytes(width, height, 1, bytes_per_pixel)
        most = int(((free - memory.MARGIN_BYTES) / (1 + memory.MARGIN_FRACTION) - per_image_bytes) // image)
        while most > 0 and budget_for(most).total > free:  # the margin's rounding
            most -= 1
        most = min(most, batch - 1)
        return [f"{name} at most {most} (needs {gib(budget_for(most).total)})"] if most > 0 else []

    check(budget, free, "cpu", "host memory", options)
    return budget
