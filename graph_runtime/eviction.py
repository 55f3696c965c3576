"""Which cached models to let go: least recently used first, until the cache is back within its byte limit and the
host has the room a RAM-pressure policy asks for.

Pure policy (the ComfyUI glue in nodes/comfyui/model_cache.py supplies the entries, the limit and the shortfall), so
it is tested without models.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Hashable

from .free_memory import host_total_bytes
from .report import GiB

logger = logging.getLogger("kvgraph")

LIMIT_VARIABLE = "KVGRAPH_MODEL_CACHE_GB"
# Without a setting the cached models may hold half the machine's RAM: the full-size transformer, text encoder and
# VAE of one precision (about 30 GB in bf16) on a 64 GB machine, leaving the rest to ComfyUI and the workflow.
DEFAULT_RAM_FRACTION = 0.5


@dataclass(frozen=True)
class Entry:
    key: Hashable
    bytes: int
    evictable: bool = True  # False while a node uses it or the running prompt loaded it


def limit_bytes() -> int | None:
    """The cache's byte limit: `KVGRAPH_MODEL_CACHE_GB` (a number of GiB; "none" for no limit), else half the host's
    RAM (None when that is unknown). A value that is not a number is ignored, with a warning."""
    value = os.environ.get(LIMIT_VARIABLE, "").strip()
    if value.lower() == "none":
        return None
    if value:
        try:
            gib = float(value)
            if gib >= 0:
                return int(gib * GiB)
        except ValueError:
            pass
        logger.warning("KV-Graph: %s=%r is not a number of GiB (or 'none'); using the default limit.",
                       LIMIT_VARIABLE, value)
    total = host_total_bytes()
    return None if total is None else int(total * DEFAULT_RAM_FRACTION)


def evictions(entries: list[Entry], limit: int | None, shortfall: int = 0) -> list[Entry]:
    """The entries to drop, least recently used (first in `entries`) first, skipping those not evictable: until the
    total is within `limit` (None: no limit) and at least `shortfall` bytes are let go (the RAM a pressure policy
    wants back; 0: none)."""
    over = sum(e.bytes for e in entries) - limit if limit is not None else 0
    chosen = []
    for entry in entries:
        if over <= 0 and shortfall <= 0:
            break
        if not entry.evictable:
            continue
        chosen.append(entry)
        over -= entry.bytes
        shortfall -= entry.bytes
    return chosen
