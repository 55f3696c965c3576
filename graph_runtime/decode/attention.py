"""The attention kernel every block of the decode step and the prefix pass runs, chosen once per device and dtype
the first time a step runs there: FlashAttention-3 on Hopper where its kernels are installed (the optional `fa3`
extra: `pip install comfyui-kv-graph[fa3]`), PyTorch's SDPA everywhere else.

A choice that falls back from FlashAttention-3 to SDPA (not installed, not a Hopper GPU, a dtype it has no kernel
for) is logged once per process with its reason and counted in the engine's statistics, like every other fallback.
Results are SDPA's within bf16 rounding either way; graph keys name the kernel, so graphs of the two never mix.

FlashAttention-3 has no arbitrary mask: a masked call (the eager padded-text path) runs SDPA, and the prefix pass's
block-causal mask is run one prefix segment at a time (text causal, an image block over every key up to its end),
which is exactly the rule the mask encodes.
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger("kvgraph")

SDPA = "sdpa"
FA3 = "fa3"
ATTENTION_CHOICES = ("auto", SDPA, FA3)
FA3_MODULE = "fa3_fwd_interface"  # the `fa3-fwd` wheel: FlashAttention-3's forward on torch's stable ABI

# Reasons a device runs SDPA where FlashAttention-3 was asked for ("auto" or "fa3"); stable: they are stats keys.
NOT_CUDA = "FlashAttention-3 needs a CUDA device"
NOT_HOPPER = "FlashAttention-3 needs a Hopper GPU (compute capability 9.0)"
NOT_BF16 = "FlashAttention-3 is installed for bf16 only"
NOT_INSTALLED = "FlashAttention-3 is not installed (pip install comfyui-kv-graph[fa3])"
BROKEN = "FlashAttention-3 failed to load"


@dataclass(frozen=True)
class PrefixMask:
    """The prefix pass's mask: the dense `[B or 1, 1, P, P]` bool mask SDPA reads, and the prefix segments
    `(start, end, is_text)` it encodes, or None when key padding makes it more than the segments."""

    dense: torch.Tensor
    segments: tuple | None


def dense_mask(attn_mask):
    """The boolean mask SDPA reads, from None, a tensor or a `PrefixMask`."""
    return attn_mask.dense if isinstance(attn_mask, PrefixMask) else attn_mask


def sdpa(q, keys, values, attn_mask):
    """SDPA over `[B, S, H, D]` queries and `[B, L, H, D]` keys/values; returns `[B, S, H, D]`."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=dense_mask(attn_mask))
    return out.transpose(1, 2).type_as(q)


class SdpaAttention:
    name = SDPA

    def __call__(self, q, keys, values, attn_mask):
        return sdpa(q, keys, values, attn_mask)


class Fa3Attention:
    """FlashAttention-3's forward in the step's own `[B, S, H, D]` layout (no transposes); capture-safe (no host
    sync, no allocation outside the call) and traceable (a torch custom op with a fake kernel)."""

    name = FA3

    def __init__(self, forward):
        self._forward = forward  # fa3_fwd_interface._flash_attn_forward: (q, k, v, ..., causal) -> (out, lse, ...)

    def __call__(self, q, keys, values, attn_mask):
        if attn_mask is None:
            return self._forward(q, keys, values)[0]
        segments = attn_mask.segments if isinstance(attn_mask, PrefixMask) else None
        if segments is None:
            return sdpa(q, keys, values, attn_mask)  # an arbitrary (padded-text) mask: no FA3 kernel for it
        # Each segment's rows see every key before the segment and, within it, all keys (an image) or those up to
        # themselves (text): FA3's bottom-right-aligned causal mask over keys [0, end) is exactly that.
        return torch.cat([self._forward(q[:, start:end], keys[:, :end], values[:, :end], causal=is_text)[0]
                          for start, end, is_text in segments], dim=1)


SDPA_ATTENTION = SdpaAttention()


def _load_fa3():
    """FlashAttention-3's forward custom op, or the reason it cannot be had."""
    try:
        module = importlib.import_module(FA3_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name in (FA3_MODULE, "fa3_fwd"):
            return None, NOT_INSTALLED
        return None, f"{BROKEN}: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken build (ABI, CUDA mismatch) must not stop the model
        return None, f"{BROKEN}: {type(exc).__name__}: {exc}"
    forward = getattr(module, "_flash_attn_forward", None)
    if forward is None:
        return None, f"{BROKEN}: {FA3_MODULE} has no _flash_attn_forward"
    return forward, None


def choose(device: torch.device, dtype: torch.dtype, requested: str = "auto", loader=_load_fa3):
    """`(backend, reason)`: the kernel for `device` and `dtype`; `reason` says why FlashAttention-3 was not taken
    where it was asked for (None when it was, or when SDPA was asked for)."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention {requested!r} is invalid: expected one of {', '.join(ATTENTION_CHOICES)}")
    if requested == SDPA:
        return SDPA_ATTENTION, None
    device = torch.device(device)
    if device.type != "cuda":
        return SDPA_ATTENTION, NOT_CUDA
    if torch.cuda.get_device_capability(device)[0] != 9:
        return SDPA_ATTENTION, NOT_HOPPER
    if dtype != torch.bfloat16:
        return SDPA_ATTENTION, NOT_BF16
    forward, reason = loader()
    if forward is None:
        return SDPA_ATTENTION, reason
    return Fa3Attention(forward), None


_logged: set[str] = set()  # fallback reasons already logged in this process


class AttentionChoice:
    """One step's kernel per (device, dtype), chosen at its first use and kept. `requested`: "auto" (FA3 where it
    runs), "sdpa", or "fa3" (the same as auto, but a fallback is logged as a warning). Falls back are counted in
    `fallbacks` (reason -> devices), which the engine's statistics read."""

    def __init__(self, requested: str = "auto", loader=_load_fa3):
        if requested not in ATTENTION_CHOICES:
            raise ValueError(f"attention {requested!r} is invalid: expected one of {', '.join(ATTENTION_CHOICES)}")
        self.requested = requested
        self._loader = loader
        self._chosen: dict[tuple, object] = {}
        self.fallbacks: Counter = Counter()

    def pick(self, device, dtype):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # one choice however the device is named
        key = (str(device), dtype)
        backend = self._chosen.get(key)
        if backend is None:
            backend, reason = choose(device, dtype, self.requested, self._loader)
            self._chosen[key] = backend
            if reason is not None:
                self.fallbacks[reason] += 1
                if reason not in _logged:
                    _logged.add(reason)
                    level = logging.WARNING if self.requested == FA3 else logging.INFO
                    logger.log(level, "KV-Graph: attention runs on SDPA on %s: %s.", device, reason)
            elif backend.name != SDPA:
                logger.info("KV-Graph: attention runs on FlashAttention-3 on %s.", device)
        return backend

    def chosen(self) -> dict:
        """`{device: kernel name}` of every choice made so far (for the statistics)."""
        return {f"{device} {str(dtype).removeprefix('torch.')}": backend.name
                for (device, dtype), backend in self._chosen.items()}
