"""The sampling loop, in four parts: prepare (noise, schedule, token layouts), prefill (each branch's prefix once),
the loop (a decode step per step, graph replay or eager, flow-match Euler), the result.

Numerically it is `QwenImage21Pipeline`'s loop (same noise from a CPU generator, same sigmas, same timestep
rounding, same CFG combination, same Euler update), so its latents can be compared with the reference. The prefill
runs the prefix rows alone, so step 1's prediction is a decode step like every other (same math, and it replays
the graph; see `DecodeEngine.prefill`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..decode import DecodeEngine, PrefixCache, TokenLayout
from ..decode.prefix_store import AUTO, GPU, check_placement
from ..encoding.prompt import PromptEmbeds
from ..errors import InputError
from ..validation import check_cfg, check_count, check_denoise, check_finite, check_positions, check_seed
from .finite_watch import FiniteWatch
from .inpaint import Inpaint
from .reporter import SampleReporter
from .schedule import dynamic_shift, euler_step, model_timestep, resolve_sigmas, schedule_for
from .step_cache import StepCache, StepCacheSettings

logger = logging.getLogger("kvgraph")


class Cancelled(RuntimeError):
    """Raised between steps when the caller asked to stop; the request's caches are released first."""


@dataclass
class SamplingRequest:
    positive: PromptEmbeds
    latent_height: int  # in latent tokens (pixels / 16)
    latent_width: int
    negative: PromptEmbeds | None = None
    cfg: float = 1.0
    reference_latents: list[torch.Tensor] = field(default_factory=list)  # each [1, C, h, w], normalized space
    # The negative's own reference images (each CFG branch prefills its own prefix, so each sees the references its
    # prompt was encoded with); None: the positive's, as diffusers' pipeline gives both branches one set of images.
    negative_reference_latents: list[torch.Tensor] | None = None
    batch_size: int = 1
    seed: int = 0
    steps: int = 40
    sigma_preset: str = "dynamic"
    sigmas: list[float] | None = None
    denoise: float = 1.0
    init_latents: torch.Tensor | None = None  # [B, C, h, w] normalized space, for denoise < 1 or a noise mask
    noise_mask: torch.Tensor | None = None  # [1 or B, 1, h, w]: 1 samples anew, 0 keeps init_latents (inpainting)
    decode_mode: str = "auto"
    # Compiled blocks: the same step time as the captured eager blocks once our kernels do the fusing, and seconds
    # more on a first prompt (docs/performance.md), so off by default; skipped automatically off CUDA.
    compile: bool = False
    scheduler_config: dict | None = None
    # A ControlNet (graph_runtime/controlnet `ControlSpec`): the steps inside its range decode against a controlled
    # prefix with the control stream, the others against the plain prefix.
    control: object = None
    step_cache: StepCacheSettings | None = None  # skip steps the cache can predict (step_cache.py)
    # The memory plan the request runs under (memory/plan.py `MemoryPlan`, set by the memory check): where its
    # prefix K/V lives (`prefix_placement`) and how many blocks stay resident. None: everything on the device.
    memory_plan: object = None
    # Where the prefix K/V live (decode/prefix_store.py): "auto" lets the memory plan choose (`planned_placement`,
    # set by graph_runtime/memory's check), or one of "gpu", "int8", "host", "recompute" (planned as the only one).
    prefix_placement: str = "auto"
    planned_placement: str | None = None

    def __post_init__(self):
        """Every sampling setting is checked here, once, where a request is built (by the sampler node, the generator
        or a caller of `sample`): a bad value is refused, naming it, before any work. The tensors (prompt embeddings,
        references, input latent, mask) are checked when sampling starts (`_validate`), against the model."""
        if self.latent_height < 1 or self.latent_width < 1:
            raise InputError("latent size", (self.latent_height, self.latent_width),
                             "at least 1x1 latent tokens (16 px)")
        # Kept as checked: a numpy or torch integer becomes an int, so the loop sees plain numbers.
        self.batch_size = check_count("batch_size", self.batch_size)
        self.steps = check_count("steps", self.steps)
        self.seed = check_seed(self.seed)
        self.cfg = check_cfg(self.cfg)
        self.denoise = check_denoise(self.denoise)
        check_placement(self.prefix_placement)
        if self.step_cache is not None and not isinstance(self.step_cache, StepCacheSettings):
            raise InputError("step_cache", type(self.step_cache).__name__, "StepCacheSettings or None")

    def placement(self) -> str:
        """The prefix placement the run uses: the one asked for, else the budget's choice, else "gpu" (no budget
        was made: nothing reports free memory)."""
        if self.prefix_placement != AUTO:
            return self.prefix_placement
        return self.planned_placement or GPU

    @property
    def do_cfg(self) -> bool:
        return self.negative is not None and self.cfg > 1.0

    def references_of(self, branch: str) -> list[torch.Tensor]:
        """The reference latents `branch` ("cond" / "uncond", or "positive" / "negative") prefills with."""
        if branch in ("uncond", "negative") and self.negative_reference_latents is not None:
            return self.negative_reference_latents
        return self.reference_latents

    def branches(self) -> list[tuple[str, PromptEmbeds, list[torch.Tensor]]]:
        """(branch name, prompt embeddings, reference latents) of each branch the run computes: "cond", and "uncond"
        with CFG."""
        named = [("cond", self.positive)] + ([("uncond", self.negative)] if self.do_cfg else [])
        return [(name, embeds, self.references_of(name)) for name, embeds in named]


@dataclass
class SampleResult:
    latents: torch.Tensor  # [B, C, h, w], normalized latent space
    timings: dict
    stats: dict
    paths: list[str]


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h * w, C] (Qwen-Image-2.1 consumes latents unpatched)."""
    return latents.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], height, width)


def initial_noise(seed: int, batch: int, channels: int, height: int, width: int, dtype) -> torch.Tensor:
    """The pipeline's noise: `randn` of `[B, 1, C, h, w]` from `torch.Generator("cpu").manual_seed(seed)`."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    return torch.randn((batch, 1, channels, height, width), generator=generator, dtype=dtype)[:, 0]


def _image_shapes(req: SamplingRequest, references) -> list[tuple[int, int, int]]:
    """The joint sequence's images: each reference, then the target."""
    return [(1, r.shape[2], r.shape[3]) for r in references] + [(1, req.latent_height, req.latent_width)]


def _validate(req: SamplingRequest, in_channels: int) -> None:
    """Refuse every request the loop could not run as asked, before any work (a NaN input would otherwise give a
    black or unchanged image reported as a success). Its settings were checked when it was built."""
    for branch, embeds, references in req.branches():
        name = "positive" if branch == "cond" else "negative"
        check_finite(name, embeds.embeds, "NaN/inf prompt embeddings come from the text encoder's weights")
        # The negative's own references are named as such; the positive's keep their plain names.
        prefix = "negative " if branch == "uncond" and references is not req.reference_latents else ""
        for i, ref in enumerate(references):
            if not isinstance(ref, torch.Tensor) or ref.dim() != 4 or ref.shape[1] != in_channels:
                found = tuple(getattr(ref, "shape", ())) or type(ref).__name__
                raise InputError(f"{prefix}reference latent {i}", found, f"[1, {in_channels}, h, w]")
            check_finite(f"{prefix}reference latent {i}", ref, "NaN/inf reference latents come from the VAE's "
                                                               "weights or the reference image")
        check_positions(int((~embeds.image_mask[0].bool()).sum()), _image_shapes(req, references))
    if req.init_latents is not None:
        init = req.init_latents
        expected = (f"a tensor [1 or {req.batch_size}, {in_channels}, {req.latent_height}, {req.latent_width}] "
                    "(the requested batch and latent size)")
        if (not isinstance(init, torch.Tensor) or init.dim() != 4 or init.shape[0] not in (1, req.batch_size)
                or tuple(init.shape[1:]) != (in_channels, req.latent_height, req.latent_width)):
            raise InputError("input latent", tuple(getattr(init, "shape", ())) or type(init).__name__, expected)
        check_finite("input latent", init, "an input latent with NaN/inf, e.g. from a VAE with damaged weights")
    if req.noise_mask is not None:
        mask = req.noise_mask
        expected = f"a tensor [1 or {req.batch_size}, 1, {req.latent_height}, {req.latent_width}] with an input latent"
        if (req.init_latents is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4
                or mask.shape[0] not in (1, req.batch_size)
                or tuple(mask.shape[1:]) != (1, req.latent_height, req.latent_width)):
            raise InputError("noise mask", tuple(getattr(mask, "shape", ())) or type(mask).__name__, expected)
        check_finite("noise mask", mask, "a mask with NaN/inf values")


@dataclass
class _Prepared:
    """Everything the prefill and the loop read, made before either runs."""

    latents: torch.Tensor  # [B, h * w, C] packed start latents
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    branches: dict  # name -> (layout, embeds, text mask, reference tokens); "cond" first, "uncond" with CFG; the
    # reference tokens ([B, tokens, C] packed reference latents, prepended at prefill) are None without references
    dtype: torch.dtype  # the model's
    inpaint: Inpaint | None = None  # a noise mask's region kept (inpaint.py)


def _schedule(req: SamplingRequest, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    height, width = req.latent_height, req.latent_width
    return schedule_for(req.sigma_preset, req.steps, height * width, req.scheduler_config, req.denoise, req.sigmas,
                        device, latent_size=(height, width))


def check_schedule(req: SamplingRequest) -> None:
    """Refuse a request whose schedule cannot be computed (an image too large for the resolution-dependent shift)
    before anything is loaded or allocated for it, so that refusal comes before any about memory."""
    _schedule(req)


def _prepare(req: SamplingRequest, channels: int, device, dtype) -> _Prepared:
    height, width, batch = req.latent_height, req.latent_width, req.batch_size
    timesteps, sigmas = _schedule(req, device)
    noise = initial_noise(req.seed, batch, channels, height, width, dtype).to(device)
    latents = pack(noise)
    inpaint = None
    if req.init_latents is not None:
        init = pack(req.init_latents.to(device, dtype).expand(batch, -1, -1, -1))
        start = sigmas[0]
        latents = (start * latents.float() + (1.0 - start) * init.float()).to(dtype)
        if req.noise_mask is not None:
            full = pack(req.init_latents.to(device, torch.float32).expand(batch, -1, -1, -1))
            mask = req.noise_mask.to(device, torch.float32).expand(batch, -1, -1, -1)
            inpaint = Inpaint.packed(mask, pack(noise), full)
            latents = start * inpaint.noise + (1.0 - start) * inpaint.init  # float32 from the start
    elif req.denoise < 1.0:
        raise InputError("denoise", req.denoise, "1.0 unless an input latent to start from is given")

    branches = {}
    for name, embeds, references in req.branches():
        cond_tokens = None
        if references:
            cond_tokens = torch.cat([pack(r.to(device, dtype)) for r in references], dim=1).expand(batch, -1, -1)
        layout = TokenLayout.build(embeds.image_mask, _image_shapes(req, references), device)
        branches[name] = (layout, *embeds.for_batch(batch, device, dtype), cond_tokens)
    return _Prepared(latents, timesteps, sigmas, branches, dtype, inpaint)


def _prefill(engine: DecodeEngine, req: SamplingRequest, run: _Prepared, prefixes: dict, control=None) -> None:
    """Each branch's prefix rows, once, at step 1's timestep, into `prefixes` (filled as they finish, so the
    caller releases whatever was made if a later branch fails). `control`: the request's ControlNet, for the
    controlled prefixes."""
    timestep = model_timestep(run.timesteps[0].expand(req.batch_size), run.dtype)
    latents = run.latents.to(run.dtype)
    for name, (layout, embeds, text_mask, cond_tokens) in run.branches.items():
        hidden = latents if cond_tokens is None else torch.cat([cond_tokens, latents], dim=1)
        branch = None if control is None else control.for_branch(engine.transformer, req.batch_size,
                                                                 req.latent_height, req.latent_width)
        _, prefixes[name] = engine.prefill(layout, hidden, embeds, timestep, text_mask, branch=name,
                                           mode=req.decode_mode, with_target=False, control=branch,
                                           placement=req.placement())


def _denoise_step(engine: DecodeEngine, req: SamplingRequest, run: _Prepared, prefixes: dict[str, PrefixCache],
                  latents: torch.Tensor, i: int, reporter: SampleReporter,
                  cache: StepCache | None = None) -> tuple[torch.Tensor, list[str]]:
    """Step `i + 1`: every branch's decode step (or, where the step cache predicts it, none: path "skipped"), the
    CFG combination and the Euler update. Returns the new latents and the path each branch took."""
    timestep = model_timestep(run.timesteps[i].expand(req.batch_size), run.dtype)
    model_input = latents if run.inpaint is None else run.inpaint.model_input(latents, run.sigmas[i])
    x = model_input.to(run.dtype)
    sigma = float(run.sigmas[i]) if cache is not None else 0.0
    if cache is not None and cache.skip(x, sigma, run.branches):
        # No transformer call: the prefixes and their graph entries stay as they are for the next computed step.
        preds = {name: cache.cached(x, name) for name in run.branches}
        paths = ["skipped"] * len(preds)
        engine.stats.skipped_steps += 1
    else:
        preds, paths = {}, []
        outcomes = engine.decode_all({name: prefixes[name] for name in run.branches}, x, timestep, req.decode_mode)
        for name, outcome in outcomes.items():
            preds[name] = outcome.output
            paths.append(outcome.path)
            reporter.decoded(i + 1, name, outcome)
        if cache is not None:
            cache.computed(x, preds, sigma)
    reporter.step_done(i + 1, paths)
    noise_pred = preds["cond"]
    if "uncond" in preds:
        noise_pred = preds["uncond"] + req.cfg * (noise_pred - preds["uncond"])
    if run.inpaint is not None:
        return run.inpaint.step(latents, model_input, noise_pred, run.sigmas[i], run.sigmas[i + 1]), paths
    return euler_step(latents, noise_pred, run.sigmas[i], run.sigmas[i + 1]), paths


def _step_cache(req: SamplingRequest) -> StepCache | None:
    """The run's step cache, when the request asks for one: its sigma range mapped as core maps it for the MODEL
    (whose shift is the model's at 1024x1024), so the same settings skip the same steps on either sampler."""
    if req.step_cache is None:
        return None
    mu = dynamic_shift(req.scheduler_config, 1024, 1024)
    return StepCache.for_run(req.step_cache, mu, req.latent_height, req.latent_width)


def _stop_if_asked(should_stop, step: int, total: int) -> None:
    if should_stop is not None and should_stop():
        raise Cancelled(f"stopped before step {step} of {total}")


def sample(
    engine: DecodeEngine,
    req: SamplingRequest,
    on_step: Callable[[int, int, torch.Tensor], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_event: Callable[[str, dict], None] | None = None,
) -> SampleResult:
    transformer = engine.transformer
    param = next(transformer.parameters())
    device, dtype = param.device, param.dtype
    channels = transformer.config.in_channels
    _validate(req, channels)
    reporter = SampleReporter(on_event, on_step)
    resolve_sigmas(req.sigma_preset, req.steps, req.sigmas)  # a bad preset or grid fails before any work
    height, width = req.latent_height, req.latent_width

    # Everything below runs outside inference mode so tensors handed to the static graph buffers and compiled
    # blocks are normal tensors (ComfyUI calls nodes under `torch.inference_mode()`).
    with torch.inference_mode(False), torch.no_grad():
        run = _prepare(req, channels, device, dtype)
        compile_started = req.compile and engine.enable_compile()
        stats_before = engine.stats.snapshot()
        total = len(run.timesteps)
        timings = {"steps": total}
        latents, paths, prefixes, controlled = run.latents, [], {}, {}
        # Which steps the ControlNet acts on (its start/end range over the schedule's sigmas).
        active = [req.control is not None and req.control.active(float(s)) for s in run.sigmas[:total]]
        cache = _step_cache(req)
        watch = FiniteWatch(device, total)
        loop_start = _now(device)
        try:
            _stop_if_asked(should_stop, 1, total)
            if not all(active):
                _prefill(engine, req, run, prefixes)
            if any(active):
                _prefill(engine, req, run, controlled, req.control)
            # One sync after the prefill and one at the end: per-step syncs would stall eager launches.
            decode_start = _now(device)
            timings["prefill_ms"] = decode_start - loop_start
            cond_layout = run.branches["cond"][0]
            reporter.prefill(timings["prefill_ms"], cond_layout.prefix_len, cond_layout.target_tokens)
            for i in range(total):
                latents, step_paths = _denoise_step(engine, req, run, controlled if active[i] else prefixes, latents,
                                                    i, reporter, cache)
                paths += step_paths
                watch.after_step(i + 1, latents)
                reporter.progress(i + 1, total, lambda: unpack(latents, height, width))
                if i + 1 < total:
                    _stop_if_asked(should_stop, i + 2, total)
            watch.finish()
        finally:
            for prefix in (*prefixes.values(), *controlled.values()):
                prefix.release()
            prefixes.clear()
            controlled.clear()
            if cache is not None:
                logger.info(cache.summary())
                cache = None  # its remembered outputs go with the run, however it ended
        decode_ms = _now(device) - decode_start
        timings["decode_ms_per_step"] = decode_ms / total
        timings["decode_ms_total"] = decode_ms
        stats = engine.stats.delta(stats_before)
        stats["compiled"] = engine.compiled
        stats["compiles"] = 1 if compile_started else 0
        reporter.done(stats, timings)
        return SampleResult(unpack(latents, height, width), timings, stats, paths)


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() * 1e3
