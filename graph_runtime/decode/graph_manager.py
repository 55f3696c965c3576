"""The graph entries of one loaded transformer: keys, lookup and registration, LRU eviction, memory room, bytes
held, failure markers and release.

The manager only keeps entries; what a request may do with them is decided elsewhere: the engine (`engine.py`)
claims, binds, replays and falls back, `ownership.py` says which request owns an entry, `eligibility.py` whether
the model may replay at all. A second generation with the same shapes finds its entry here and replays without
capturing again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from . import eligibility as why
from .graph_entry import DecodeGraphEntry, EntrySpec, FailedEntry, GraphKey
from .outcome import DECODE_MODES  # noqa: F401 - its old home: nodes/sampler.py imports it from here
from .ownership import EntryOwners
from .stats import DecodeStats
from .step import DecodeStep

logger = logging.getLogger("kvgraph")

# Left free after a new entry's buffers: the prefill's activations at 1024x1024 with a reference (~1.3 GiB) and the
# VAE decode that follows must still fit, or a 24 GB card trades an idle graph for an out-of-memory prompt.
MEMORY_HEADROOM = 2 << 30


def make_key(step: DecodeStep, branch: str, batch: int, layout, dtype, device) -> GraphKey:
    return GraphKey(branch=branch, batch=batch, layout=layout.signature, dtype=str(dtype).removeprefix("torch."),
                    device=str(device), backend=step.variant(), parallel=step.parallel_key())


class DecodeGraphManager:
    """At most `max_entries` entries, least recently used first out, with their owners (`owners`) forgotten as they
    go. `lock` guards the entries: the engine holds it across a replay and its clone, because route handlers and some
    ComfyUI forks call in from other threads and every entry shares one memory pool."""

    def __init__(self, name: str, backend, stats: DecodeStats, max_entries: int = 4):
        self.name = name
        self.backend = backend
        self.stats = stats  # shared with the engine; evictions are counted here
        self.max_entries = max_entries
        self.entries: OrderedDict[GraphKey, DecodeGraphEntry | FailedEntry] = OrderedDict()
        self.owners = EntryOwners()
        self.lock = threading.RLock()

    def lookup_or_register(self, key: GraphKey, make_spec) -> DecodeGraphEntry | FailedEntry:
        """The entry for `key` (now the most recently used), or a new one allocated from `make_spec()`; a failed
        allocation leaves a `FailedEntry` marker. Call under `lock`."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry
        while len(self.entries) >= self.max_entries:
            self._evict_one()
        spec = make_spec()
        self._make_room(spec)
        try:
            entry = DecodeGraphEntry(key, spec)
        except torch.OutOfMemoryError as exc:
            return self.mark_failed(key, why.ALLOCATION_FAILED, exc)
        self.entries[key] = entry
        return entry

    def _evict_one(self) -> None:
        # Least recently used first, but spare entries whose owner is still generating when another will do.
        victims = [k for k in self.entries if not self.owners.alive(k)] or list(self.entries)
        self.remove(victims[:1])
        self.stats.evictions += 1
        logger.debug("KV-Graph: evicted decode graph %s (max_entries=%d)", victims[0], self.max_entries)

    def _make_room(self, spec: EntrySpec) -> None:
        """Evict idle entries (least recently used first) while the card lacks room for `spec` plus headroom.

        Idle graphs are a speed-up for a later prompt; they must never be why this prompt runs out of memory.
        """
        free_bytes = getattr(self.backend, "free_bytes", None)
        free = free_bytes(spec.device) if free_bytes is not None else None
        if free is None:
            return
        need = spec.static_bytes + MEMORY_HEADROOM
        idle = [k for k, e in self.entries.items() if isinstance(e, DecodeGraphEntry) and not self.owners.alive(k)]
        evicted = []
        for key in idle:
            if free >= need:
                break
            free += self.entries[key].nbytes
            evicted.append(key)
        if not evicted:
            return
        self.remove(evicted)
        self.stats.evictions += len(evicted)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("KV-Graph: evicted %d idle decode graph(s) to leave room for a new one (%.1f GiB needed "
                    "with headroom).", len(evicted), need / 2**30)

    def mark_failed(self, key: GraphKey, reason: str, exc: BaseException) -> FailedEntry:
        """Replace `key`'s entry by a marker, so the key stays eager. Call under `lock`."""
        # Keep a marker, not the exception: its traceback would pin the failed entry's tensors.
        marker = FailedEntry(reason, f"{type(exc).__name__}: {exc}"[:500])
        self.remove([key])
        self.entries[key] = marker
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.warning("KV-Graph: %s for %s: %s; this shape decodes eagerly.", reason, key.describe(), marker.detail)
        return marker

    def remove(self, keys) -> None:
        """Drop these entries and their owners; once no captured graph is left, the backend's pool goes too."""
        for key in keys:
            self.entries.pop(key, None)
            self.owners.forget(key)
        if not any(isinstance(e, DecodeGraphEntry) and e.holds_graph for e in self.entries.values()):
            reset = getattr(self.backend, "reset_pool", None)
            if reset is not None:
                reset()

    def remove_graph_entries(self) -> None:
        """Drop every entry that holds buffers (failure markers stay: those keys still cannot capture)."""
        self.remove([k for k, e in self.entries.items() if isinstance(e, DecodeGraphEntry)])

    def release(self) -> dict:
        """Drop every entry (graphs, static buffers, failure markers). Returns what was held.

        A request still generating keeps its prefix (its views keep the buffers alive) and finishes eagerly.
        """
        with self.lock:
            held = {"entries": len(self.entries), "bytes": self.bytes_held()}
            self.remove(list(self.entries))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return held

    def bytes_held(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if isinstance(e, DecodeGraphEntry))

    def pool_bytes(self) -> int:
        """What the captured graphs hold in the backend's private pool (decode steps and prefix passes)."""
        with self.lock:
            total = 0
            for entry in self.entries.values():
                total += getattr(entry, "pool_bytes", 0)
                prefix = getattr(entry, "captured_prefix", None)
                total += prefix.pool_bytes if prefix is not None else 0
            return total

    def status(self) -> dict:
        """A JSON-ready picture of the entries and the statistics, read under the lock."""
        with self.lock:
            entries = []
            for key, entry in self.entries.items():
                item = {"key": key.describe()}
                if isinstance(entry, FailedEntry):
                    item.update(state="failed", reason=entry.reason, detail=entry.detail)
                else:
                    item.update(state="captured" if entry.graph is not None else "registered",
                                captures=entry.captures, replays=entry.replays, bytes=entry.nbytes,
                                owner_alive=self.owners.alive(key))
                entries.append(item)
            return {"model": self.name, "entries": entries, "bytes_held": self.bytes_held(),
                    "max_entries": self.max_entries, **self.stats.snapshot()}
