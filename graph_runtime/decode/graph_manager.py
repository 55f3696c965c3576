"""The decode graph manager: one per loaded transformer, alive as long as the transformer is.

It owns the captured graphs and their static buffers, decides per step whether to replay or run eagerly, and
keeps the statistics. A second generation with the same shapes finds its entry and replays without capturing.

Ownership: the first live request to use a key owns its entry, tracked by a weak reference to the request's prefix
K of block 0. While that request is alive, another request with the same key runs eagerly (correct, and logged
once), because refreshing the static buffers would overwrite the owner's prefix mid-generation. When the owner's
cache is released the reference dies and the key is free again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from . import eligibility as why
from .graph_entry import CudaGraphBackend, DecodeGraphEntry, FailedEntry, GraphKey
from .prefill import PrefixCache
from .stats import DecodeStats
from .step import DecodeInputs, DecodeStep

logger = logging.getLogger("kvgraph")

DECODE_MODES = ("auto", "graph", "eager")


class DecodeOutcome(NamedTuple):
    output: torch.Tensor
    path: str  # "replay", "capture" (captured then replayed) or "eager"
    reason: str | None  # why eager, else None


class DecodeGraphManager:
    def __init__(self, transformer: torch.nn.Module, max_entries: int = 4, backend=None):
        import weakref

        self._transformer = weakref.ref(transformer)
        self.max_entries = max_entries
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.entries: OrderedDict[GraphKey, DecodeGraphEntry | FailedEntry] = OrderedDict()
        self._owners: dict[GraphKey, object] = {}
        self.stats = DecodeStats()
        self._logged: set[str] = set()
        # Replay + clone must be atomic: route handlers and some ComfyUI forks call in from other threads.
        self.lock = threading.RLock()
        self.name = type(transformer).__name__

    @property
    def transformer(self):
        return self._transformer()

    # -- the per-step entry point --------------------------------------------------------------------------------

    def decode(self, step: DecodeStep, prefix: PrefixCache, hidden: torch.Tensor, timestep: torch.Tensor,
               mode: str = "auto") -> DecodeOutcome:
        """One decode step for `prefix`'s request: replay its graph when it may, else run eagerly."""
        if mode not in DECODE_MODES:
            raise ValueError(f"decode mode {mode!r} is invalid: expected one of {', '.join(DECODE_MODES)}")
        reason = why.MODE_EAGER if mode == "eager" else self._graph_blocker(prefix)
        if reason is None:
            with self.lock:
                outcome = self._replay(step, prefix, hidden, timestep, mode)
            if outcome.reason is None:
                return outcome
            reason = outcome.reason
        return self._eager(step, prefix, hidden, timestep, reason, mode)

    def _graph_blocker(self, prefix: PrefixCache) -> str | None:
        transformer = self.transformer
        reason = self.backend.unavailable_reason(transformer)
        if reason is None:
            reason = why.request_reason(transformer, prefix.k[0], prefix.key_valid)
        if reason == why.LORA and self.entries:
            with self.lock:
                self._drop_all()
        return reason

    def key_for(self, step: DecodeStep, prefix: PrefixCache, hidden: torch.Tensor) -> GraphKey:
        return GraphKey(
            branch=prefix.branch,
            batch=prefix.batch,
            layout=prefix.layout.signature,
            dtype=str(hidden.dtype).removeprefix("torch."),
            device=str(hidden.device),
            backend="sdpa" + ("+compiled-blocks" if step.compiled else ""),
        )

    def _replay(self, step, prefix, hidden, timestep, mode) -> DecodeOutcome:
        key = self.key_for(step, prefix, hidden)
        entry = self.entries.get(key)
        if entry is None:
            entry = self._register(key, prefix, hidden)
        else:
            self.entries.move_to_end(key)
        if isinstance(entry, FailedEntry):
            return DecodeOutcome(None, "eager", entry.reason)

        owner = self._owners.get(key)
        owner_k = owner() if owner is not None else None
        if owner_k is not None and owner_k is not prefix.k[0]:
            return DecodeOutcome(None, "eager", why.OWNED)
        if owner_k is None:
            self._owners[key] = prefix.owner_token()
            entry.forget_prefix()

        fingerprint = _weights_fingerprint(self.transformer)
        if entry.graph is not None and entry.weights_fingerprint != fingerprint:
            # A captured graph reads weights at the addresses it was captured with: never replay it stale.
            self._drop_graphs()
            return DecodeOutcome(None, "eager", why.WEIGHTS_MOVED)

        entry.load_inputs(hidden, timestep)
        entry.refresh_prefix(prefix)
        path = "replay"
        if entry.graph is None:
            try:
                self.backend.capture(entry, step)
            except Exception as exc:  # noqa: BLE001 - any capture failure must end eager, not fail the prompt
                self._mark_failed(key, why.CAPTURE_FAILED, exc)
                return DecodeOutcome(None, "eager", why.CAPTURE_FAILED)
            entry.weights_fingerprint = fingerprint
            self.stats.captures += 1
            self.stats.capture_seconds += getattr(entry, "capture_seconds", 0.0)
            logger.info("KV-Graph: captured decode graph %s in %.2f s", key.describe(),
                        getattr(entry, "capture_seconds", 0.0))
            path = "capture"
        output = self.backend.replay(entry)
        self.stats.replays += 1
        return DecodeOutcome(output, path, None)

    def _register(self, key: GraphKey, prefix: PrefixCache, hidden: torch.Tensor):
        while len(self.entries) >= self.max_entries:
            evicted, _ = self.entries.popitem(last=False)
            self._owners.pop(evicted, None)
            self.stats.evictions += 1
            logger.debug("KV-Graph: evicted decode graph %s (max_entries=%d)", evicted, self.max_entries)
        try:
            entry = DecodeGraphEntry(key, prefix, in_channels=hidden.shape[-1], dtype=hidden.dtype)
        except torch.OutOfMemoryError as exc:
            return self._mark_failed(key, why.ALLOCATION_FAILED, exc)
        self.entries[key] = entry
        return entry

    def _mark_failed(self, key: GraphKey, reason: str, exc: BaseException) -> FailedEntry:
        # Keep a marker, not the exception: its traceback would pin the failed entry's tensors.
        marker = FailedEntry(reason, f"{type(exc).__name__}: {exc}"[:500])
        self.entries[key] = marker
        self._owners.pop(key, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.warning("KV-Graph: %s for %s: %s; this shape decodes eagerly.", reason, key.describe(), marker.detail)
        return marker

    def _eager(self, step, prefix, hidden, timestep, reason, mode) -> DecodeOutcome:
        with self.lock:
            self.stats.eager_steps[reason] += 1
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            level = logging.WARNING if mode == "graph" and reason != why.MODE_EAGER else logging.INFO
            logger.log(level, "KV-Graph: decoding eagerly: %s.", reason)
        attn_mask = None if prefix.key_valid is None else prefix.key_valid[:, None, None, :]
        inputs = DecodeInputs(hidden=hidden, timestep=timestep, k=prefix.k, v=prefix.v, cos=prefix.cos,
                              sin=prefix.sin, prefix_len=prefix.layout.prefix_len, static_kv=False,
                              attn_mask=attn_mask)
        return DecodeOutcome(step(inputs), "eager", reason)

    # -- lifecycle and reporting ---------------------------------------------------------------------------------

    def _drop_graphs(self) -> None:
        for key, entry in list(self.entries.items()):
            if isinstance(entry, DecodeGraphEntry):
                del self.entries[key]
                self._owners.pop(key, None)

    def _drop_all(self) -> None:
        self.entries.clear()
        self._owners.clear()

    def release(self) -> dict:
        """Drop every entry (graphs, static buffers, failure markers). Returns what was held."""
        with self.lock:
            held = {"entries": len(self.entries), "bytes": self.bytes_held()}
            self._drop_all()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return held

    def bytes_held(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if isinstance(e, DecodeGraphEntry))

    def status(self) -> dict:
        """A JSON-ready picture of the manager, read under its lock."""
        with self.lock:
            entries = []
            for key, entry in self.entries.items():
                owner = self._owners.get(key)
                item = {"key": key.describe()}
                if isinstance(entry, FailedEntry):
                    item.update(state="failed", reason=entry.reason, detail=entry.detail)
                else:
                    item.update(state="captured" if entry.graph is not None else "registered",
                                captures=entry.captures, replays=entry.replays, bytes=entry.nbytes,
                                owner_alive=owner is not None and owner() is not None)
                entries.append(item)
            return {"model": self.name, "entries": entries, "bytes_held": self.bytes_held(),
                    "max_entries": self.max_entries, **self.stats.snapshot()}


def _weights_fingerprint(module: torch.nn.Module) -> int:
    return hash(tuple(p.data_ptr() for p in module.parameters()))
