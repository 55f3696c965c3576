"""The decode package's one face: prefill and decode for one loaded transformer, with its graphs and statistics.

A request flows through it as prefill (claim an entry, run the prefix pass into its buffers, bind the prefix), then
one `decode` per step (the model guard's verdict, then replay or an eager step with a counted, logged-once reason),
then the prefix's `release()`. The engine wires the pieces together: the graph manager keeps the entries
(`graph_manager.py`), `ownership.py` who owns each, `eligibility.py` judges the model, `prefix_pass.py` runs the
prefix pass, `replay.py` replays a step, `step.py` is the step body. docs/decode.md draws the whole flow.

The loaded model's owner (graph_runtime/loaded.py) holds the engine, so the compiled blocks and the captured graphs
survive from one generation to the next as long as the model stays loaded.
"""

from __future__ import annotations

import logging
import weakref

import torch

from . import eligibility as why
from . import prefix_pass
from .eligibility import ModelGuard, Verdict
from .graph_entry import CudaGraphBackend, DecodeGraphEntry, EntrySpec
from .graph_manager import DecodeGraphManager, make_key
from .layout import TokenLayout
from .outcome import DecodeOutcome, check_mode
from .prefill import OwnerToken, PrefixCache, run_prefill
from .prefix_pass import PrefixPassRunner
from .replay import StepReplayer
from .stats import DecodeStats, LoggedOnce
from .step import DecodeInputs, DecodeStep

logger = logging.getLogger("kvgraph")


class DecodeEngine:
    """`backend`: how graphs are captured and replayed (default: CUDA graphs; tests inject a recording one, which
    runs the whole policy on CPU). `kernels=False`: the step body without the hand-written kernels. `step`: the
    step body (default a `DecodeStep` of `transformer`; sequence parallelism passes its own)."""

    def __init__(self, transformer: torch.nn.Module, max_entries: int = 4, backend=None, kernels: bool = True,
                 step: DecodeStep | None = None):
        self._transformer = weakref.ref(transformer)
        backend = backend if backend is not None else CudaGraphBackend()
        self.stats = DecodeStats()
        self.manager = DecodeGraphManager(type(transformer).__name__, backend, self.stats, max_entries)
        self.guard = ModelGuard(transformer, backend)
        self.step = step if step is not None else DecodeStep(transformer, kernels=kernels)
        self.compiles = 0
        self._logged = LoggedOnce()
        self._prefix_pass = PrefixPassRunner(self.step.run_prefix, backend, self.guard, self.stats, self._logged,
                                             self.manager.lock)
        self._replayer = StepReplayer(transformer, self.manager, self.stats)

    @property
    def transformer(self):
        return self._transformer()

    @property
    def name(self) -> str:
        """The model's class name, as status reports it."""
        return self.manager.name

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
        device = next(self.transformer.parameters()).device
        if device.type != "cuda":
            logger.info("KV-Graph: block compile skipped: the model is on %s, not CUDA.", device)
            return False
        self.step.compile_blocks()
        self.compiles += 1
        return True

    # -- prefill ---------------------------------------------------------------------------------------------------

    def prefill(self, layout: TokenLayout, latents, encoder_hidden_states, timestep, text_mask=None,
                branch="cond", mode="auto", with_target=True) -> tuple[torch.Tensor | None, PrefixCache]:
        """Step 1. When this request can own a graph entry, the prefix goes straight into its static buffers.

        `with_target=False` (what the sampler does) runs only the prefix rows and returns no prediction; the caller
        then predicts step 1 with `decode`, like every later step, so step 1 replays the graph too: at 1024x1024
        that is a 128-token forward plus one graph step instead of a 4224-token eager forward, for the same math.
        """
        token = OwnerToken()
        entry = self._claim(token, branch, layout, latents.shape[0], layout.joint_key_valid(text_mask), mode)
        static_kv = None if entry is None else (entry.inputs.k, entry.inputs.v)
        # The prefix pass of a claimed entry is captured once and replayed by later prompts with this key.
        runner = self.step.run_prefix if entry is None else (lambda inputs: self._prefix_pass.run(entry, inputs))
        out, prefix = run_prefill(self.transformer, layout, latents, encoder_hidden_states, timestep, text_mask,
                                  branch, static_kv=static_kv, with_target=with_target, prefix_runner=runner,
                                  kv_heads=self.step.kv_heads)
        prefix.owner = token
        if entry is not None:
            self._bind(entry, prefix)
        return out, prefix

    @torch.no_grad()
    def _claim(self, token: OwnerToken, branch: str, layout, batch: int, key_valid,
               mode: str) -> DecodeGraphEntry | None:
        """Reserve the entry for this request's key, so its prefill can write the prefix into the static buffers.

        Returns None when the request will not replay (ineligible, owned by another live request, failed key);
        its decode steps then say why.
        """
        if check_mode(mode) == "eager":
            return None
        self.guard.new_request()
        spec = EntrySpec.for_request(self.transformer, layout, batch, self.step.kv_heads)
        if not self._judge(spec.dtype, key_valid).ok:
            return None
        key = make_key(self.step, branch, batch, layout, spec.dtype, spec.device)
        manager = self.manager
        with manager.lock:
            entry = manager.lookup_or_register(key, lambda: spec)
            if not isinstance(entry, DecodeGraphEntry) or manager.owners.owned_by_other(key, token):
                return None
            manager.owners.claim(key, token)
            entry.forget_prefix()
            return entry

    @torch.no_grad()
    def _bind(self, entry: DecodeGraphEntry, prefix: PrefixCache) -> None:
        """After a prefill into `entry`'s buffers: the buffers hold `prefix`, and the rope tables are set."""
        with self.manager.lock:
            entry.set_rope(prefix.cos, prefix.sin)
            entry.mark_current(prefix)

    # -- decode ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, prefix: PrefixCache, hidden: torch.Tensor, timestep: torch.Tensor,
               mode: str = "auto") -> DecodeOutcome:
        """One decode step for `prefix`'s request: replay its graph when it may, else run eagerly."""
        if check_mode(mode) == "eager":
            return self._eager(prefix, hidden, timestep, why.MODE_EAGER, mode)
        verdict = self._judge(prefix.k[0].dtype, prefix.key_valid)
        reason = verdict.reason
        if verdict.ok:
            with self.manager.lock:
                outcome = self._replayer.replay(self.step, prefix, hidden, timestep, verdict.fingerprint)
            if outcome.reason is None:
                return outcome
            reason = outcome.reason
        return self._eager(prefix, hidden, timestep, reason, mode)

    def decode_all(self, prefixes: dict[str, PrefixCache], hidden: torch.Tensor, timestep: torch.Tensor,
                   mode: str = "auto") -> dict[str, DecodeOutcome]:
        """One step of every branch of a request (`{"cond": prefix, "uncond": prefix}`), in order. CFG parallelism
        (graph_runtime/parallel) runs the branches on different devices instead."""
        return {name: self.decode(prefix, hidden, timestep, mode) for name, prefix in prefixes.items()}

    def _judge(self, kv_dtype, key_valid) -> Verdict:
        """The guard's verdict, acted on: graphs captured before LoRA wrappers appeared are dropped."""
        verdict = self.guard.check(kv_dtype, key_valid)
        if verdict.drop_graphs and self.manager.entries:
            with self.manager.lock:
                self.manager.remove(list(self.manager.entries))
        return verdict

    def _eager(self, prefix, hidden, timestep, reason, mode) -> DecodeOutcome:
        with self.manager.lock:
            self.stats.eager_steps[reason] += 1
            first = self._logged.first(reason)
        if first:
            level = logging.WARNING if mode == "graph" and reason != why.MODE_EAGER else logging.INFO
            logger.log(level, "KV-Graph: decoding eagerly: %s.", reason)
        attn_mask = None if prefix.key_valid is None else prefix.key_valid[:, None, None, :]
        inputs = DecodeInputs(hidden=hidden, timestep=timestep, k=prefix.k, v=prefix.v, cos=prefix.cos,
                              sin=prefix.sin, prefix_len=prefix.layout.prefix_len, static_kv=False,
                              attn_mask=attn_mask)
        return DecodeOutcome(self.step(inputs), "eager", reason)

    # -- before a first prompt -------------------------------------------------------------------------------------

    def warm_up(self, sizes, prompt_tokens: int = 128, capture: bool = False) -> dict:
        """Set up, before a first prompt, what decoding these latent sizes `[(height, width), ...]` runs (kernels,
        cuBLAS/cuDNN plans, buffer memory); `capture=True` also keeps the graphs of a `prompt_tokens`-token text
        prompt. See `warm_up.py`."""
        from .warm_up import warm_up

        return warm_up(self, sizes, prompt_tokens=prompt_tokens, capture=capture)

    @staticmethod
    def captures_prefix_pass(prefix_len: int) -> bool:
        """Whether a prefix of this many tokens has its pass captured (and replayed from the graph pool)."""
        return prefix_len <= prefix_pass.SHORT_PREFIX_TOKENS

    # -- reporting and release -------------------------------------------------------------------------------------

    def bytes_held(self) -> int:
        """What the entries' static buffers and graphs hold."""
        return self.manager.bytes_held()

    def pool_bytes(self) -> int:
        """What the captured graphs hold in their private memory pool (reserved, reusable only by them)."""
        return self.manager.pool_bytes()

    def release(self) -> dict:
        return self.manager.release()

    def status(self) -> dict:
        status = self.manager.status()
        status.update(compiled=bool(self.step.compiled), compiles=self.compiles)
        return status

