"""One decode step replayed from its graph entry: found or registered, owned, refreshed, captured the first time.

A request normally claimed its entry before its prefill, which then wrote the prefix straight into the entry's
buffers; a request that could not claim at prefill time (the key was owned, or the entry was evicted since) gets
its own prefix copied in at its first graph step instead, and only when the source tensors changed.
"""

from __future__ import annotations

import logging
import weakref

from . import eligibility as why
from .graph_entry import DecodeGraphEntry, EntrySpec, FailedEntry
from .graph_manager import DecodeGraphManager, make_key
from .outcome import DecodeOutcome
from .prefill import PrefixCache
from .stats import DecodeStats

logger = logging.getLogger("kvgraph")


class StepReplayer:
    """Replays decode steps from `manager`'s entries through its capture backend, counting into `stats`."""

    def __init__(self, transformer, manager: DecodeGraphManager, stats: DecodeStats):
        self._transformer = weakref.ref(transformer)
        self.manager, self.stats = manager, stats

    def replay(self, step, prefix: PrefixCache, hidden, timestep, fingerprint) -> DecodeOutcome:
        """The step by graph, or an outcome without output whose reason says why it must run eagerly. The caller
        holds the manager's lock (replay + clone must be atomic) and has found the model fit to replay
        (`fingerprint`: the weights' addresses it was judged with)."""
        manager = self.manager
        key = prefix.graph_key
        if key is None:
            key = prefix.graph_key = make_key(step, prefix.branch, prefix.batch, prefix.layout, hidden.dtype,
                                              hidden.device)
        entry = manager.lookup_or_register(
            key, lambda: EntrySpec.for_request(self._transformer(), prefix.layout, prefix.batch, step.kv_heads))
        if isinstance(entry, FailedEntry):
            return DecodeOutcome(None, "eager", entry.reason)
        if manager.owners.owned_by_other(key, prefix.owner):
            return DecodeOutcome(None, "eager", why.OWNED)
        if manager.owners.claim_if_free(key, prefix.owner):
            entry.forget_prefix()  # what the buffers hold belonged to the previous owner

        if entry.graph is not None and entry.weights_fingerprint != fingerprint:
            # A captured graph reads weights at the addresses it was captured with: never replay it stale.
            manager.remove_graph_entries()
            return DecodeOutcome(None, "eager", why.WEIGHTS_MOVED)

        entry.load_inputs(hidden, timestep)
        if entry.refresh_prefix(prefix):
            entry.set_rope(prefix.cos, prefix.sin)
        path = "replay"
        if entry.graph is None:
            if not self._capture(step, key, entry, fingerprint):
                return DecodeOutcome(None, "eager", why.CAPTURE_FAILED)
            path = "capture"
        output = manager.backend.replay(entry)
        self.stats.replays += 1
        return DecodeOutcome(output, path, None)

    def _capture(self, step, key, entry: DecodeGraphEntry, fingerprint) -> bool:
        entry.warmups = entry.COMPILED_WARMUPS if step.compiled else DecodeGraphEntry.warmups
        try:
            self.manager.backend.capture(entry, step)
        except Exception as exc:  # noqa: BLE001 - any capture failure must end eager, not fail the prompt
            self.manager.mark_failed(key, why.CAPTURE_FAILED, exc)
            return False
        entry.weights_fingerprint = fingerprint
        self.stats.captures += 1
        self.stats.capture_seconds += entry.capture_seconds
        logger.info("KV-Graph: captured decode graph %s in %.2f s (warm-up %.2f s)", key.describe(),
                    entry.capture_seconds, entry.warmup_seconds)
        return True
