"""The graph entries of one loaded transformer, who owns each, and the replays: everything the lock guards.

`DecodeGraphs` keeps at most `max_entries` entries by key (least recently used first out, a failure marker where an
allocation or a capture failed), records which live request owns each (`EntryOwners`), and replays a decode step or
a prefix pass from an entry, capturing it the first time. Every public method takes the lock itself: callers never
hold it. Whether the model may replay at all is not decided here (`eligibility.py`); the engine asks first.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import eligibility as why
from .capture import DecodeGraphEntry, EntrySpec, PrefixGraph, entry_kv_format
from .prefill import OwnerToken, PrefixCache
from .prefix_store import release_host_cache
from .stats import DecodeStats, LoggedOnce
from .step import DecodeStep, PrefixInputs

logger = logging.getLogger("kvgraph")

# Left free after a new entry's buffers: the prefill's activations and the VAE decode that follows must still fit,
# or a small card trades an idle graph for an out-of-memory prompt.
MEMORY_HEADROOM = 2 << 30


@dataclass(frozen=True)
class GraphKey:
    """Everything a captured step's shapes and addresses depend on.

    `layout` is the full token layout signature (prefix runs and every image shape), so equal token counts with
    different layouts, whose RoPE tables differ, never share an entry. `parallel` names a sequence-parallel rank's
    group (world size, rank, ...; empty on one device): its graph records that group's collectives.
    """

    branch: str
    batch: int
    layout: tuple
    dtype: str
    device: str
    backend: str
    parallel: tuple = ()
    residuals: tuple = ()  # a ControlNet's part (which net, where its weights are): its stream is captured work
    skip: tuple = ()  # blocks the step leaves out (sorted): a skip-layer guidance pass is its own graph
    # Streamed blocks (their indices, slots): a streamed step's graph holds their uploads.
    streaming: tuple = ()
    # Where the prefix K/V live (prefix_store.py): an int8 or host entry's step reads other buffers and runs other
    # work (dequantization, host copies), so placements never share an entry.
    placement: str = "gpu"
    kv_format: str = "native"  # how the entry's K/V hold values (kv_format.py): fp8 entries read other buffers

    def describe(self) -> dict:
        prefix_len, target_tokens, shapes, _ = self.layout
        return {
            "branch": self.branch,
            "batch": self.batch,
            "prefix_tokens": prefix_len,
            "target_tokens": target_tokens,
            "image_shapes": [list(s) for s in shapes],
            "dtype": self.dtype,
            "device": self.device,
            "backend": self.backend,
            "prefix_placement": self.placement,
            "kv_format": self.kv_format,
            **({"parallel": dict(self.parallel)} if self.parallel else {}),
            **({"residuals": f"{self.residuals[0]} #{self.residuals[1]}"} if self.residuals else {}),
            **({"skipped_blocks": list(self.skip)} if self.skip else {}),
            **({"streamed_blocks": list(self.streaming[0]), "stream_slots": self.streaming[1]} if self.streaming else {}),
        }


def make_key(step: DecodeStep, branch: str, batch: int, layout, dtype, device, residuals=None, skip=(),
             placement: str = "gpu") -> GraphKey:
    """`residuals`: the request's per-block residuals (a ControlNet), or None; `skip`: the blocks the step leaves
    out; `placement`: where the prefix K/V live."""
    return GraphKey(branch=branch, batch=batch, layout=layout.signature, dtype=str(dtype).removeprefix("torch."),
                    device=str(device), backend=step.variant(device), parallel=step.parallel_key(),
                    residuals=() if residuals is None else residuals.graph_key(), skip=tuple(sorted(skip)),
                    streaming=step.streaming_key(), placement=placement,
                    kv_format=entry_kv_format(step, placement, device, dtype))


@dataclass
class FailedEntry:
    """Marker left where an allocation or capture failed: the key stays eager, holding no tensors."""

    reason: str
    detail: str


class EntryOwners:
    """Which live request owns each entry: the ownership rule.

    Two requests writing one entry's static buffers would overwrite each other's prefix mid-generation, so an entry
    serves one request at a time: the first live request to use a key owns it. The owner is a weak reference to the
    request's `OwnerToken` (held by its prefix cache), so the entry frees itself when the request's cache is released
    or collected: nothing has to remember to hand it back. Not locked itself: `DecodeGraphs` uses it under its lock.
    """

    def __init__(self):
        self._refs: dict[object, weakref.ReferenceType] = {}

    def alive(self, key) -> bool:
        """Whether a request that is still alive owns `key`."""
        ref = self._refs.get(key)
        return ref is not None and ref() is not None

    def owned_by_other(self, key, token) -> bool:
        """Whether a live request other than `token`'s owns `key` (such a request must not touch the entry)."""
        ref = self._refs.get(key)
        owner = ref() if ref is not None else None
        return owner is not None and owner is not token

    def claim(self, key, token) -> None:
        """Make `token`'s request the owner of `key` (the caller has checked `owned_by_other`)."""
        self._refs[key] = weakref.ref(token)

    def claim_if_free(self, key, token) -> bool:
        """Claim `key` for `token` when no live request owns it; True when ownership changed hands, so the entry's
        buffers may hold another request's prefix."""
        if self.alive(key):
            return False
        self.claim(key, token)
        return True

    def forget(self, key) -> None:
        """The entry for `key` is gone: so is its owner record."""
        self._refs.pop(key, None)


class DecodeGraphs:
    """The entries of one engine, their owners, and replays through `backend`, counted into `stats`.

    `lock` guards the entries, their owners, the counters and the logged-once reasons; a replay and the clone of its
    output happen under it, because route handlers and some ComfyUI forks call in from other threads and every entry
    shares one memory pool.
    """

    def __init__(self, name: str, backend, stats: DecodeStats, max_entries: int = 4):
        self.name = name
        self.backend = backend
        self.stats = stats
        self.max_entries = max_entries
        self.entries: OrderedDict[GraphKey, DecodeGraphEntry | FailedEntry] = OrderedDict()
        self.owners = EntryOwners()
        self.lock = threading.RLock()
        self._logged = LoggedOnce()

    # -- what a request does with its entry ------------------------------------------------------------------------

    def claim(self, key: GraphKey, token: OwnerToken, make_spec) -> DecodeGraphEntry | None:
        """Reserve `key`'s entry (registered from `make_spec()` if new) for `token`'s request before its prefill,
        so the prefill can write the prefix into the static buffers. None when another live request owns it or the
        key failed."""
        with self.lock:
            entry = self._lookup_or_register(key, make_spec)
            if not isinstance(entry, DecodeGraphEntry) or self.owners.owned_by_other(key, token):
                return None
            self.owners.claim(key, token)
            entry.forget_prefix()
            return entry

    def bind(self, entry: DecodeGraphEntry, prefix: PrefixCache) -> None:
        """After a prefill into `entry`'s buffers: the buffers hold `prefix`, and the rope tables are set."""
        with self.lock:
            entry.set_rope(prefix.cos, prefix.sin)
            entry.mark_current(prefix)

    def replay(self, step, prefix: PrefixCache, hidden, timestep, fingerprint, make_spec) -> tuple:
        """One decode step for `prefix`'s request from its entry (registered from `make_spec()` if new): `(output,
        "replay" or "capture", None)`, or `(None, "eager", reason)` when it must run eagerly. The model was judged fit
        to replay with `fingerprint` (the weights' addresses).

        A request that claimed its entry at prefill has its prefix in the buffers already; one that could not (the
        key was owned, or the entry was evicted since) gets its prefix copied in at its first graph step, and only
        when the source tensors changed.
        """
        key = prefix.graph_key
        if key is None:
            key = prefix.graph_key = make_key(step, prefix.branch, prefix.batch, prefix.layout, hidden.dtype,
                                              hidden.device, prefix.residuals, prefix.skip, prefix.placement)
        with self.lock:
            entry = self._lookup_or_register(key, make_spec)
            if isinstance(entry, FailedEntry):
                return None, "eager", entry.reason
            if self.owners.owned_by_other(key, prefix.owner):
                return None, "eager", why.OWNED
            if self.owners.claim_if_free(key, prefix.owner):
                entry.forget_prefix()  # what the buffers hold belonged to the previous owner
            if entry.graph is not None and entry.weights_fingerprint != fingerprint:
                # A captured graph reads weights at the addresses it was captured with: never replay it stale.
                self._remove([k for k, e in self.entries.items() if isinstance(e, DecodeGraphEntry)])
                return None, "eager", why.WEIGHTS_MOVED
            entry.load_inputs(hidden, timestep, prefix.residuals)
            if entry.refresh_prefix(prefix):
                entry.set_rope(prefix.cos, prefix.sin)
            path = "replay"
            if entry.graph is None:
                if not self._capture_step(step, key, entry, fingerprint):
                    return None, "eager", why.CAPTURE_FAILED
                path = "capture"
            output = self.backend.replay(entry)
            self.stats.replays += 1
            return output, path, None

    def replay_prefix(self, entry: DecodeGraphEntry, inputs: PrefixInputs, fingerprint, run_pass) -> str | None:
        """The prefix pass of `entry`'s request from the entry's captured pass (captured the first time, with
        `run_pass`). None when it ran, else the reason it must run eagerly (the caller runs it, outside the lock)."""
        with self.lock:
            graph = entry.prefix_graph
            if isinstance(graph, PrefixGraph) and graph.weights_fingerprint != fingerprint:
                # It reads the weights at the addresses it was captured with: recapture rather than replay stale.
                entry.prefix_graph = graph = None
            if graph is None:
                graph = self._capture_prefix(entry, inputs, fingerprint, run_pass)
            if not isinstance(graph, PrefixGraph):
                return graph
            graph.load(inputs)
            self.backend.replay(graph)
            self.stats.prefill_replays += 1
            return None

    def count_eager(self, reason: str, prefill: bool = False) -> bool:
        """Count an eager decode step (or prefix pass) for `reason`; True the first time, so it is logged once."""
        with self.lock:
            (self.stats.eager_prefills if prefill else self.stats.eager_steps)[reason] += 1
            return self._logged.first(("prefix:" if prefill else "") + reason)

    def drop_all_graphs(self) -> None:
        """Drop every entry, markers included (the model changed so that no captured graph computes what it does)."""
        with self.lock:
            self._remove(list(self.entries))

    # -- capture ---------------------------------------------------------------------------------------------------

    def _capture_step(self, step, key: GraphKey, entry: DecodeGraphEntry, fingerprint) -> bool:
        entry.warmups = entry.COMPILED_WARMUPS if step.compiled else DecodeGraphEntry.warmups
        try:
            self.backend.capture(entry, step)
        except Exception as exc:  # noqa: BLE001 - any capture failure must end eager, not fail the prompt
            self._mark_failed(key, why.CAPTURE_FAILED, exc)
            return False
        entry.weights_fingerprint = fingerprint
        self.stats.captures += 1
        self.stats.capture_seconds += entry.capture_seconds
        logger.info("KV-Graph: captured decode graph %s in %.2f s (warm-up %.2f s)", key.describe(),
                    entry.capture_seconds, entry.warmup_seconds)
        return True

    def _capture_prefix(self, entry: DecodeGraphEntry, inputs: PrefixInputs, fingerprint,
                        run_pass) -> PrefixGraph | str:
        graph = PrefixGraph(inputs)
        graph.load(inputs)
        try:
            self.backend.capture(graph, run_pass)
        except Exception as exc:  # noqa: BLE001 - a failed capture must end eager, not fail the prompt
            entry.prefix_graph = why.CAPTURE_FAILED  # a marker: this key's prefills stay eager
            logger.warning("KV-Graph: prefix pass capture failed for %s: %s; its prefills run eagerly.",
                           entry.key.describe(), f"{type(exc).__name__}: {exc}"[:500])
            return why.CAPTURE_FAILED
        graph.weights_fingerprint = fingerprint
        entry.prefix_graph = graph
        self.stats.prefill_captures += 1
        logger.info("KV-Graph: captured prefix pass %s in %.2f s (warm-up %.2f s)", entry.key.describe(),
                    graph.capture_seconds, graph.warmup_seconds)
        return graph

    # -- the store (under the lock) --------------------------------------------------------------------------------

    def _lookup_or_register(self, key: GraphKey, make_spec) -> DecodeGraphEntry | FailedEntry:
        """The entry for `key` (now the most recently used), or a new one allocated from `make_spec()`; a failed
        allocation leaves a `FailedEntry` marker."""
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
            return self._mark_failed(key, why.ALLOCATION_FAILED, exc)
        self.entries[key] = entry
        return entry

    def _evict_one(self) -> None:
        # Least recently used first, but spare entries whose owner is still generating when another will do.
        victims = [k for k in self.entries if not self.owners.alive(k)] or list(self.entries)
        self._remove(victims[:1])
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
        self._remove(evicted)
        self.stats.evictions += len(evicted)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("KV-Graph: evicted %d idle decode graph(s) to leave room for a new one (%.1f GiB needed "
                    "with headroom).", len(evicted), need / 2**30)

    def _mark_failed(self, key: GraphKey, reason: str, exc: BaseException) -> FailedEntry:
        """Replace `key`'s entry by a marker, so the key stays eager."""
        # Keep a marker, not the exception: its traceback would pin the failed entry's tensors.
        marker = FailedEntry(reason, f"{type(exc).__name__}: {exc}"[:500])
        self._remove([key])
        self.entries[key] = marker
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.warning("KV-Graph: %s for %s: %s; this shape decodes eagerly.", reason, key.describe(), marker.detail)
        return marker

    def _remove(self, keys) -> None:
        """Drop these entries and their owners; once no captured graph is left, the backend's pool goes too."""
        pinned = False
        for key in keys:
            entry = self.entries.pop(key, None)
            pinned = pinned or getattr(entry, "host_bytes", 0) > 0
            self.owners.forget(key)
        # The loop's last entry is dropped here, not when this returns, so the pinned rows it held are already freed
        # when the host cache is emptied below.
        entry = None
        if not any(isinstance(e, DecodeGraphEntry) and e.holds_graph for e in self.entries.values()):
            reset = getattr(self.backend, "reset_pool", None)
            if reset is not None:
                reset()
        if pinned:
            release_host_cache()  # after the drop: a pinned block still in use is not handed back

    # -- reporting and release -------------------------------------------------------------------------------------

    def release(self) -> dict:
        """Drop every entry (graphs, static buffers, failure markers). Returns what was held.

        A request still generating keeps its prefix (its views keep the buffers alive) and finishes eagerly.
        """
        with self.lock:
            held = {"entries": len(self.entries), "bytes": self.bytes_held()}
            self._remove(list(self.entries))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return held

    def bytes_held(self) -> int:
        """What the entries' static buffers and graphs hold."""
        with self.lock:
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
                                host_bytes=entry.host_bytes, owner_alive=self.owners.alive(key))
                entries.append(item)
            return {"model": self.name, "entries": entries, "bytes_held": self.bytes_held(),
                    "host_bytes_held": sum(e.host_bytes for e in self.entries.values()
                                           if isinstance(e, DecodeGraphEntry)),
                    "max_entries": self.max_entries, **self.stats.snapshot()}
