"""One rank's decode engine under one parallel plan: what the sampling loop drives on every rank.

It has the face the sampling loop uses (`prefill`, `decode_all`, `stats`, ...), so every rank runs the same
`sampling.sample` on the same request: the same schedule, noise and Euler updates, in step. Inside, a one-device
`DecodeEngine` with a Ulysses step keeps this rank's graph entries (keys carrying the plan, world size and rank),
and under CFG parallelism the two branches' predictions are exchanged once per step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..decode import DecodeEngine, DecodeOutcome, PrefixCache
from ..decode.capture import CudaGraphBackend
from .comm import Comm
from .plan import BRANCHES, ParallelPlan
from .ulysses import RehearsingBackend, UlyssesDecodeStep, UlyssesExchange

logger = logging.getLogger("kvgraph")

# A branch that another CFG group computes: the path its outcomes report on this rank.
REMOTE = "remote"


class PeerLost(RuntimeError):
    """A peer rank stopped answering (or reported a failure) while this rank waited on the device."""


@dataclass
class RemoteBranch:
    """Stands, in the sampling loop's prefix dict, for a branch another CFG group prefilled and decodes."""

    branch: str

    def release(self) -> None:
        pass


class DeviceWatch:
    """Waits, with a deadline, for the device to finish what a step enqueued.

    A graph replay's collectives never pass through NCCL's watchdog, so a peer that died mid-step would leave this
    rank's next synchronize waiting forever. Instead the device's progress is polled up to the collective timeout,
    asking `health()` (which raises `PeerLost`) between polls; the caller then aborts the groups. On CPU the gloo
    collectives themselves time out, and this does nothing.
    """

    POLL_S = 0.0005

    def __init__(self, device: torch.device, timeout_s: float, health=None):
        self.device, self.timeout_s, self.health = torch.device(device), timeout_s, health

    def wait(self, what: str) -> None:
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout_s
        checked = time.monotonic()
        while not event.query():
            now = time.monotonic()
            if now > deadline:
                raise PeerLost(f"{what} did not finish within {self.timeout_s:.0f} s (KVGRAPH_PARALLEL_TIMEOUT): a "
                               "peer rank stopped answering")
            if self.health is not None and now - checked > 0.5:
                self.health()
                checked = now
            time.sleep(self.POLL_S)


class ParallelEngine:
    """Rank `rank`'s engine for `plan`, over its groups' `sp` (sequence) and `cfg` (pair) communicators.

    `backend`: the capture backend inside (default CUDA graphs; tests pass a recording one), wrapped so that warm-ups
    rehearse the collectives. `watch`: waits on the device after each prefill and step.
    """

    def __init__(self, transformer, plan: ParallelPlan, rank: int, sp: Comm | None, cfg: Comm | None,
                 backend=None, watch: DeviceWatch | None = None, max_entries: int = 4, kernels: bool = True):
        self.plan, self.rank = plan, rank
        self.exchange = UlyssesExchange(sp)
        step = UlyssesDecodeStep(transformer, self.exchange, plan.key(rank), kernels=kernels)
        inner = backend if backend is not None else CudaGraphBackend()
        self.local = DecodeEngine(transformer, max_entries=max_entries,
                                  backend=RehearsingBackend(inner, self.exchange), step=step)
        self.cfg = cfg
        self.watch = watch
        self._placement_said = False

    # What the sampling loop reads of an engine.
    @property
    def transformer(self):
        return self.local.transformer

    @property
    def stats(self):
        return self.local.stats

    @property
    def compiled(self) -> bool:
        return self.local.compiled

    def enable_compile(self) -> bool:
        return self.local.enable_compile()

    def status(self) -> dict:
        return self.local.status()

    def release(self) -> dict:
        return self.local.release()

    def prefill(self, layout, latents, encoder_hidden_states, timestep, text_mask=None, branch="cond", mode="auto",
                with_target=False, control=None, placement="gpu") -> tuple[None, PrefixCache | RemoteBranch]:
        """This rank's share of `branch`'s prefix pass, or a `RemoteBranch` when another CFG group runs it.
        `control` is the single-device engine's argument: a ControlNet is refused before sampling on several devices.
        `placement`: each rank keeps its share of the heads' prefix K/V on its GPU (the Ulysses step reads no prefix
        store), so another placement falls back to that, logged once."""
        if control is not None:
            raise ValueError("a ControlNet's prefix pass runs on one device")
        if placement != "gpu" and not self._placement_said:
            self._placement_said = True
            logger.warning("KV-Graph: prefix placement %s is for one GPU; on several, each rank keeps its share of "
                           "the prefix K/V on its GPU.", placement)
        if with_target:
            raise ValueError("a parallel prefill runs the prefix rows only (with_target=False)")
        if branch not in self.plan.branches(self.rank, BRANCHES):
            return None, RemoteBranch(branch)
        out = self.local.prefill(layout, latents, encoder_hidden_states, timestep, text_mask, branch=branch,
                                 mode=mode, with_target=False)
        self._wait(f"the {branch} prefill")
        return out

    @torch.no_grad()
    def decode_all(self, prefixes: dict, hidden: torch.Tensor, timestep: torch.Tensor,
                   mode: str = "auto") -> dict[str, DecodeOutcome]:
        """Every branch's prediction for this step, on every rank: this rank's branches decoded (its rows, gathered
        over its sequence group), the other CFG group's received in one exchange."""
        mine = {name: p for name, p in prefixes.items() if not isinstance(p, RemoteBranch)}
        outcomes = self.local.decode_all(mine, hidden, timestep, mode)
        if self.cfg is not None and len(mine) < len(prefixes):
            (name, outcome), = outcomes.items()
            predictions = self.cfg.all_gather(outcome.output.contiguous())
            outcomes = {branch: outcome if branch == name else DecodeOutcome(predictions[group], REMOTE, None)
                        for group, branch in enumerate(BRANCHES) if branch in prefixes}
        self._wait("a decode step")
        return outcomes

    def _wait(self, what: str) -> None:
        if self.watch is not None:
            self.watch.wait(what)
