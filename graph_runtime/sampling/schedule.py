"""Sigma schedules: diffusers' flow-match Euler scheduler computes them, so they equal the reference pipeline's."""

from __future__ import annotations

import math

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ..errors import InputError
from ..validation import VAE_SCALE, check_denoise

# Qwen-Image-2.1 Turbo's fixed 8-step grid.
TURBO_SIGMAS = (1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568)
SIGMA_PRESETS = ("dynamic", "turbo")

# Used when a model comes without a scheduler config (ComfyUI single files): Qwen-Image's flow-match settings.
DEFAULT_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential",
}


def resolve_sigmas(preset: str | None, steps: int, sigmas=None) -> list[float] | None:
    """Explicit sigmas win; 'turbo' is the fixed grid; 'dynamic' (None) lets the pipeline's default apply."""
    if sigmas is not None:
        expected = "a non-empty, strictly decreasing list of values in (0, 1]"
        try:
            values = [float(s) for s in sigmas]
        except (TypeError, ValueError):
            raise InputError("sigmas", sigmas, expected) from None
        if (not values or any(not (0.0 < s <= 1.0) for s in values)
                or any(a <= b for a, b in zip(values, values[1:]))):
            raise InputError("sigmas", sigmas, expected)
        return values
    if preset in (None, "dynamic"):
        return None
    if preset == "turbo":
        return list(TURBO_SIGMAS)
    raise InputError("sigma preset", preset, f"one of {', '.join(SIGMA_PRESETS)}")


def fixed_grid_scheduler_config(scheduler_config: dict | None) -> dict:
    """A scheduler config under which an explicit sigma grid is used exactly as given.

    ComfyUI's Qwen-Image-2.1 Turbo templates feed the 8 Turbo sigmas (then 0) straight to the sampler
    (ManualSigmas: no shift): the grid is the schedule the Turbo checkpoint was distilled for. diffusers' scheduler
    with the base model's config would shift them again by the resolution-dependent mu and stretch the last one to
    `shift_terminal` (0.414568 -> 0.02), a different schedule."""
    config = dict(scheduler_config or {})
    config.update(use_dynamic_shifting=False, shift=1.0, shift_terminal=None, use_karras_sigmas=False,
                  use_exponential_sigmas=False, use_beta_sigmas=False, invert_sigmas=False)
    return config


def scheduler_config_for(preset: str | None, scheduler_config: dict | None) -> dict | None:
    """The scheduler config a preset samples under: the Turbo grid runs unshifted (as ComfyUI's Turbo templates run
    it), everything else under the model's own config."""
    return fixed_grid_scheduler_config(scheduler_config) if preset == "turbo" else scheduler_config


def _set_timesteps(config: dict, sigmas, image_seq_len: int, device="cpu") -> FlowMatchEulerDiscreteScheduler:
    """A scheduler set to `sigmas`, shifted for `image_seq_len` target tokens as the pipeline shifts them."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(sigmas=sigmas, device=device, mu=_shift(config, image_seq_len))
    return scheduler


def _finite(config: dict, sigmas, image_seq_len: int) -> bool:
    with np.errstate(all="ignore"):  # the overflow is the answer here, not a warning
        return bool(torch.isfinite(_set_timesteps(config, sigmas, image_seq_len).sigmas).all())


def _refusal(config: dict, sigmas, image_seq_len: int, latent_size, explicit: bool) -> InputError:
    """Why a schedule came out non-finite. The resolution-dependent shift grows with the image: past some size it
    rounds every sigma to 1 in float32 and the terminal stretch then divides by zero. When a smaller image gets a
    finite schedule from the same sigmas, the size is named with the largest size that works; else the sigmas."""
    if not _finite(config, sigmas, 1):
        return InputError("sigmas", [float(s) for s in sigmas], "a schedule the flow-match scheduler maps to finite "
                                                                  "sigmas")
    good, bad = 1, image_seq_len
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if _finite(config, sigmas, middle) else (good, middle)
    side = math.isqrt(good) * VAE_SCALE
    value = f"{image_seq_len} latent tokens"
    if latent_size is not None:
        value = f"{latent_size[1] * VAE_SCALE}x{latent_size[0] * VAE_SCALE} px ({value})"
    grid = "these sigmas" if explicit else f"{len(sigmas)} steps"
    return InputError("image size", value, f"at most {good} latent tokens (about {side}x{side} px) with {grid}: beyond "
                                           "that the scheduler's resolution-dependent shift rounds the sigmas to 1, "
                                           "leaving nothing to denoise")


def build_schedule(scheduler_config: dict | None, steps: int, image_seq_len: int, sigmas=None, denoise: float = 1.0,
                   device="cpu", latent_size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(timesteps [N], sigmas [N + 1])` exactly as `QwenImage21Pipeline` computes them.

    `denoise < 1` keeps the last `steps` steps of a `round(steps / denoise)`-step schedule, as ComfyUI's samplers
    do for img2img.

    One step is the one place we differ from the pipeline on purpose. Its default grid for one step is the single
    point sigma = 1, and the scheduler's terminal stretch (`stretch_shift_to_terminal`, which rescales the schedule so
    its last point lands on `shift_terminal`) divides by `1 - last point` = 0: the pipeline then samples with
    sigma NaN and returns a NaN (black) image. A one-point schedule has no "last point before the end" to stretch,
    so here it skips the stretch: the dynamic shift still applies (it maps sigma 1 to 1), giving sigmas [1, 0], one
    Euler step from pure noise to the clean image, the first step of every longer schedule taken all the way.
    """
    denoise = check_denoise(denoise)
    config = dict(DEFAULT_SCHEDULER_CONFIG)
    config.update(scheduler_config or {})
    explicit = sigmas is not None
    if sigmas is None:
        total = steps if denoise >= 1.0 else max(steps, int(round(steps / denoise)))
        sigmas = np.linspace(1.0, 1 / total, total)
    else:
        total = len(sigmas)
        steps = total if denoise >= 1.0 else max(1, int(round(total * denoise)))
    if float(sigmas[-1]) >= 1.0:
        config["shift_terminal"] = None
    with np.errstate(all="ignore"):  # a schedule that overflows is refused below, with its cause
        scheduler = _set_timesteps(config, sigmas, image_seq_len, device)
    timesteps, all_sigmas = scheduler.timesteps, scheduler.sigmas
    if not bool(torch.isfinite(all_sigmas).all()):
        raise _refusal(config, sigmas, image_seq_len, latent_size, explicit)
    if len(timesteps) > steps:
        timesteps, all_sigmas = timesteps[-steps:], all_sigmas[-(steps + 1):]
    return timesteps, all_sigmas


def schedule_for(preset: str | None, steps: int, image_seq_len: int, scheduler_config: dict | None,
                 denoise: float = 1.0, sigmas=None, device="cpu",
                 latent_size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(timesteps [N], sigmas [N + 1])` of a preset ("dynamic" / "turbo") or of explicit `sigmas`, for an image of
    `image_seq_len` latent tokens: what the KV-Graph Sampler samples over and what the KV-Graph Sigmas node hands
    core's samplers, so the two are one schedule."""
    grid = resolve_sigmas(preset, steps, sigmas)
    config = scheduler_config if sigmas is not None else scheduler_config_for(preset, scheduler_config)
    return build_schedule(config, steps, image_seq_len, grid, denoise, device, latent_size=latent_size)


def _shift(config: dict, image_seq_len: int) -> float:
    """The pipeline's resolution-dependent shift `mu` (diffusers' `calculate_shift`) for `config` (complete)."""
    # Imported here: the pipeline module takes seconds to import, and the pack imports this module at start-up.
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    return calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def dynamic_shift(scheduler_config: dict | None, width: int, height: int) -> float:
    """The shift `mu` of the model's dynamic schedule for a `width` x `height` px image: with the exponential time
    shift it maps sigma t to exp(mu) / (exp(mu) + 1/t - 1), which is core's `ModelSamplingFlux` at shift mu."""
    config = {**DEFAULT_SCHEDULER_CONFIG, **(scheduler_config or {})}
    return _shift(config, (height // VAE_SCALE) * (width // VAE_SCALE))


def model_timestep(timesteps: torch.Tensor, dtype) -> torch.Tensor:
    """Schedule timesteps (0..1000) as the transformer takes them: rounded to the model's dtype at the 0..1000 scale,
    then divided, as `QwenImage21Pipeline` does; so the same sigma gives the same timestep bits on every path."""
    return timesteps.to(dtype) / 1000


def sigma_timestep(sigma: torch.Tensor, dtype) -> torch.Tensor:
    """A sigma (what core samplers pass a model) as the transformer's timestep: the scheduler's timestep is
    `sigma * 1000` in float32, then `model_timestep`."""
    return model_timestep(sigma.float() * 1000, dtype)


def euler_step(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor):
    """Flow-match Euler, upcast to fp32 for the update and cast back, as diffusers' scheduler steps."""
    return (latents.float() + (sigma_next - sigma) * velocity).to(velocity.dtype)


def flow_percent_to_sigma(percent: float, shift: float) -> float:
    """The sigma at `percent` of a flow-matching model's sigma range under the exponential time shift `shift`: how
    ComfyUI's flow model sampling (`ModelSamplingFlux.percent_to_sigma`) maps the start/end percents of ControlNets
    and step caches, so the same settings cover the same sigmas on the KV-Graph Sampler and on core samplers."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    t = 1.0 - percent
    return math.exp(shift) / (math.exp(shift) + (1.0 / t - 1.0))
