"""Counters the decode engine keeps (its graphs count evictions and replays into them), readable as one plain dict (for
logs, the CLI and the HTTP status route), and the record of which fallback reasons were already logged."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    captures: int = 0
    replays: int = 0
    capture_seconds: float = 0.0
    eager_steps: Counter = field(default_factory=Counter)  # reason -> steps
    evictions: int = 0
    # The prefill's prefix pass: replayed from a graph entry, captured, or run eagerly (reason -> prefills).
    prefill_replays: int = 0
    prefill_captures: int = 0
    eager_prefills: Counter = field(default_factory=Counter)
    # The step's attention kernel per device (attention.AttentionChoice), whose fallbacks to SDPA count here too.
    attention_choice: object = None
    # Steps a step cache answered without running the transformer (graph_runtime/sampling/step_cache.py, or a core
    # sampler's step with no model call under core's EasyCache / LazyCache).
    skipped_steps: int = 0
    # Prefills by where their prefix K/V went (prefix_store.py: gpu, int8, host, recompute).
    prefix_placements: Counter = field(default_factory=Counter)

    @property
    def eager_total(self) -> int:
        return sum(self.eager_steps.values())

    def snapshot(self) -> dict:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "capture_seconds": round(self.capture_seconds, 4),
            "eager_steps": dict(self.eager_steps),
            "eager_total": self.eager_total,
            "evictions": self.evictions,
            "prefill_replays": self.prefill_replays,
            "prefill_captures": self.prefill_captures,
            "eager_prefills": dict(self.eager_prefills),
            "attention": {} if self.attention_choice is None else self.attention_choice.chosen(),
            "attention_fallbacks": {} if self.attention_choice is None else dict(self.attention_choice.fallbacks),
            "skipped_steps": self.skipped_steps,
            "prefix_placements": dict(self.prefix_placements),
        }

    def delta(self, before: dict) -> dict:
        """What changed since `before` (a snapshot): the per-run numbers a sampler reports."""
        now = self.snapshot()
        return {
            "captures": now["captures"] - before["captures"],
            "replays": now["replays"] - before["replays"],
            "capture_seconds": round(now["capture_seconds"] - before["capture_seconds"], 4),
            "eager_steps": _counter_delta(now["eager_steps"], before["eager_steps"]),
            "prefill_replays": now["prefill_replays"] - before["prefill_replays"],
            "prefill_captures": now["prefill_captures"] - before["prefill_captures"],
            "eager_prefills": _counter_delta(now["eager_prefills"], before["eager_prefills"]),
            "skipped_steps": now["skipped_steps"] - before["skipped_steps"],
            "prefix_placements": _counter_delta(now["prefix_placements"], before.get("prefix_placements", {})),
        }


def _counter_delta(now: dict, before: dict) -> dict:
    """Per-reason counts added since `before`, reasons that did not grow left out."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


class LoggedOnce:
    """The fallback reasons already logged: each is logged the first time it happens, while the counters above count
    every step, so a 40-step eager prompt leaves one line in the log rather than forty."""

    def __init__(self):
        self._seen: set[str] = set()

    def first(self, key: str) -> bool:
        """True the first time `key` is seen (and records it)."""
        if key in self._seen:
            return False
        self._seen.add(key)
        return True
