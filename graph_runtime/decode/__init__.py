"""Prefill and graph-replayed decode for a loaded transformer. `DecodeEngine` is the package's one entry
(`prefill`, `decode_step`, `release`); the other names are the data it takes and returns (and the capture backend it
can be given). docs/decode.md explains the pieces behind it."""

from .capture import CudaGraphBackend
from .engine import DECODE_MODES, DecodeEngine, DecodeOutcome, check_mode
from .layout import TOKENS_PER_SLOT, TokenLayout
from .prefill import PrefixCache
from .prefix_store import PLACEMENT_CHOICES, PLACEMENTS, check_placement, store_bytes
from .stats import DecodeStats
from .step import DecodeInputs

__all__ = ["DECODE_MODES", "TOKENS_PER_SLOT", "CudaGraphBackend", "DecodeEngine", "DecodeInputs", "DecodeOutcome",
           "DecodeStats", "PLACEMENTS", "PLACEMENT_CHOICES", "PrefixCache", "TokenLayout", "check_mode",
           "check_placement", "store_bytes"]
