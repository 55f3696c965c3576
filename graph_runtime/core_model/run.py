"""One sampling run of a core sampler on a KV-Graph model: the prefixes it prefilled, kept from the first model call
that needs each until the run ends, and what its model calls did.

The run owns its prefixes the way a KV-Graph Sampler run does: each is a `PrefixCache` whose owner token claims the
graph entry it decodes from, so a second run in flight with the same shapes decodes eagerly rather than share the
first one's static buffers, and `release()` frees them (and with them the ownership) when the run ends. A prefix is
found again by its content (`PrefixSource.digest`), the batch of the call and the target's latent size.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..decode import PLACEMENTS, DecodeEngine, PrefixCache, TokenLayout, check_placement
from ..decode.block_patches import joint_prefix_rows, patched_step
from ..decode.engine import check_mode
from ..errors import InputError
from ..validation import check_finite, check_positions
from .patches import CallPatches
from .prefix_source import PrefixSource

logger = logging.getLogger("kvgraph")

# What core's `cond_or_uncond` marks each chunk of a model call with: 0 for the positive, 1 for the negative.
BRANCH_NAMES = {0: "cond", 1: "uncond"}


@dataclass
class RunCounts:
    """What a run's model calls did: calls, prefills, decode steps by path, eager steps by reason, and the sigma of
    each call (kept on the device: reading it at every call would stall the host on the GPU)."""

    calls: int = 0
    prefills: int = 0
    paths: Counter = field(default_factory=Counter)
    eager: Counter = field(default_factory=Counter)
    sigmas: list = field(default_factory=list)

    def distinct_sigmas(self) -> int:
        """How many different sigmas the model was called at (a first-order sampler's step count)."""
        return len({round(float(s), 6) for s in self.sigmas})

    def describe(self) -> dict:
        return {"calls": self.calls, "prefills": self.prefills, "paths": dict(self.paths),
                "eager_steps": dict(self.eager), "distinct_sigmas": self.distinct_sigmas()}


class SamplingRun:
    """The prefixes and counts of one sampling run on `engine`'s transformer; `release()` ends it.

    `on_first_call`: a context manager factory entered before the first model call of the run and left at
    `release()` (the caller holds its LoRA set merged for exactly the run's model calls this way).
    """

    def __init__(self, engine: DecodeEngine, decode_mode: str = "auto", on_first_call=None, control=None,
                 placement: str = "gpu"):
        """`control`: a ControlNet on the model (graph_runtime/controlnet `ControlSpec`), or None. `placement`:
        where the run's prefixes keep their K/V (decode/prefix_store.py; `prefix_options.py` reads it off the MODEL)."""
        self.engine = engine
        self.control = control
        self.mode = check_mode(decode_mode)
        self.placement = check_placement(placement, choices=PLACEMENTS)
        self.counts = RunCounts()
        self._prefixes: dict[tuple, PrefixCache] = {}
        self._graph_names: dict[tuple, str] = {}  # (branch, batch, layout signature) -> digest using that name
        self._on_first_call = on_first_call
        self._held = contextlib.ExitStack()
        self._started = False
        self.released = False
        # Core's multi-GPU batching may call from worker threads; one run's bookkeeping is changed under this lock.
        self._lock = threading.RLock()

    def __enter__(self) -> "SamplingRun":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def start(self) -> None:
        """Before a model call: enter `on_first_call` the first time."""
        with self._lock:
            if self.released:
                raise RuntimeError("KV-Graph: a model call arrived after its sampling run ended")
            if not self._started:
                self._started = True
                if self._on_first_call is not None:
                    self._held.enter_context(self._on_first_call())

    def controlled(self, sigma: torch.Tensor) -> bool:
        """Whether a call at `sigma` runs the run's ControlNet (inside its start/end range)."""
        return self.control is not None and self.control.active(float(sigma.reshape(-1)[0]))

    def prefix(self, source: PrefixSource, roles, target_shape: tuple[int, int], hidden: torch.Tensor,
               timestep: torch.Tensor, controlled: bool = False, skip: frozenset = frozenset()) -> PrefixCache:
        """The prefix of `source` for a call of `hidden`'s batch and a `target_shape` (h, w) latent, prefilled on the
        first call that needs it. `roles`: core's `cond_or_uncond` for the call's chunks (names the graph entry).
        `controlled`: the prefix with the run's ControlNet (its rows differ from the plain prefix's, see
        graph_runtime/controlnet/stream.py), kept beside the plain one when the net acts on some steps only.
        `skip`: blocks left out (a skip-layer guidance pass): a prefix of its own, with its own graph entry."""
        batch = hidden.shape[0]
        key = (source.digest, batch, target_shape, controlled, skip)
        with self._lock:
            cached = self._prefixes.get(key)
            if cached is not None:
                return cached
            prefix = self._prefill(source, roles, target_shape, hidden, timestep, controlled, skip)
            self._prefixes[key] = prefix
            self.counts.prefills += 1
            return prefix

    def _prefill(self, source, roles, target_shape, hidden, timestep, controlled=False,
                 skip=frozenset()) -> PrefixCache:
        engine = self.engine
        layout, embeds, text_mask, joint = self.joint_inputs(source, target_shape, hidden)
        branch = self._graph_name(source, roles, hidden.shape[0], layout, skip)
        # Only a skipping or controlled prefix passes `skip` / `control`: an engine's own prefill (sequence
        # parallelism) need not know them.
        extra = {"skip": skip} if skip else {}
        if controlled:
            extra["control"] = self.control.for_branch(engine.transformer, hidden.shape[0], *target_shape)
        if self.placement != "gpu":
            extra["placement"] = self.placement
        _, prefix = engine.prefill(layout, joint, embeds, timestep, text_mask, branch=branch, mode=self.mode,
                                   with_target=False, **extra)
        return prefix

    def patched_step(self, source: PrefixSource, target_shape, hidden: torch.Tensor, timestep: torch.Tensor,
                     patches: CallPatches, latent=None) -> torch.Tensor:
        """One eager step over the whole joint sequence with `patches`' Python patches (their prefix rows may
        change, so no cached prefix serves it): the target's prediction `[B, T, C]`."""
        layout, embeds, text_mask, joint = self.joint_inputs(source, target_shape, hidden)
        references = joint[:, :joint.shape[1] - hidden.shape[1]]
        rows = joint_prefix_rows(self.engine.transformer, layout, references, embeds)
        return patched_step(self.engine.transformer, rows, layout, hidden, timestep, layout.joint_key_valid(text_mask),
                            patches.python, latent=latent, skip=patches.skip)

    def joint_inputs(self, source: PrefixSource, target_shape, hidden: torch.Tensor):
        """`(layout, embeds, text_mask, joint latents)` of `source` for a call of `hidden` (checked)."""
        batch, device, dtype = hidden.shape[0], hidden.device, hidden.dtype
        transformer = self.engine.transformer
        channels = transformer.config.in_channels
        for i, ref in enumerate(source.references):
            if ref.dim() != 4 or ref.shape[1] != channels:
                raise InputError(f"reference latent {i}", tuple(ref.shape), f"[1, {channels}, h, w]")
            check_finite(f"reference latent {i}", ref, "NaN/inf reference latents come from the VAE's weights or "
                                                       "the reference image")
        check_finite("conditioning", source.embeds.embeds, "NaN/inf prompt embeddings come from the text encoder's "
                                                           "weights")
        img_shapes = source.reference_shapes + [(1, *target_shape)]
        check_positions(int((~source.embeds.image_mask[0].bool()).sum()), img_shapes)
        layout = TokenLayout.build(source.embeds.image_mask, img_shapes, device)
        embeds, text_mask = source.embeds_for(batch, device, dtype)
        joint = hidden
        if source.references:
            cond_tokens = torch.cat([r.to(device, dtype).flatten(2).transpose(1, 2) for r in source.references], 1)
            joint = torch.cat([cond_tokens.expand(batch, -1, -1), hidden], dim=1)
        return layout, embeds, text_mask, joint

    def _graph_name(self, source: PrefixSource, roles, batch: int, layout: TokenLayout, skip=frozenset()) -> str:
        """The branch name the prefix's graph entry is keyed on: "cond" or "uncond" as core marks the call (the names
        the KV-Graph Sampler uses, so both share their captured graphs), numbered when another prefix of this run
        already uses that name with the same shapes (each needs its own entry)."""
        kinds = {BRANCH_NAMES.get(int(r), "cond") for r in (roles or [0])}
        base = kinds.pop() if len(kinds) == 1 else "cond+uncond"
        name, number = base, 1
        while self._graph_names.setdefault((name, batch, layout.signature, skip), source.digest) != source.digest:
            number += 1
            name = f"{base}#{number}"
        return name

    def count(self, sigma: torch.Tensor, path: str, reason: str | None) -> None:
        with self._lock:
            self.counts.calls += 1
            self.counts.paths[path] += 1
            if reason is not None:
                self.counts.eager[reason] += 1
            self.counts.sigmas.append(sigma.detach().reshape(-1)[0])

    def release(self) -> None:
        """End the run: free every prefix (so their graph entries are free for the next run) and leave
        `on_first_call`. Safe to call more than once."""
        with self._lock:
            if self.released:
                return
            self.released = True
            prefixes = list(self._prefixes.values())
            self._prefixes.clear()
        try:
            for prefix in prefixes:
                prefix.release()
        finally:
            self._held.close()
