"""The prefix pass: a request's prefix rows (text, reference images) alone through every block, each block's K/V
written into rows `0:P` of the given buffers. It runs once per prompt, before the first decode step.

Run eagerly it is about fifteen launches per block for a few hundred rows, so at a 128-token prompt the GPU waits
on the host (43 ms of host time for a few ms of kernels on the H200's host). A request with a short prefix that
claimed a graph entry therefore replays a captured prefix pass (`PrefixGraph`), captured the first time the
entry's key is prefilled: its K/V land straight in the entry's static buffers, as the eager pass's do. A long
prefix (reference images) keeps the GPU busy on its own: its replay runs no faster than the eager pass while its
capture costs a first prompt more (docs/performance.md), so it runs eagerly. `PrefixPassRunner` makes that choice
for a claimed entry, captures, replays, and counts and logs what ran.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import eligibility as why
from .capture_record import CaptureRecord

logger = logging.getLogger("kvgraph")


@dataclass
class PrefixInputs:
    """What the prefix pass reads. Everything but `hidden` and `modulation` follows from the token layout, which a
    graph entry's key pins, so a captured pass copies only those two per prompt."""

    hidden: torch.Tensor  # [B, P, D] prefix rows after txt_in / img_in
    modulation: torch.Tensor  # [B, 4D] the t = 0 row diffusers modulates prefix rows with
    cos: torch.Tensor  # [P, 1, head_dim / 2] fp32
    sin: torch.Tensor
    mask: torch.Tensor  # [B or 1, 1, P, P] bool: the prefix's block-causal mask (and valid keys)
    k: list[torch.Tensor]  # per block, [B, P, H, head_dim]: where the block's K land
    v: list[torch.Tensor]


# Up to this many prefix tokens (a text-only prompt) the pass is host-bound: it is captured and replayed, and its
# masked attention runs on the memory-efficient kernel. SDPA would pick cuDNN, which generates a kernel for every
# new prompt length: tens of milliseconds on the first prefill of each length and seconds on the first one in the
# process, for attention that is a sliver of a short pass. A long prefix (reference images) keeps cuDNN, which is
# faster there (docs/performance.md).
SHORT_PREFIX_TOKENS = 1024


def run_prefix_blocks(blocks, inputs: PrefixInputs) -> None:
    """The pass itself, over `TargetDecodeBlock`s: prefix rows are decoded like target rows with a zero timestep."""
    x = inputs.hidden
    short = x.is_cuda and x.shape[1] <= SHORT_PREFIX_TOKENS
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]) if short else contextlib.nullcontext():
        pending, last = None, len(blocks) - 1
        for i, (block, k_rows, v_rows) in enumerate(zip(blocks, inputs.k, inputs.v)):
            # Only the K/V rows are kept: the last block stops once it has written them.
            x, pending = block(x, pending, inputs.modulation, inputs.cos, inputs.sin, k_rows, v_rows, 0, True,
                               inputs.mask, kv_only=i == last)


class PrefixGraph(CaptureRecord):
    """One graph entry's captured prefix pass: static copies of the per-prompt inputs, and the graph.

    The manager's backend captures and replays it like a decode entry; the pass returns nothing (its results are
    the K/V rows). One warm-up before capture is enough: an eager pass has no state that a second call would
    settle.
    """

    def __init__(self, like: PrefixInputs):
        super().__init__()
        # Outside inference mode, so copy_ into them is legal from any grad mode (as the decode entry's buffers).
        with torch.inference_mode(False):
            self.inputs = PrefixInputs(hidden=torch.empty_like(like.hidden),
                                       modulation=torch.empty_like(like.modulation), cos=like.cos.clone(),
                                       sin=like.sin.clone(), mask=like.mask.clone(),
                                       k=list(like.k), v=list(like.v))  # own lists: a request's release clears its

    def load(self, inputs: PrefixInputs) -> None:
        self.inputs.hidden.copy_(inputs.hidden)
        self.inputs.modulation.copy_(inputs.modulation)

    @property
    def nbytes(self) -> int:
        own = (self.inputs.hidden, self.inputs.modulation, self.inputs.cos, self.inputs.sin, self.inputs.mask)
        return sum(t.numel() * t.element_size() for t in own) + self.pool_bytes


class PrefixPassRunner:
    """Runs the prefix pass of a request that claimed a graph entry: replayed from the entry's captured pass
    (captured the first time) when the prefix is short, else eagerly.

    It shares the engine's capture backend, lock (replays of one pool are serialized), statistics, logged-once
    reasons and model guard (whose fingerprint says whether a captured pass still reads the weights it was
    captured with). `run_pass(inputs)` is the pass itself (the decode step's `run_prefix`).
    """

    def __init__(self, run_pass, backend, guard, stats, logged, lock):
        self._run_pass = run_pass
        self._backend, self._guard, self._stats, self._logged, self._lock = backend, guard, stats, logged, lock

    @torch.no_grad()
    def run(self, entry, inputs: PrefixInputs) -> str:
        """The pass for `entry`'s request, whose K/V rows `inputs` points into. Returns "replay", "capture" or
        "eager"."""
        if inputs.hidden.shape[1] > SHORT_PREFIX_TOKENS:
            return self._eager(inputs, why.LONG_PREFIX)
        fingerprint = self._guard.fingerprint()
        with self._lock:
            graph = entry.prefix_graph
            if isinstance(graph, PrefixGraph) and graph.weights_fingerprint != fingerprint:
                # It reads the weights at the addresses it was captured with: recapture rather than replay stale.
                entry.prefix_graph = graph = None
            path = "replay"
            if graph is None:
                graph = self._capture(entry, inputs, fingerprint)
                path = "capture"
            if isinstance(graph, PrefixGraph):
                graph.load(inputs)
                self._backend.replay(graph)
                self._stats.prefill_replays += 1
                return path
        return self._eager(inputs, graph)  # outside the lock: other requests' replays need not wait

    def _capture(self, entry, inputs: PrefixInputs, fingerprint) -> PrefixGraph | str:
        graph = PrefixGraph(inputs)
        graph.load(inputs)
        try:
            self._backend.capture(graph, self._run_pass)
        except Exception as exc:  # noqa: BLE001 - a failed capture must end eager, not fail the prompt
            entry.prefix_graph = why.CAPTURE_FAILED  # a marker: this key's prefills stay eager
            logger.warning("KV-Graph: prefix pass capture failed for %s: %s; its prefills run eagerly.",
                           entry.key.describe(), f"{type(exc).__name__}: {exc}"[:500])
            return why.CAPTURE_FAILED
        graph.weights_fingerprint = fingerprint
        entry.prefix_graph = graph
        self._stats.prefill_captures += 1
        logger.info("KV-Graph: captured prefix pass %s in %.2f s (warm-up %.2f s)", entry.key.describe(),
                    graph.capture_seconds, graph.warmup_seconds)
        return graph

    def _eager(self, inputs: PrefixInputs, reason: str) -> str:
        self._stats.eager_prefills[reason] += 1
        if self._logged.first("prefix:" + reason):
            logger.info("KV-Graph: prefix pass runs eagerly: %s.", reason)
        self._run_pass(inputs)
        return "eager"
