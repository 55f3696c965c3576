"""Refusing a request that cannot fit, before anything is allocated, and saying what would fit.

`check_sampling_request` is the one check of a sampling request. `RequestPlan` holds what its budget is computed
from (sizes.py), so every alternative setting is priced the same way; `MemoryBudgetError` names the settings that
change the budget, each with what it would need, those that fit first. The ComfyUI sampler node adds what ComfyUI
can unload to what is available (nodes/comfyui/memory.py); the runtime alone (`check_runtime_request`, used by the
CLI) has only what the device has free and what its own models and graphs hold."""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..errors import KVGraphError
from .. import free_memory
from ..decode import TOKENS_PER_SLOT
from ..decode.prefix_store import AUTO, GPU, HOST
from . import plan as plans
from . import sizes as memory
from .sizes import (
    GenerationShape, MemoryBudget, TransformerDims, VaeDims, available_bytes, estimate, fitting_estimate, gib,
    graph_bytes_held, module_bytes,
)

logger = logging.getLogger("kvgraph")


# -- the refusal ---------------------------------------------------------------------------------------------------


class MemoryBudgetError(KVGraphError):
    """A request that cannot fit in the device memory available, refused before anything is allocated."""

    def __init__(self, budget: MemoryBudget, available: int, device, where: str, options: list[str],
                 plan=None):
        self.budget, self.available, self.where, self.options, self.plan = budget, available, where, options, plan
        if plan is None:
            message = (f"KV-Graph: this request needs {budget.describe()} on {device}, and {gib(available)} is "
                       f"available there ({where}). Nothing was allocated.")
        else:
            message = (f"KV-Graph: no memory plan fits this request on {device}: the smallest ({plan.summary()}) "
                       f"needs {budget.describe()}, and {gib(available)} is available there ({where})"
                       + (f", and {gib(plan.host_bytes)} of host memory of {gib(plan.host_available)}"
                          if plan.host_available is not None else "")
                       + ". Nothing was allocated." + "".join(f" Note: {note}." for note in plan.notes))
        if options:
            message += " Change one of: " + "; ".join(options) + "."
        else:
            message += " No setting of this request fits: free memory on the device (close other programs)."
        super().__init__(message)


def alternatives(dims: TransformerDims, shape: GenerationShape, weights: dict[str, int], vae: VaeDims | None,
                 available: int, price=None) -> list[str]:
    """Settings that would change the budget, each with what it would need, those that fit first. `price(dims,
    shape, weights)`: what a setting needs (default: its whole budget; a refused plan's: its smallest plan's)."""
    options: list[tuple[bool, str]] = []

    def option(text: str, new_shape=shape, new_weights=weights, new_dims=dims) -> None:
        need = _need(new_dims, new_shape, new_weights, vae, available, price)
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
        most = largest_fitting_batch(dims, shape, weights, vae, available, price)
        option(f"batch {most}" if most > 1 else "batch 1", dataclasses.replace(shape, batch=most))
    size = largest_fitting_size(dims, shape, weights, vae, available, price)
    if size is not None:
        option(f"width x height at most {size[0]}x{size[1]} (same aspect)",
               dataclasses.replace(shape, width=size[0], height=size[1]))
    return [text for fits, text in sorted(options, key=lambda o: not o[0])]


def _need(dims, shape, weights, vae, available: int, price=None) -> int:
    """What a setting needs: `price(dims, shape, weights)`, else its whole budget."""
    if price is not None:
        return price(dims, shape, weights)
    return fitting_estimate(dims, shape, weights, vae, available).total


# What each prefix placement trades, as a refusal offers it.
PLACEMENT_OPTIONS = {
    "int8": "the prefix K/V int8 on the GPU, about half the bytes, within the INT8 bound",
    "host": "the prefix K/V in pinned host memory, copied per block behind the compute",
    "recompute": "no prefix cache: every step runs the whole sequence eagerly, several times slower",
}


def largest_fitting_batch(dims, shape, weights, vae, available: int, price=None) -> int:
    """The largest smaller batch that fits (the budget grows with the batch), or 1 when none does."""
    low, high = 1, shape.batch - 1
    while low < high:
        mid = (low + high + 1) // 2
        if _need(dims, dataclasses.replace(shape, batch=mid), weights, vae, available, price) <= available:
            low = mid
        else:
            high = mid - 1
    return low


def largest_fitting_size(dims, shape, weights, vae, available: int, price=None) -> tuple[int, int] | None:
    """The largest output size of the same aspect ratio (multiples of 16 px) that fits, if any smaller one does."""
    long_side = max(shape.width, shape.height)
    for side in range(long_side - 16, 15, -16):
        width = max(16, round(shape.width * side / long_side / 16) * 16)
        height = max(16, round(shape.height * side / long_side / 16) * 16)
        trial = dataclasses.replace(shape, width=width, height=height)
        if _need(dims, trial, weights, vae, available, price) <= available:
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
                           kept_text_encoder: tuple[str, int] | None = None,
                           text_encoder: plans.TextEncoderSize | None = None, host_available: int | None = None,
                           stream: bool = True, bandwidth: float | None = None,
                           prefix_placements: tuple[str, ...] | None = None,
                           text_encoder_placement: str | None = None) -> MemoryBudget:
    """The one memory check of a sampling request, before anything is allocated; the command line
    (`check_runtime_request`) and the ComfyUI sampler node (nodes/comfyui/memory.py) differ only in what they count
    as `available`, in `more_options` and in what they ask to be noted.

    `transformer` and `vae` (its dims; None: not counted) are priced with `other_weights` (e.g. a text encoder kept
    on the device); `decoded_bytes_per_pixel`: the decoded images kept on `device` until the request ends (the CPU's
    images), 0 where they leave it. Returns the budget (unchecked where `available` is None: nothing reports free
    memory), or raises MemoryBudgetError naming the settings that would fit, then `more_options()`.

    The budget carries the request's memory plan (`budget.plan`, plan.py): on a CUDA device, the fastest plan that
    fits `available` and the host (`host_available`, else `host_free`, plus the transformer's weights already
    there: streaming repacks them; None: not checked) among the placements this build carries out; `stream=False`
    keeps every block resident (several GPUs); `prefix_placements`: the placements to choose from (None: all; one, where a user forces it);
    `text_encoder`: its size, for the plan's placement of it, noted where it differs from the user's
    `text_encoder_placement`. A request that fits whole runs whole with
    today's budget; one that does not runs under a streamed plan; it is refused only when no plan fits.

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
    host = host_free if host_available is None else host_available
    if request.prefix_placement != AUTO:
        prefix_placements = (request.prefix_placement,)  # a user's choice is the only one planned
    if request.prefix_placement == HOST and host_free is not None:
        _check_pinned_prefix(plan.shape, plan.dims, host_free)
    memory_plan = plan_request(transformer, plan, available.total, device, text_encoder,
                               None if host is None else host + _host_bytes(transformer),
                               stream=stream, bandwidth=bandwidth, placements=prefix_placements)
    if memory_plan.fits or request.prefix_placement != AUTO:
        # The run reads `auto`'s choice from the request; where nothing fits, the refusal prices the gpu prefix.
        if request.prefix_placement == AUTO:
            request.planned_placement = memory_plan.prefix_placement
        plan.shape = dataclasses.replace(plan.shape, prefix_placement=memory_plan.prefix_placement)
    if (text_encoder_placement not in (None, plans.TE_AUTO)
            and memory_plan.text_encoder not in (None, text_encoder_placement)):
        memory_plan.notes.append(f"the text encoder runs '{text_encoder_placement}' as set; the plan would run it "
                                 f"'{memory_plan.text_encoder}'")
    if memory_plan.whole or device.type != "cuda":
        # Today's budget and refusal, exactly: a plan that keeps everything on the device is that budget.
        budget = plan.check_available(available, device, more_options)
    elif not memory_plan.fits:
        _refuse(transformer, plan, memory_plan, available, device, more_options, stream, prefix_placements)
    else:
        budget = memory_plan.budget
    budget.plan = memory_plan
    shape = plan.shape
    if shape.prefix_placement != GPU:
        how = "auto: the GPU prefix does not fit" if request.prefix_placement == AUTO else "as asked"
        budget.notes.append(f"prefix K/V placement {shape.prefix_placement} ({how})")
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
    _log_plan(memory_plan, device)
    return budget


def _check_pinned_prefix(shape: GenerationShape, dims: TransformerDims, host_free: int) -> None:
    """A host prefix asked for by name that the host cannot pin: refused before anything is planned or allocated,
    naming the other placements."""
    host = sum(memory.placement_bytes(dims, shape.batch, p, shape.target_tokens, HOST)[1]
               for p in shape.prefix_tokens)
    pinned = MemoryBudget(parts=[(f"pinned prefix K/V ({'+'.join(map(str, shape.prefix_tokens))} tokens)", host)],
                          margin=0)
    check(pinned, host_free, "cpu", "host memory, for the pinned prefix", lambda: [
        f"prefix_placement {p} ({why})" for p, why in PLACEMENT_OPTIONS.items() if p != HOST])


def plan_request(transformer, plan: RequestPlan, available: int, device, text_encoder=None,
                 host_available: int | None = None, stream: bool = True, bandwidth: float | None = None,
                 placements: tuple[str, ...] | None = None) -> plans.MemoryPlan:
    """The memory plan of `plan`'s request on `device`: on CUDA the fastest that fits among `placements` (None: all
    the prefix placements) built here, noting a faster one that needs a placement not built yet; elsewhere the device
    is the host, so every block stays resident and the prefix in its memory."""
    placements = plans.PREFIX_PLACEMENTS if placements is None else tuple(placements)
    sizes = _model_sizes(transformer, plan, text_encoder)
    bandwidth = plans.default_bandwidth(device) if bandwidth is None else bandwidth
    if torch.device(device).type != "cuda":
        # The host is the device: a host prefix gains nothing there, so `auto` chooses among the others.
        on_host = tuple(p for p in placements if p != HOST) if len(placements) > 1 else placements
        return plans.plan_memory(sizes, plan.shape, available, None, placements=on_host, stream=False,
                                 bandwidth=bandwidth, device="CPU")
    fastest = plans.plan_memory(sizes, plan.shape, available, host_available, stream=stream, bandwidth=bandwidth,
                                placements=placements)
    if fastest.runnable:
        return fastest
    built = tuple(p for p in placements if p in plans.PREFIX_PLACEMENTS_BUILT) or ("gpu",)
    chosen = plans.plan_memory(sizes, plan.shape, available, host_available, placements=built, stream=stream,
                               bandwidth=bandwidth)
    if fastest.fits and chosen.fits:
        chosen.notes.append(f"the fastest plan ({fastest.summary()}; step ~{fastest.step_ms:.0f} ms) places the "
                            f"prefix K/V '{fastest.prefix_placement}', which this build does not carry out yet")
    elif fastest.fits:
        chosen.notes.append(f"a plan placing the prefix K/V '{fastest.prefix_placement}' would fit "
                            f"({fastest.summary()}; needs {gib(fastest.gpu_bytes)}), but this build does not carry "
                            "it out yet")
    return chosen


def _model_sizes(transformer, plan: RequestPlan, text_encoder=None) -> plans.ModelSizes:
    extra = {k: v for k, v in plan.weights.items() if k not in ("transformer", "VAE")}
    return plans.ModelSizes.of(transformer, plan.vae, extra, text_encoder)


def _refuse(transformer, plan: RequestPlan, memory_plan, available: Available, device, more_options, stream: bool,
            placements: tuple[str, ...] | None = None):
    """No plan fits: MemoryBudgetError with the smallest plan's needs and the settings that change them, each priced
    as its own smallest plan among the placements built here (`placements`: those the request allows; an offered
    placement is priced alone)."""
    sizes = _model_sizes(transformer, plan)
    allowed = plans.PREFIX_PLACEMENTS if placements is None else placements
    asked = tuple(p for p in plans.PREFIX_PLACEMENTS if p in plans.PREFIX_PLACEMENTS_BUILT and p in allowed)

    def smallest(dims, shape, weights) -> int:
        built = asked if shape.prefix_placement == plan.shape.prefix_placement else (shape.prefix_placement,)
        changed = sizes.as_int8() if dims.int8 else sizes
        changed = dataclasses.replace(changed, extra_weights=tuple(
            (k, v) for k, v in weights.items() if k not in ("transformer", "VAE")))
        return plans.plan_memory(changed, shape, 0, placements=built, stream=stream).gpu_bytes

    options = alternatives(plan.dims, plan.shape, plan.weights, plan.vae, available.total, smallest) + more_options()
    raise MemoryBudgetError(memory_plan.budget, available.total, device, available.describe(), options,
                            plan=memory_plan)


def bytes_on(module, device) -> int:
    """The bytes of the module's weights that are on `device` now."""
    device = torch.device(device)
    seen, total = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        here = t.device.type == device.type and (device.type == "cpu" or (t.device.index or 0) == (device.index or 0))
        if here and t.data_ptr() not in seen:  # shared storage once, as module_bytes counts it
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _host_bytes(module) -> int:
    """The module's weights in host memory now (a streamed load repacks them rather than copying them)."""
    return bytes_on(module, "cpu")


# The plans logged lately, so each new one is logged once rather than on every request.
_LOGGED_PLANS: collections.OrderedDict = collections.OrderedDict()
_LOGGED_PLANS_KEPT = 32


def _log_plan(memory_plan, device) -> None:
    # A new plan is new decisions or bytes; the free memory it was planned against moves between requests.
    key = (str(device), memory_plan.summary(), memory_plan.gpu_bytes, memory_plan.host_bytes,
           tuple(memory_plan.notes))
    if key in _LOGGED_PLANS:
        _LOGGED_PLANS.move_to_end(key)
        return
    _LOGGED_PLANS[key] = None
    while len(_LOGGED_PLANS) > _LOGGED_PLANS_KEPT:
        _LOGGED_PLANS.popitem(last=False)
    logger.info("KV-Graph: %s on %s.", memory_plan.describe(), device)


def check_runtime_request(loaded, request, vae=None, text_encoder=None,
                          image_bytes_per_pixel: int = 3, stream: bool = True,
                          text_encoder_placement: str | None = None) -> MemoryBudget | None:
    """The runtime's own check (no ComfyUI to unload anything), for the whole request: sampling, the VAE decode and
    the decoded images (`image_bytes_per_pixel`: 3 for RGB, 4 for RGBA, kept on the host until the request ends).

    On CUDA the request must fit in what the device has free plus what its models and graphs already hold there, and
    the decoded images in the host's available memory; on the CPU everything must fit in the host's available memory
    plus what its models already hold. Returns the device budget, or None where the device reports no free memory.
    `loaded`: the transformer's owner (graph_runtime/loaded.py), whose graphs count as memory it holds. The budget's
    `plan` says how many blocks stay resident (`stream=False`: all, for several GPUs); `loaded.follow_plan` loads so.
    `text_encoder_placement`: the one set (encoding/placed.py), noted where the plan would run another.
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
    # Tensor by tensor: a streamed transformer holds only its resident blocks there.
    resident = sum(bytes_on(m, device) for m in models)
    available = Available(free, (("of its models", resident), ("of graphs", graph_bytes_held(loaded.engines()))))
    vae_dims = VaeDims.of(vae) if vae is not None else None
    budget = check_sampling_request(
        transformer, request, available, device, vae_dims, others,
        decoded_bytes_per_pixel=image_bytes_per_pixel if on_cpu else 0,
        text_encoder=None if text_encoder is None or others else plans.TextEncoderSize.of(text_encoder),
        host_available=None if on_cpu else free_memory.host_available_bytes(), stream=stream,
        text_encoder_placement=text_encoder_placement)
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
