"""The decode graph manager: one per loaded transformer, alive as long as the transformer is.

It owns the captured graphs and their static buffers, decides per step whether to replay or run eagerly, and
keeps the statistics. A second generation with the same shapes finds its entry and replays without capturing.

Ownership: the first live request to use a key owns its entry, tracked by a weak reference to the request's owner
token (held by its prefix cache). While that request is alive, another request with the same key runs eagerly
(correct, and logged once), because refreshing the static buffers would overwrite the owner's prefix mid-
generation. When the owner's cache is released the reference dies and the key is free again.

A request normally claims its entry before its prefill, which then writes the prefix straight into the entry's
buffers; a request that could not claim at prefill time (the key was owned, or the entry was evicted since) gets
its own prefix copied in at its first graph step instead, and only when the source tensors changed.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch

from . import eligibility as why
from . import prefix_pass
from .graph_entry import CudaGraphBackend, DecodeGraphEntry, EntrySpec, FailedEntry, GraphKey
from .prefill import OwnerToken, PrefixCache
from .prefix_pass import PrefixGraph, PrefixInputs, prefix_blocks, run_prefix_blocks, run_prefix_eagerly
from .stats import DecodeStats
from .step import DecodeInputs, DecodeStep

logger = logging.getLogger("kvgraph")

DECODE_MODES = ("auto", "graph", "eager")
# Left free after a new entry's buffers: the prefill's activations at 1024x1024 with a reference (~1.3 GiB) and the
# VAE decode that follows must still fit, or a 24 GB card trades an idle graph for an out-of-memory prompt.
MEMORY_HEADROOM = 2 << 30


class DecodeOutcome(NamedTuple):
    output: torch.Tensor
    path: str  # "replay", "capture" (captured then replayed) or "eager"
    reason: str | None  # why eager, else None


def check_mode(mode: str) -> str:
    if mode not in DECODE_MODES:
        raise ValueError(f"decode mode {mode!r} is invalid: expected one of {', '.join(DECODE_MODES)}")
    return mode


def make_key(step: DecodeStep, branch: str, batch: int, layout, dtype, device) -> GraphKey:
    return GraphKey(branch=branch, batch=batch, layout=layout.signature, dtype=str(dtype).removeprefix("torch."),
                    device=str(device), backend=step.variant())


class DecodeGraphManager:
    def __init__(self, transformer: torch.nn.Module, max_entries: int = 4, backend=None):
        self._transformer = weakref.ref(transformer)
        self.max_entries = max_entries
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.entries: OrderedDict[GraphKey, DecodeGraphEntry | FailedEntry] = OrderedDict()
        self._owners: dict[GraphKey, weakref.ReferenceType] = {}
        self.stats = DecodeStats()
        self._logged: set[str] = set()
        # Replay + clone must be atomic: route handlers and some ComfyUI forks call in from other threads.
        self.lock = threading.RLock()
        self.name = type(transformer).__name__
        # Per-step checks must cost well under a millisecond of host time, so the whole-model checks (devices,
        # hooks, LoRA wrappers) run over one scan of the module tree at every request start, and again only when
        # the weights' addresses or the Linear layers change.
        self._scan: why.ModelScan | None = None
        self._static: tuple = (None, None)  # (weights fingerprint, reason or None)

    @property
    def transformer(self):
        return self._transformer()

    # -- claiming an entry before the prefill -------------------------------------------------------------------

    @torch.no_grad()
    def claim(self, step: DecodeStep, token: OwnerToken, branch: str, layout, batch: int, key_valid,
              mode: str) -> DecodeGraphEntry | None:
        """Reserve the entry for this request's key, so its prefill can write the prefix into the static buffers.

        Returns None when the request will not replay (ineligible, owned by another live request, failed key);
        its decode steps then say why.
        """
        if check_mode(mode) == "eager":
            return None
        transformer = self.transformer
        # Modules may have been hooked or wrapped since the last request: judge the model again, once. The module
        # tree is walked again only when it changed; an unchanged one keeps its scan (and its LoRA verdict).
        if self._scan is None or self._scan.stale():
            self._scan = None
        else:
            self._scan.checked = False
        self._static = (None, None)
        spec = EntrySpec.for_request(transformer, layout, batch)
        if self._blocker(spec.dtype, key_valid, self._fingerprint())[0] is not None:
            return None
        key = make_key(step, branch, batch, layout, spec.dtype, spec.device)
        with self.lock:
            entry = self._lookup_or_register(key, lambda: spec)
            if not isinstance(entry, DecodeGraphEntry) or self._owned_by_other(key, token):
                return None
            self._owners[key] = weakref.ref(token)
            entry.forget_prefix()
            return entry

    @torch.no_grad()
    def bind(self, entry: DecodeGraphEntry, prefix: PrefixCache) -> None:
        """After a prefill into `entry`'s buffers: the buffers hold `prefix`, and the rope tables are set."""
        with self.lock:
            entry.set_rope(prefix.cos, prefix.sin)
            entry.mark_current(prefix)

    @torch.no_grad()
    def run_prefix(self, entry: DecodeGraphEntry, inputs: PrefixInputs) -> str:
        """The prefix pass of the request that claimed `entry`, whose K/V rows `inputs` points into: replayed from
        the entry's captured pass (captured the first time) when the prefix is short. Returns "replay", "capture"
        or "eager"."""
        if inputs.hidden.shape[1] > prefix_pass.SHORT_PREFIX_TOKENS:
            return self._eager_prefix(inputs, why.LONG_PREFIX)
        fingerprint = self._fingerprint()
        with self.lock:
            graph = entry.prefix_graph
            if isinstance(graph, PrefixGraph) and graph.weights_fingerprint != fingerprint:
                # It reads the weights at the addresses it was captured with: recapture rather than replay stale.
                entry.prefix_graph = graph = None
            path = "replay"
            if graph is None:
                graph = self._capture_prefix(entry, inputs, fingerprint)
                path = "capture"
            if isinstance(graph, PrefixGraph):
                graph.load(inputs)
                self.backend.replay(graph)
                self.stats.prefill_replays += 1
                return path
        return self._eager_prefix(inputs, graph)  # outside the lock: other requests' replays need not wait

    def _capture_prefix(self, entry: DecodeGraphEntry, inputs: PrefixInputs, fingerprint) -> PrefixGraph | str:
        graph = PrefixGraph(inputs)
        graph.load(inputs)
        blocks = prefix_blocks(self.transformer)
        try:
            self.backend.capture(graph, lambda static: run_prefix_blocks(blocks, static))
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

    def _eager_prefix(self, inputs: PrefixInputs, reason: str) -> str:
        self.stats.eager_prefills[reason] += 1
        if "prefix:" + reason not in self._logged:
            self._logged.add("prefix:" + reason)
            logger.info("KV-Graph: prefix pass runs eagerly: %s.", reason)
        run_prefix_eagerly(self.transformer, inputs)
        return "eager"

    # -- the per-step entry point --------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, step: DecodeStep, prefix: PrefixCache, hidden: torch.Tensor, timestep: torch.Tensor,
               mode: str = "auto") -> DecodeOutcome:
        """One decode step for `prefix`'s request: replay its graph when it may, else run eagerly."""
        if check_mode(mode) == "eager":
            return self._eager(step, prefix, hidden, timestep, why.MODE_EAGER, mode)
        reason, fingerprint = self._blocker(prefix.k[0].dtype, prefix.key_valid, self._fingerprint())
        if reason is None:
            with self.lock:
                outcome = self._replay(step, prefix, hidden, timestep, fingerprint)
            if outcome.reason is None:
                return outcome
            reason = outcome.reason
        return self._eager(step, prefix, hidden, timestep, reason, mode)

    def _fingerprint(self) -> tuple:
        """The weights' addresses: a captured graph is valid only while this is unchanged."""
        if self._scan is None:
            self._scan = why.ModelScan(self.transformer)
        return self._scan.fingerprint()

    def _blocker(self, kv_dtype, key_valid, fingerprint) -> tuple[str | None, tuple]:
        """Why this request cannot replay (None if it can), and the weights' fingerprint its graphs are keyed on
        (the given one, or a new scan's when the model changed since the scan it was taken from)."""
        seen, reason = self._static
        if seen != fingerprint or self._scan.changed():
            transformer = self.transformer
            if self._scan.checked:
                # The model changed after this scan was judged: scan the new module tree (once, not every step).
                self._scan = why.ModelScan(transformer)
                fingerprint = self._scan.fingerprint()
            reason = self.backend.unavailable_reason(transformer, self._scan.params)
            if reason is None and self._scan.lora_wrapped:
                reason = why.LORA
            self._scan.checked = True
            self._static = (fingerprint, reason)
            if reason == why.LORA and self.entries:
                with self.lock:
                    self._remove(list(self.entries))
        return reason or why.request_reason(kv_dtype, key_valid), fingerprint

    def _replay(self, step, prefix, hidden, timestep, fingerprint) -> DecodeOutcome:
        key = prefix.graph_key
        if key is None:
            key = prefix.graph_key = make_key(step, prefix.branch, prefix.batch, prefix.layout, hidden.dtype,
                                              hidden.device)
        entry = self._lookup_or_register(
            key, lambda: EntrySpec.for_request(self.transformer, prefix.layout, prefix.batch))
        if isinstance(entry, FailedEntry):
            return DecodeOutcome(None, "eager", entry.reason)
        if self._owned_by_other(key, prefix.owner):
            return DecodeOutcome(None, "eager", why.OWNED)
        owner = self._owners.get(key)
        if owner is None or owner() is None:
            self._owners[key] = prefix.owner_ref()
            entry.forget_prefix()

        if entry.graph is not None and entry.weights_fingerprint != fingerprint:
            # A captured graph reads weights at the addresses it was captured with: never replay it stale.
            self._remove([k for k, e in self.entries.items() if isinstance(e, DecodeGraphEntry)])
            return DecodeOutcome(None, "eager", why.WEIGHTS_MOVED)

        entry.load_inputs(hidden, timestep)
        if entry.refresh_prefix(prefix):
            entry.set_rope(prefix.cos, prefix.sin)
        path = "replay"
        if entry.graph is None:
            entry.warmups = entry.COMPILED_WARMUPS if step.compiled else DecodeGraphEntry.warmups
            try:
                self.backend.capture(entry, step)
            except Exception as exc:  # noqa: BLE001 - any capture failure must end eager, not fail the prompt
                self._mark_failed(key, why.CAPTURE_FAILED, exc)
                return DecodeOutcome(None, "eager", why.CAPTURE_FAILED)
            entry.weights_fingerprint = fingerprint
            self.stats.captures += 1
            self.stats.capture_seconds += entry.capture_seconds
            logger.info("KV-Graph: captured decode graph %s in %.2f s (warm-up %.2f s)", key.describe(),
                        entry.capture_seconds, entry.warmup_seconds)
            path = "capture"
        output = self.backend.replay(entry)
        self.stats.replays += 1
        return DecodeOutcome(output, path, None)

    def _owned_by_other(self, key: GraphKey, token) -> bool:
        owner = self._owners.get(key)
        alive = owner() if owner is not None else None
        return alive is not None and alive is not token

    def _lookup_or_register(self, key: GraphKey, make_spec):
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
        victims = [k for k in self.entries if not self._owner_alive(k)] or list(self.entries)
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
        idle = [k for k, e in self.entries.items() if isinstance(e, DecodeGraphEntry) and not self._owner_alive(k)]
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

    def _owner_alive(self, key) -> bool:
        owner = self._owners.get(key)
        return owner is not None and owner() is not None

    def _mark_failed(self, key: GraphKey, reason: str, exc: BaseException) -> FailedEntry:
        # Keep a marker, not the exception: its traceback would pin the failed entry's tensors.
        marker = FailedEntry(reason, f"{type(exc).__name__}: {exc}"[:500])
        self._remove([key])
        self.entries[key] = marker
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

    def _remove(self, keys) -> None:
        for key in keys:
            self.entries.pop(key, None)
            self._owners.pop(key, None)
        if not any(isinstance(e, DecodeGraphEntry) and e.holds_graph for e in self.entries.values()):
            reset = getattr(self.backend, "reset_pool", None)
            if reset is not None:
                reset()

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
        return sum(e.nbytes for e in self.entries.values() if isinstance(e, DecodeGraphEntry))

    def status(self) -> dict:
        """A JSON-ready picture of the manager, read under its lock."""
        with self.lock:
            entries = []
            for key, entry in self.entries.items():
                item = {"key": key.describe()}
                if isinstance(entry, FailedEntry):
                    item.update(state="failed", reason=entry.reason, detail=entry.detail)
                else:
                    item.update(state="captured" if entry.graph is not None else "registered",
                                captures=entry.captures, replays=entry.replays, bytes=entry.nbytes,
                                owner_alive=self._owner_alive(key))
                entries.append(item)
            return {"model": self.name, "entries": entries, "bytes_held": self.bytes_held(),
                    "max_entries": self.max_entries, **self.stats.snapshot()}
