"""The decode package's one face: `prefill`, `decode_step` and `release` for one loaded transformer.

A request runs `prefill` once (claim a graph entry, run the prefix pass into its buffers, bind the prefix), then
`decode_step` for every step, then its prefix's `release()`. Each step's path reads top to bottom in
`decode_step`: the mode, the model guard's verdict (`eligibility.py`), a replay from the request's graph entry
(`graphs.py`, which owns the entries, their owners and the lock), and otherwise an eager step whose reason is
counted and logged once. `step.py` is the body that runs (eagerly or captured); docs/decode.md draws the flow.

The loaded model's owner (graph_runtime/loaded.py) holds the engine, so the compiled blocks and the captured graphs
survive from one generation to the next as long as the model stays loaded.
"""

from __future__ import annotations

import logging
import weakref
from typing import NamedTuple

import torch

from ..errors import InputError
from . import eligibility as why
from . import step as step_body
from .capture import CudaGraphBackend, EntrySpec, entry_kv_format
from .eligibility import ModelGuard, Verdict
from .graphs import DecodeGraphs, make_key
from .layout import TokenLayout
from .block_patches import BlockPatches, joint_prefix_rows, patched_step
from .prefill import OwnerToken, PrefixCache, run_prefill
from .prefix_store import GPU, PLACEMENTS, RECOMPUTE, STORED, PrefixStore, check_placement
from .stats import DecodeStats, LoggedOnce
from .step import DecodeInputs, DecodeStep, PrefixInputs, rope_tables
from .warm_up import warm_up

logger = logging.getLogger("kvgraph")

DECODE_MODES = ("auto", "graph", "eager")


class DecodeOutcome(NamedTuple):
    output: torch.Tensor
    path: str  # "replay", "capture" (captured then replayed) or "eager"
    reason: str | None  # why eager, else None


def check_mode(mode: str) -> str:
    if mode not in DECODE_MODES:
        raise ValueError(f"decode mode {mode!r} is invalid: expected one of {', '.join(DECODE_MODES)}")
    return mode


class DecodeEngine:
    """`backend`: how graphs are captured and replayed (default: CUDA graphs; tests inject a recording one, which
    runs the whole policy on CPU). `kernels=False`: the step body without the hand-written kernels. `step`: the
    step body (default a `DecodeStep` of `transformer`; sequence parallelism passes its own). `attention`: the step's
    attention kernel, "auto" (FlashAttention-3 where it runs), "sdpa", "fa3" or "fp8" (attention.py; "fp8" keeps
    e4m3 K/V in the graph entries, kv_format.py)."""

    def __init__(self, transformer: torch.nn.Module, max_entries: int = 4, backend=None, kernels: bool = True,
                 step: DecodeStep | None = None, attention: str = "auto"):
        self._transformer = weakref.ref(transformer)
        backend = backend if backend is not None else CudaGraphBackend()
        self.stats = DecodeStats()
        self.graphs = DecodeGraphs(type(transformer).__name__, backend, self.stats, max_entries)
        self.guard = ModelGuard(transformer, backend)
        self.step = step if step is not None else DecodeStep(transformer, kernels=kernels, attention=attention)
        # The attention kernel chosen per device, and its fallbacks, are counted with the other fallbacks.
        self.stats.attention_choice = self.step.attention
        self.compiles = 0
        self._said = LoggedOnce()  # notes (not fallbacks) logged once per engine

    @property
    def transformer(self):
        return self._transformer()

    @property
    def name(self) -> str:
        """The model's class name, as status reports it."""
        return self.graphs.name

    @property
    def compiled(self) -> bool:
        return bool(self.step.compiled)

    def enable_compile(self) -> bool:
        """Compile the blocks once per loaded model (lazily: the first decode of each shape compiles).

        Only on CUDA: on CPU the compile costs more than it saves and needs a C++ toolchain. Returns True when
        this call set the compile up.
        """
        if self.step.compiled:
            return False
        devices = {p.device for p in self.transformer.parameters()}
        if any(device.type != "cuda" for device in devices):
            # A streamed model (a partial load) included: its steps run eagerly anyway, and compiled blocks would
            # see their weights change device from call to call.
            logger.info("KV-Graph: block compile skipped: the model's weights are on %s, not all on CUDA.",
                        ", ".join(sorted(map(str, devices))))
            return False
        self.step.compile_blocks()
        self.compiles += 1
        return True

    # -- prefill ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, layout: TokenLayout, latents, encoder_hidden_states, timestep, text_mask=None,
                branch="cond", mode="auto", with_target=True, control=None,
                skip: frozenset = frozenset(), placement: str = GPU) -> tuple[torch.Tensor | None, PrefixCache]:
        """Step 1. When this request can own a graph entry, the prefix goes straight into its static buffers.

        `with_target=False` (what the sampler does) runs only the prefix rows and returns no prediction; the caller
        then predicts step 1 with `decode_step`, like every later step, so step 1 replays the graph too: a
        prefix-only forward plus one graph step instead of an eager forward over the whole joint sequence, for the
        same math.

        `control`: a ControlNet for this branch (graph_runtime/controlnet `ControlledPrefix`, prefix pass only): its
        `run(step, inputs)` is the prefix pass, and the per-block residuals it returns ride on the prefix for the
        decode steps, which then have graph entries of their own. `skip`: blocks left out of the prefix and of every
        decode step over it (a skip-layer guidance pass); such a prefix has its own graph entry.

        `placement`: where the prefix K/V live (prefix_store.py): "gpu", "int8", "host" (both prefix pass only) or
        "recompute" (no prefix pass: every decode step runs the whole joint sequence). A ControlNet's prefix stays on
        the GPU (its pass runs the control stream beside the blocks).
        """
        if control is not None and with_target:
            raise ValueError("a ControlNet prefill runs the prefix rows only (with_target=False)")
        if control is not None and skip:
            # The control stream's prefix pass runs every base block beside its own.
            raise InputError("model", "SkipLayerGuidance together with a ControlNet",
                             "one of the two on a KV-Graph model (the ControlNet's stream runs every block)")
        placement = self._placement_for(check_placement(placement, choices=PLACEMENTS), control)
        self.stats.prefix_placements[placement] += 1
        if placement == RECOMPUTE:
            return self._recompute_prefill(layout, latents, encoder_hidden_states, timestep, text_mask, branch,
                                           with_target, skip)
        token = OwnerToken()
        entry = self._claim(token, branch, layout, latents.shape[0], layout.joint_key_valid(text_mask), mode,
                            control, skip, placement)
        store = None
        if placement in STORED:
            store = entry.store if entry is not None else self._own_store(placement, layout, latents)
            logger.info("KV-Graph: %s prefix K/V of %d tokens (%s): %.2f GiB on %s, %.2f GiB pinned on the host.",
                        placement, layout.prefix_len, branch, store.device_bytes / 2**30, store.device,
                        store.host_bytes / 2**30)
        static_kv = None if entry is None or store is not None else entry.prefill_kv()
        runner = self.step.run_prefix if entry is None else (lambda inputs: self._prefix_pass(entry, inputs))
        if store is not None:
            runner = self._stored_prefix_pass
        residuals = []
        if control is not None:
            runner = lambda inputs: residuals.append(self._controlled_prefix_pass(control, inputs))  # noqa: E731
        out, prefix = run_prefill(self.transformer, layout, latents, encoder_hidden_states, timestep, text_mask,
                                  branch, static_kv=static_kv, with_target=with_target, prefix_runner=runner,
                                  kv_heads=self.step.kv_heads, skip=skip, store=store)
        prefix.owner = token
        prefix.residuals = residuals[0] if residuals else None
        if entry is not None:
            self.graphs.bind(entry, prefix)
        return out, prefix

    def _placement_for(self, placement: str, control) -> str:
        if control is not None and placement != GPU:
            if self._said.first("controlnet-prefix-on-gpu"):
                logger.info("KV-Graph: a ControlNet's prefix stays on the GPU (prefix placement %s is for prefixes "
                            "without one).", placement)
            return GPU
        return placement

    def _own_store(self, placement: str, layout: TokenLayout, latents) -> PrefixStore:
        """A request's own int8 or host prefix, where it holds no graph entry (its steps decode eagerly)."""
        spec = self._entry_spec(layout, latents.shape[0], placement=placement)
        return PrefixStore(placement, spec.batch, spec.prefix_len, spec.target_tokens, spec.heads, spec.head_dim,
                           spec.num_blocks, latents.dtype, latents.device)

    def _stored_prefix_pass(self, inputs: PrefixInputs) -> None:
        """An int8 or host prefix's pass: eager (each block's rows are stashed as they are written), counted."""
        if self.graphs.count_eager(why.STORED_PREFIX_PASS, prefill=True):
            logger.info("KV-Graph: prefix pass runs eagerly: %s.", why.STORED_PREFIX_PASS)
        self.step.run_prefix(inputs)

    def _recompute_prefill(self, layout, latents, encoder_hidden_states, timestep, text_mask, branch, with_target,
                           skip) -> tuple[torch.Tensor | None, PrefixCache]:
        """No prefix cache: only the prefix rows before the first block are kept (a few MB), and every decode step
        runs them with the target through every block (`_recompute_step`)."""
        model = self.transformer
        references = latents[:, :latents.shape[1] - layout.target_tokens]
        rows = joint_prefix_rows(model, layout, references, encoder_hidden_states)
        cos, sin = rope_tables(layout.rotary(model.pos_embed)[layout.prefix_len:])
        logger.info("KV-Graph: prefix placement recompute for %s (%d prefix tokens): no prefix cache; every step "
                    "runs the whole joint sequence eagerly.", branch, layout.prefix_len)
        prefix = PrefixCache(branch=branch, layout=layout, k=[], v=[], cos=cos, sin=sin,
                             key_valid=layout.joint_key_valid(text_mask), skip=frozenset(skip),
                             placement=RECOMPUTE, rows=rows)
        out = None
        if with_target:
            out = self._recompute_step(prefix, latents[:, references.shape[1]:], timestep)
        return out, prefix

    def _recompute_step(self, prefix: PrefixCache, hidden, timestep) -> torch.Tensor:
        return patched_step(self.transformer, prefix.rows, prefix.layout, hidden, timestep, prefix.key_valid,
                            BlockPatches(), skip=prefix.skip)

    def _controlled_prefix_pass(self, control, inputs: PrefixInputs):
        """A ControlNet's prefix pass: eager (once per prompt and branch), counted and logged once."""
        if self.graphs.count_eager(control.prefill_reason, prefill=True):
            logger.info("KV-Graph: prefix pass runs eagerly: %s.", control.prefill_reason)
        return control.run(self.step, inputs)

    def _claim(self, token: OwnerToken, branch: str, layout, batch: int, key_valid, mode: str, control=None,
               skip=(), placement: str = GPU):
        """The graph entry this request's prefill writes into, or None when the request will not replay
        (ineligible, owned by another live request, failed key); its decode steps then say why."""
        if check_mode(mode) == "eager":
            return None
        self.guard.new_request()
        if control is not None:
            # A controlled entry's buffers take the residuals' shapes, known only after the pass: the first decode
            # step registers it, and copies the prefix in.
            return None
        spec = self._entry_spec(layout, batch, placement=placement)
        if not self._judge(spec.dtype, key_valid).ok:
            return None
        key = make_key(self.step, branch, batch, layout, spec.dtype, spec.device, skip=skip, placement=placement)
        return self.graphs.claim(key, token, lambda: spec)

    def _entry_spec(self, layout: TokenLayout, batch: int, residuals=None, placement: str = GPU) -> EntrySpec:
        """The static buffers a graph entry of this layout and batch needs (the heads this step keeps)."""
        return EntrySpec.for_request(self.transformer, layout, batch, self.step.kv_heads, residuals,
                                     entry_kv_format(self.step, placement), placement)

    def _prefix_pass(self, entry, inputs: PrefixInputs) -> None:
        """A claimed entry's prefix pass: replayed from its captured pass when the prefix is short (a short pass is
        host-bound, so a graph pays off), else eagerly, the reason counted and logged once."""
        if not self.captures_prefix_pass(inputs.hidden.shape[1]):
            reason = why.LONG_PREFIX
        else:
            with self.step.exclusive():  # before the graphs' lock, as every streamed pass takes it
                reason = self.graphs.replay_prefix(entry, inputs, self.guard.fingerprint(), self.step.run_prefix)
            if reason is None:
                return
        if self.graphs.count_eager(reason, prefill=True):
            logger.info("KV-Graph: prefix pass runs eagerly: %s.", reason)
        self.step.run_prefix(inputs)  # outside the graphs' lock: other requests' replays need not wait

    @staticmethod
    def captures_prefix_pass(prefix_len: int) -> bool:
        """Whether a prefix of this many tokens has its pass captured (and replayed from the graph pool)."""
        return prefix_len <= step_body.SHORT_PREFIX_TOKENS

    # -- decode ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def decode_step(self, prefix: PrefixCache, hidden: torch.Tensor, timestep: torch.Tensor,
                    mode: str = "auto") -> DecodeOutcome:
        """One decode step for `prefix`'s request: replay its graph when it may, else run eagerly and say why."""
        if check_mode(mode) == "eager":
            return self._eager(prefix, hidden, timestep, why.MODE_EAGER, mode)
        if prefix.placement == RECOMPUTE:
            return self._eager(prefix, hidden, timestep, why.RECOMPUTE, mode)
        verdict = self._judge(prefix.kv_dtype, prefix.key_valid)
        if not verdict.ok:
            return self._eager(prefix, hidden, timestep, verdict.reason, mode)
        with self.step.exclusive():  # a streamed model's slots, held before the graphs' lock
            output, path, reason = self.graphs.replay(self.step, prefix, hidden, timestep, verdict.fingerprint,
                                                      lambda: self._entry_spec(prefix.layout, prefix.batch,
                                                                               prefix.residuals, prefix.placement))
        if reason is not None:
            return self._eager(prefix, hidden, timestep, reason, mode)
        return DecodeOutcome(output, path, None)

    def decode_all(self, prefixes: dict[str, PrefixCache], hidden: torch.Tensor, timestep: torch.Tensor,
                   mode: str = "auto") -> dict[str, DecodeOutcome]:
        """One step of every branch of a request (`{"cond": prefix, "uncond": prefix}`), in order. CFG parallelism
        (graph_runtime/parallel) runs the branches on different devices instead."""
        return {name: self.decode_step(prefix, hidden, timestep, mode) for name, prefix in prefixes.items()}

    def _judge(self, kv_dtype, key_valid) -> Verdict:
        """The guard's verdict, acted on: graphs captured before LoRA wrappers appeared are dropped."""
        verdict = self.guard.check(kv_dtype, key_valid)
        if verdict.drop_graphs and self.graphs.entries:
            self.graphs.drop_all_graphs()
        return verdict

    def _eager(self, prefix, hidden, timestep, reason, mode) -> DecodeOutcome:
        if self.graphs.count_eager(reason):
            loud = (mode == "graph" and reason != why.MODE_EAGER) or reason == why.RECOMPUTE
            logger.log(logging.WARNING if loud else logging.INFO, "KV-Graph: decoding eagerly: %s.", reason)
        if prefix.placement == RECOMPUTE:
            return DecodeOutcome(self._recompute_step(prefix, hidden, timestep), "eager", reason)
        attn_mask = None if prefix.key_valid is None else prefix.key_valid[:, None, None, :]
        extra = {} if prefix.residuals is None else {"block_residuals": prefix.residuals}
        k, v, static_kv = prefix.k, prefix.v, False
        if prefix.store is not None:
            # The same body a graph entry captures, over the request's own store (or its entry's).
            k, v, static_kv = prefix.store.work_k, prefix.store.work_v, True
            extra["prefix_store"] = prefix.store
        inputs = DecodeInputs(hidden=hidden, timestep=timestep, k=k, v=v, cos=prefix.cos, sin=prefix.sin,
                              prefix_len=prefix.layout.prefix_len, static_kv=static_kv, attn_mask=attn_mask,
                              skip=prefix.skip, extra=extra)
        return DecodeOutcome(self.step(inputs), "eager", reason)

    # -- before a first prompt -------------------------------------------------------------------------------------

    def warm_up(self, sizes, prompt_tokens: int = 128, capture: bool = False) -> dict:
        """Set up, before a first prompt, what decoding these latent sizes `[(height, width), ...]` runs (kernels,
        cuBLAS/cuDNN plans, buffer memory); `capture=True` also keeps the graphs of a `prompt_tokens`-token text
        prompt. See `warm_up.py`."""
        return warm_up(self, sizes, prompt_tokens=prompt_tokens, capture=capture)

    # -- reporting and release -------------------------------------------------------------------------------------

    def bytes_held(self) -> int:
        """What the entries' static buffers and graphs hold."""
        return self.graphs.bytes_held()

    def pool_bytes(self) -> int:
        """What the captured graphs hold in their private memory pool (reserved, reusable only by them)."""
        return self.graphs.pool_bytes()

    def release(self) -> dict:
        """Drop every graph and static buffer this engine holds; returns what was held."""
        return self.graphs.release()

    def status(self) -> dict:
        status = self.graphs.status()
        status.update(compiled=bool(self.step.compiled), compiles=self.compiles,
                      attention_requested=self.step.attention.requested)
        return status

