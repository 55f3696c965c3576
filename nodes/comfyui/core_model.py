"""The loaded transformer as a ComfyUI MODEL, so core's samplers (KSampler, SamplerCustomAdvanced, ...) run it.

The way packs that bring their own architecture do it: a `comfy.model_base.BaseModel` subclass over the diffusers
transformer, with Qwen-Image-2.1's latent format and flow-matching sampling, under a `ModelPatcher` that ComfyUI's
model management loads whole (or, where it has room for only part, with blocks streamed from the host and eager
steps). Its model function is the pack's runtime (graph_runtime/core_model): core prepares each
conditioning entry once per run (`extra_conds` names its prefix by content), a wrapper around core's sampling call
opens a `SamplingRun` (the prefixes live exactly that long, and the model's LoRA set is held merged), and every
model call is a decode step that replays the captured graph of its shape. Other nodes' block and attention patches
are read per call (graph_runtime/core_model/patches.py): skipped blocks replay a graph of their own, Python patches
run eagerly, and patches no Qwen-Image-2.1 model runs stop the prompt with the node's name.
"""

from __future__ import annotations

import logging

import torch

import comfy.conds
import comfy.latent_formats
import comfy.model_base
import comfy.model_sampling
import comfy.patcher_extension
import comfy.supported_models_base

from ...graph_runtime.comfy_interop.latents import LATENT_CHANNELS, latent_stats, normalized_to_raw, raw_to_normalized
from ...graph_runtime.core_model import ModelFunction, PrefixSource, SamplingRun, placement_from_options
from ...graph_runtime.core_model.model_function import PATCHES_WITH_CONTROL
from ...graph_runtime.core_model.step_cache import StepsWithoutCalls
from ...graph_runtime.decode.attention import AUTO as AUTO_ATTENTION
from ...graph_runtime.decode.prefix_store import GPU
from ...graph_runtime.core_model.patches import check_supported, read_patches
from ...graph_runtime.errors import InputError, KVGraphError
from ...graph_runtime.memory import GenerationShape, TransformerDims, compute_dtype, estimate
from ...graph_runtime.sampling.schedule import dynamic_shift
from ...graph_runtime.validation import describe_value
from ...graph_runtime import in_flight
from . import events
from .core_controlnet import control_from_core, core_fun_control_patches
from .core_lora import core_lora_choice
from .patcher import FullLoadPatcher

logger = logging.getLogger("kvgraph")

PREFIX = "kvgraph_prefix"  # the model condition carrying a conditioning entry's PrefixSource
RUN = "kvgraph_run"  # transformer_options key of the SamplingRun a model call belongs to
LORAS = "kvgraph_loras"  # patcher attachment: the LoRA chain (LoraChoice, ...) of KV-Graph Load LoRA and core loaders
CONTROL = "kvgraph_control"  # patcher attachment: the ControlSpec of a KV-Graph Apply ControlNet node
ATTENTION = "kvgraph_attention"  # patcher attachment: the loader's attention input, where it is not auto
WRAPPER = "kvgraph.sampling_run"
CORE_PATCHES_REFUSED = ("KV-Graph: {what} cannot patch a KV-Graph MODEL: its captured graphs read the weights in "
                        "place. Use core's Load LoRA or KV-Graph Load LoRA, which merge LoRAs into those weights for "
                        "the run.")
DEFAULT_PREFIX_TOKENS = 128  # memory estimates before the prompt is known


class QwenImage21LatentFormat(comfy.latent_formats.LatentFormat):
    """Raw VAE latents <-> the model's normalized space, with the statistics the pack's VAE nodes use."""

    latent_channels = LATENT_CHANNELS
    latent_dimensions = 2

    def __init__(self):
        self.stats = latent_stats()

    def process_in(self, latent):
        return raw_to_normalized(latent, self.stats)

    def process_out(self, latent):
        return normalized_to_raw(latent, self.stats)


class QwenImage21Config(comfy.supported_models_base.BASE):
    """The model config core's BaseModel reads: no network of its own to build, the latent format, and
    flow-matching sampling shifted as the model's schedule is at 1024x1024 (what `KSampler`'s schedulers start
    from; the resolution-dependent schedule itself is the KV-Graph Sigmas node's)."""

    unet_extra_config = {}
    latent_format = QwenImage21LatentFormat
    supported_inference_dtypes = [torch.bfloat16, torch.float16, torch.float32]


class QwenImage21KVModel(comfy.model_base.BaseModel):
    """Core's model over the pack's runtime. `diffusion_model` is the diffusers transformer (ComfyUI sizes, moves and
    lists its weights); every model call goes through `model_function`."""

    def __init__(self, loaded, scheduler_config: dict | None, variant: str | None, device):
        transformer = loaded.transformer
        config = QwenImage21Config({"disable_unet_model_creation": True})
        config.sampling_settings = {"shift": dynamic_shift(scheduler_config, 1024, 1024)}
        config.set_inference_dtype(compute_dtype(transformer), None)
        # FLOW: what the model is (flow matching, velocity prediction), and what ComfyUI logs. Its schedule's shift
        # is the exponential one, which core implements as its Flux sampling: that sampling replaces FLOW's linear
        # shift, so sampling is unchanged.
        super().__init__(config, comfy.model_base.ModelType.FLOW, device=device)
        self.model_sampling = type("ModelSampling", (comfy.model_sampling.ModelSamplingFlux,
                                                     comfy.model_sampling.CONST), {})(config)
        self.diffusion_model = transformer
        self.scheduler_config = scheduler_config
        self.variant = variant
        self.loaded = loaded  # the transformer's owner (graph_runtime/loaded.py): engine, LoRA state, runs
        # The engine is looked up at each use: the loaded model keeps one per attention kernel (loaded.py).
        self.model_function = ModelFunction(lambda: loaded.engine)
        self._ignored = set()
        # The prefix placement of the sampling run in progress (core's Qwen Image 2.1 Cache on the MODEL, set by
        # `sampling_run_wrapper` around core's sampling, whose memory estimate reads it); gpu outside a run.
        self.prefix_placement = GPU

    @property
    def engine(self):
        return self.loaded.engine

    def get_dtype(self):
        return compute_dtype(self.diffusion_model)

    def extra_conds(self, **kwargs):
        """Once per conditioning entry and sampling run: the entry read as the prefix reads it (a CONDConstant:
        core batches two entries into one call only when their prefixes are the same content)."""
        cond = kwargs.get("cross_attn")
        if cond is None:
            raise InputError("conditioning", None, "Qwen-Image-2.1 conditioning (from the KV-Graph encode node or "
                                                   "core's Qwen-Image-2.1 text encode node)")
        config = self.diffusion_model.config
        source = PrefixSource.from_conditioning(cond, kwargs, self.latent_format.stats, config.in_channels,
                                                name=f"{kwargs.get('prompt_type', 'conditioning')} conditioning",
                                                text_dim=config.context_in_dim)
        return {PREFIX: comfy.conds.CONDConstant(source)}

    def extra_conds_shapes(self, **kwargs):
        cond = kwargs.get("cross_attn")
        refs = kwargs.get("reference_latents") or []
        tokens = (0 if cond is None else cond.shape[1]) + sum(r.shape[-2] * r.shape[-1] for r in refs)
        return {PREFIX: [max(1, tokens)]}

    def memory_required(self, input_shape, cond_shapes={}):  # noqa: B006 - core's signature
        """What a call needs beyond the weights (prefix K/V, graph buffers and pool, the prefill), from the pack's
        own memory model."""
        prefixes = tuple(int(s[0]) for s in cond_shapes.get(PREFIX, []) if s and int(s[0]) > 1)
        prefixes = prefixes or (DEFAULT_PREFIX_TOKENS,)
        batch = max(1, int(input_shape[0]) // len(prefixes))
        # The run's placement as set (the only one planned: memory/plan.py prices a whole plan with sizes.estimate).
        shape = GenerationShape(width=int(input_shape[-1]) * 16, height=int(input_shape[-2]) * 16, batch=batch,
                                prefix_tokens=prefixes, prefix_placement=self.prefix_placement)
        return estimate(TransformerDims.of(self.diffusion_model), shape, {}).total

    def _apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        if control is not None:
            raise InputError("control", type(control).__name__, "no ControlNet: a KV-Graph model takes none")
        sigma = t
        # As core's own models: the input in the inference dtype, through the DIFFUSION_MODEL wrappers (core's EasyCache
        # reads the input and the prediction there, and answers a skipped step without calling on).
        xc = self.model_sampling.calculate_input(sigma, x).to(self.manual_cast_dtype or self.get_dtype())
        velocity = comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._diffusion_model, self.diffusion_model,
            comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                                     transformer_options),
        ).execute(xc, sigma, c_crossattn, None, None, transformer_options, **kwargs)
        return self.model_sampling.calculate_denoised(sigma, velocity.float(), x)

    def _diffusion_model(self, x, timestep, context, ref_latents, image_slots, transformer_options={}, **kwargs):
        """The diffusion model's call in the signature of core's Qwen-Image-2.1 model (`timestep` is the sigma: the
        model's sampling maps sigma to itself); the prefix comes from the conditioning (`PREFIX`), the block and
        attention patches from `transformer_options` as that model reads them."""
        patches = read_patches(without_core_control(transformer_options),
                               len(self.diffusion_model.transformer_blocks))
        self._log_ignored(patches.ignored)
        return self.model_function(x, timestep, kwargs.get(PREFIX), run=transformer_options.get(RUN),
                                   roles=transformer_options.get("cond_or_uncond"), patches=patches)

    def _log_ignored(self, ignored) -> None:
        for what in ignored:
            if what not in self._ignored:
                self._ignored.add(what)
                logger.info("KV-Graph: left out the %s: no such block in this model (as ComfyUI's own "
                            "Qwen-Image-2.1 model, which has single-stream blocks only and looks up the ones it "
                            "has).", what)


def without_core_control(options: dict) -> dict:
    """`options` less core's Fun ControlNet block patches: the sampling run runs that net itself (core_controlnet.py),
    so they are neither run as Python block patches nor refused."""
    claimed = core_fun_control_patches(options)
    if not claimed:
        return options
    replace = dict(options.get("patches_replace") or {})
    replace["dit"] = {key: patch for key, patch in replace["dit"].items() if key not in claimed}
    if not replace["dit"]:
        del replace["dit"]
    return {**options, "patches_replace": replace}


class KVGraphModelPatcher(FullLoadPatcher):
    """The MODEL's patcher: loaded whole, or within the memory ComfyUI gives it with blocks streamed from the host
    (patcher.py). Core LoRA loaders' weight patches join the MODEL's LoRA chain (core_lora.py), merged in place by
    its runs since the captured graphs read the weights there; hook and bypass LoRAs are refused at once."""

    def stream_owner(self):
        return self.model.loaded

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        choice, taken = core_lora_choice(self.model.diffusion_model, patches, strength_patch, strength_model)
        # Not core's `patches`: ComfyUI would write those into new tensors at load (or per cast, streaming).
        self.attachments[LORAS] = (*self.attachments.get(LORAS, ()), choice)
        return taken

    def add_hook_patches(self, *args, **kwargs):
        raise KVGraphError(CORE_PATCHES_REFUSED.format(what="hook LoRAs (Create Hook LoRA, Create Hook Model as LoRA "
                                                            "and their keyframes)"))

    def set_injections(self, key, injections):
        if key == "bypass_lora":
            raise KVGraphError(CORE_PATCHES_REFUSED.format(what="Load LoRA (Bypass)"))
        return super().set_injections(key, injections)


def make_model_patcher(loaded, scheduler_config, variant, load_device, offload_device, size: int):
    """The MODEL over a loaded transformer (its owner, graph_runtime/loaded.py), with the wrapper that opens a sampling
    run around core's sampling."""
    model = QwenImage21KVModel(loaded, scheduler_config, variant, torch.device(offload_device))
    patcher = KVGraphModelPatcher(model, load_device=torch.device(load_device),
                                  offload_device=torch.device(offload_device), size=size)
    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER, sampling_run_wrapper)
    return patcher


def with_loras(patcher, choices) -> KVGraphModelPatcher:
    """A clone of the MODEL whose runs merge `choices` (added to the chain it already has)."""
    copy = patcher.clone()
    copy.attachments[LORAS] = (*patcher.attachments.get(LORAS, ()), *choices)
    return copy


def with_control(patcher, spec) -> KVGraphModelPatcher:
    """A clone of the MODEL whose runs apply the ControlNet `spec` (graph_runtime/controlnet); one per MODEL."""
    if patcher.attachments.get(CONTROL) is not None:
        raise InputError("model", "a MODEL with a KV-Graph ControlNet applied already",
                         "a MODEL without one (one KV-Graph Apply ControlNet per model)")
    copy = patcher.clone()
    copy.attachments[CONTROL] = spec
    return copy


def with_attention(patcher, attention: str) -> KVGraphModelPatcher:
    """A clone of the MODEL whose runs decode with the attention kernel `attention` (decode/attention.py); `auto` is
    what a MODEL without the attachment runs."""
    copy = patcher.clone()
    copy.attachments[ATTENTION] = attention
    return copy


def kv_model(model, name: str = "model") -> QwenImage21KVModel:
    """The pack's model inside a MODEL, or a clear error naming what was wired in instead."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, QwenImage21KVModel):
        found = f"a {type(inner).__name__} model" if inner is not None else describe_value(model)
        raise InputError(name, found, "a KV-Graph MODEL, from a KV-Graph transformer or diffusers loader "
                                                   "(or KV-Graph Load LoRA)")
    return inner


def sampling_run_wrapper(executor, noise, latent_image, sampler, sigmas, *args, **kwargs):
    """Around core's sampling call (`CFGGuider.outer_sample`): one `SamplingRun` for its model calls, released when
    the call ends however it ends; the run holds the MODEL's LoRA set merged from its first model call, and the
    engine is marked busy (a graph release waits for the run) with its progress in the pack's status."""
    guider = executor.class_obj
    patcher = guider.model_patcher
    model = kv_model(patcher)
    loras = patcher.attachments.get(LORAS, ())
    options = guider.model_options.setdefault("transformer_options", {})
    check_supported(without_core_control(options))  # a patch no Qwen-Image-2.1 model runs stops the prompt at once
    control = patcher.attachments.get(CONTROL)
    core_control = control_from_core(options)
    if control is not None and core_control is not None:
        raise InputError("model", "a KV-Graph ControlNet and core's Fun ControlNet", "one ControlNet per model")
    control = control or core_control
    if control is not None and read_patches(without_core_control(options),
                                            len(model.diffusion_model.transformer_blocks)).eager:
        raise InputError("model", *PATCHES_WITH_CONTROL)  # at once, not after the steps before the net's range
    if control is not None:
        control.tokens(*latent_image.shape[-2:])  # the VAE encodes before the first model call, not inside a step
    engine = model.loaded.use_attention(patcher.attachments.get(ATTENTION, AUTO_ATTENTION))
    # Core's Qwen Image 2.1 Cache node on the MODEL says where the prefixes live.
    placement, note = placement_from_options(options)
    if note is not None:
        logger.info("KV-Graph: Qwen Image 2.1 Cache on a KV-Graph MODEL: prefix placement %s (%s).", placement, note)
    run = SamplingRun(engine, on_first_call=lambda: model.loaded.loras_in_use(loras), control=control,
                      placement=placement)
    prompt_id, node_id = events.executing_ids()
    total = max(0, int(sigmas.shape[-1]) - 1)
    steps = StepsWithoutCalls(run, engine.stats)
    with in_flight.sampling(model.loaded, prompt_id, node_id, total) as record:
        args, kwargs = _with_progress(args, kwargs, record, steps.step_done)
        options[RUN] = run
        # Core's memory estimate (inside this call, before it loads the MODEL) prices the placement the run keeps.
        model.prefix_placement = placement
        try:
            return executor(noise, latent_image, sampler, sigmas, *args, **kwargs)
        finally:
            model.prefix_placement = GPU
            options.pop(RUN, None)
            run.release()
            logger.info("KV-Graph: core sampling run on %s: %s", engine.name,
                        {**run.counts.describe(), "skipped_steps": steps.skipped})


def _with_progress(args, kwargs, record, step_done):
    """The sampling call's arguments with its step callback (`outer_sample(..., denoise_mask, callback, ...)`) also
    reporting the step to the pack's status and to `step_done`."""
    args = list(args)
    original = args[1] if len(args) > 1 else kwargs.get("callback")

    def callback(step, x0, x, total_steps):
        step_done()
        in_flight.update(record, step + 1, total_steps)
        if original is not None:
            return original(step, x0, x, total_steps)

    if len(args) > 1:
        args[1] = callback
    else:
        kwargs["callback"] = callback
    return tuple(args), kwargs
