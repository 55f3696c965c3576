"""Ulysses sequence parallelism for the decode step and the prefix pass.

Each rank of a sequence-parallel group keeps a contiguous share of the rows (the image's tokens in a decode step,
the prefix's in the prefix pass) through every per-token part of a block: norms, modulation, projections, MLP. For
attention, one all-to-all trades rows for heads: a rank then holds every row of its share of the heads (rank i of
n: heads i*H/n .. (i+1)*H/n - 1), attends over the whole sequence, and a second all-to-all trades back. The prefix
K/V a rank keeps are its heads' only: written by the prefix pass after its own exchange, read by every decode step
of those heads. Rows are split as `torch.tensor_split` does, so any token count works; heads must divide evenly.

The step's input and output stay whole-sequence (`[B, T, C]`): the step slices its rows and gathers the rows'
predictions back, so the graph entries, the sampling loop and the Euler update are the one-device ones. In a
captured graph both exchanges and the gather are NCCL kernels of the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

import torch

from ..decode.step import DecodeStep, TargetDecodeBlock
from .comm import Comm
from .plan import row_counts, row_slice


class UlyssesExchange:
    """The all-to-alls and the row gather of one sequence-parallel group (`comm` None: a group of one, which
    exchanges nothing). `begin(total)` sets the row split of the pass about to run."""

    def __init__(self, comm: Comm | None):
        self.comm = comm
        self.size = 1 if comm is None else comm.size
        self.rank = 0 if comm is None else comm.rank
        self.counts = [0]
        self._rehearsing = False

    def begin(self, total: int) -> slice:
        """This pass has `total` rows: returns this rank's."""
        self.counts = row_counts(total, self.size)
        return row_slice(total, self.size, self.rank)

    @contextlib.contextmanager
    def rehearsal(self):
        """Collectives inside fill their outputs with zeros instead of talking to the peers: what a graph's warm-up
        runs, so that every rank runs each step's collectives exactly once whichever path (capture, replay, eager)
        its step takes."""
        self._rehearsing, before = True, self._rehearsing
        try:
            yield
        finally:
            self._rehearsing = before

    def _all_to_all(self, out, inp, out_splits, in_splits) -> None:
        if self._rehearsing:
            out.zero_()
        else:
            self.comm.all_to_all(out, inp, out_splits, in_splits)

    def to_heads(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`[B, S_r, H, D]` tensors of this rank's rows -> `[B, S, H/n, D]` of every row, this rank's heads; one
        all-to-all for all of them."""
        n = self.size
        if n == 1:
            return xs
        batch, rows, heads, dim = xs[0].shape
        share, m = heads // n, len(xs)
        send = xs[0].new_empty((n, m, batch, rows, share, dim))
        for i, x in enumerate(xs):
            send[:, i].copy_(x.reshape(batch, rows, n, share, dim).permute(2, 0, 1, 3, 4))
        piece = m * batch * share * dim
        out_splits = [piece * c for c in self.counts]
        recv = xs[0].new_empty(sum(out_splits))
        self._all_to_all(recv, send.view(-1), out_splits, [piece * rows] * n)
        if len(set(self.counts)) == 1:
            full = recv.view(n, m, batch, rows, share, dim).permute(1, 2, 0, 3, 4, 5).reshape(m, batch, -1, share,
                                                                                                dim)
        else:
            parts = [p.view(m, batch, c, share, dim) for p, c in zip(recv.split(out_splits), self.counts)]
            full = torch.cat(parts, dim=2)
        return tuple(full.unbind(0))

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """`[B, S, H/n, D]` (every row, this rank's heads) -> `[B, S_r, H, D]` (this rank's rows, every head)."""
        n = self.size
        if n == 1:
            return out
        batch, _, share, dim = out.shape
        rows = self.counts[self.rank]
        send = out.permute(1, 0, 2, 3).contiguous().view(-1)  # row-major, so each destination's rows are one run
        piece = batch * share * dim
        recv = out.new_empty(n * rows * piece)
        self._all_to_all(recv, send, [piece * rows] * n, [piece * c for c in self.counts])
        return recv.view(n, rows, batch, share, dim).permute(2, 1, 0, 3, 4).reshape(batch, rows, n * share, dim)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, S_r, C]` of this rank's rows -> `[B, S, C]` of every row, on every rank of the group."""
        if self.size == 1:
            return x
        longest = max(self.counts)
        padded = x if x.shape[1] == longest else torch.nn.functional.pad(x, (0, 0, 0, longest - x.shape[1]))
        padded = padded.contiguous()
        if self._rehearsing:
            parts = [torch.zeros_like(padded) for _ in range(self.size)]
        else:
            parts = self.comm.all_gather(padded)
        return torch.cat([p[:, :c] for p, c in zip(parts, self.counts)], dim=1)


class UlyssesDecodeBlock(TargetDecodeBlock):
    """A decode block whose attention runs over the group's whole sequence for a share of the heads."""

    def __init__(self, block, kernels: bool = True, *, exchange: UlyssesExchange):
        super().__init__(block, kernels)
        self.exchange = exchange

    def attend(self, q, k, v, cos, sin, k_cache, v_cache, prefix_len: int, static_kv: bool, attn_mask,
               kv_only: bool = False):
        exchange = self.exchange
        if exchange.size == 1:
            return super().attend(q, k, v, cos, sin, k_cache, v_cache, prefix_len, static_kv, attn_mask, kv_only)
        # Norm and RoPE are per row and per head: they run on this rank's rows, before the exchange (the same
        # choice of kernel as one device makes, so the rows round the same way).
        if static_kv and self._can_fuse_qk():
            k_rows, v_rows = torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(v)
            q = self.norm_rope_write(q, k, v, cos, sin, k_rows, v_rows, 0)
            k, v = k_rows, v_rows
        else:
            q, k = self.norm_rope(q, k, v, cos, sin)
        if kv_only:
            k, v = exchange.to_heads(k, v)
        else:
            q, k, v = exchange.to_heads(q, k, v)
        keys, values = self.keep_kv(k, v, k_cache, v_cache, prefix_len, static_kv)
        if kv_only:
            return None
        return exchange.to_sequence(self.attention(q, keys, values, attn_mask))


class UlyssesDecodeStep(DecodeStep):
    """The decode step (and prefix pass) of one rank of a sequence-parallel group. `parallel_key` goes into this
    rank's graph keys (plan.ParallelPlan.key)."""

    def __init__(self, transformer, exchange: UlyssesExchange, parallel_key: tuple, kernels: bool = True):
        super().__init__(transformer, kernels, block_factory=partial(UlyssesDecodeBlock, exchange=exchange))
        self.exchange = exchange
        self._parallel_key = parallel_key
        heads = transformer.config.num_attention_heads
        if heads % exchange.size:
            raise ValueError(f"{heads} attention heads do not split over {exchange.size} ranks")

    @property
    def kv_heads(self) -> int:
        return self.model.config.num_attention_heads // self.exchange.size

    def parallel_key(self) -> tuple:
        return self._parallel_key

    def forward(self, inputs):
        rows = self.exchange.begin(inputs.hidden.shape[1])
        local = dataclasses.replace(inputs, hidden=inputs.hidden[:, rows], cos=inputs.cos[rows],
                                    sin=inputs.sin[rows])
        return self.exchange.gather_rows(super().forward(local))

    def run_prefix(self, inputs) -> None:
        rows = self.exchange.begin(inputs.hidden.shape[1])
        super().run_prefix(dataclasses.replace(inputs, hidden=inputs.hidden[:, rows], cos=inputs.cos[rows],
                                               sin=inputs.sin[rows]))


class RehearsingBackend:
    """A capture backend (`inner`, by default CUDA graphs) whose warm-up runs rehearse the group's collectives.

    A captured graph's collectives run when it replays, not while it is captured; the warm-ups before a capture run
    the body eagerly. Rehearsed, they send nothing, so a rank that captures a step runs its collectives exactly as
    often as a rank that replays or decodes it eagerly, and the ranks never disagree on what to exchange even when
    one of them cannot capture (out of memory, an evicted entry) and the others can.
    """

    def __init__(self, inner, exchange: UlyssesExchange):
        self.inner, self.exchange = inner, exchange
        self._capturing = False
        self.name = getattr(inner, "name", "cuda-graph")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def capture(self, entry, body) -> None:
        def once(inputs):
            if self._capturing and not _stream_capturing():
                with self.exchange.rehearsal():
                    return body(inputs)
            return body(inputs)

        self._capturing = True
        try:
            self.inner.capture(entry, once)
        finally:
            self._capturing = False

    def replay(self, entry):
        return self.inner.replay(entry)


def _stream_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
