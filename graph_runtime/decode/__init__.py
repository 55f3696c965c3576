"""Prefill and graph-replayed decode for a loaded transformer. `DecodeEngine` is the package's one entry; the other
names are the data it takes and returns (and the capture backend it can be given). docs/decode.md explains the
pieces behind it."""

from .engine import DecodeEngine
from .graph_entry import CudaGraphBackend
from .layout import TOKENS_PER_SLOT, TokenLayout
from .outcome import DECODE_MODES, DecodeOutcome
from .prefill import PrefixCache
from .stats import DecodeStats
from .step import DecodeInputs

__all__ = ["DECODE_MODES", "TOKENS_PER_SLOT", "CudaGraphBackend", "DecodeEngine", "DecodeInputs", "DecodeOutcome",
           "DecodeStats", "PrefixCache", "TokenLayout"]
