"""The attention kernel every block of the decode step and the prefix pass runs, chosen once per device and dtype
the first time a step runs there: FlashAttention-3 on Hopper where its kernels are installed (the optional `fa3`
extra: `pip install comfyui-kv-graph[fa3]`), PyTorch's SDPA everywhere else.

A choice that falls back from FlashAttention-3 to SDPA (not installed, not a Hopper GPU, a dtype it has no kernel
for) is logged once per process with its reason and counted in the engine's statistics, like every other fallback.
Results are SDPA's within bf16 rounding either way; graph keys name the kernel, so graphs of the two never mix.

FlashAttention-3 has no arbitrary mask: a masked call (the eager padded-text path) runs SDPA, and the prefix pass's
block-causal mask is run one prefix segment at a time (text causal, an image block over every key up to its end),
which is exactly the rule the mask encodes.

`fp8` is FlashAttention-3's FP8 forward for the decode step's graph entries: their K/V buffers hold e4m3
(`kv_format.py`) and the q/k norm + RoPE kernel writes e4m3 q/k/v itself. Everything that attends in bf16 (the prefix
pass, an eager step) runs FlashAttention-3's bf16 forward. Where FlashAttention-3 cannot run, or its build has no FP8
kernel, `fp8` falls back to what `auto` would pick there (SDPA), logged once and counted, with the reason prefixed by
`FP8_FALLBACK`.

`auto` takes `fp8` for a model whose step `prefers_fp8` (decode/step.py: INT8 Linears at the 128-wide heads where FP8
attention was measured within the INT8 ConvRot bound over the whole step): a user who loads INT8 weights has accepted
that bound, and FP8 attention's own error is small beside W8A8's. Any other model keeps FlashAttention-3 bf16 under
`auto`. Where `auto`'s FP8 cannot run it runs what `auto` runs without it, logged once (info) and counted.
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError

logger = logging.getLogger("kvgraph")

AUTO = "auto"
SDPA = "sdpa"
FA3 = "fa3"
FP8 = "fp8"
FA3_FP8 = "fa3-fp8"  # the kernel's name in statistics and graph keys
ATTENTION_CHOICES = (AUTO, SDPA, FA3, FP8)
FA3_MODULE = "fa3_fwd_interface"  # the `fa3-fwd` wheel: FlashAttention-3's forward on torch's stable ABI

# Reasons a device runs SDPA where FlashAttention-3 was asked for ("auto" or "fa3"); stable: they are stats keys.
NOT_CUDA = "FlashAttention-3 needs a CUDA device"
NOT_HOPPER = "FlashAttention-3 needs a Hopper GPU (compute capability 9.0)"
NOT_BF16 = "FlashAttention-3 is installed for bf16 only"
NOT_INSTALLED = "FlashAttention-3 is not installed (pip install comfyui-kv-graph[fa3])"
BROKEN = "FlashAttention-3 failed to load"
FP8_FALLBACK = "FP8 attention runs in bf16"
NO_FP8_KERNEL = "this FlashAttention-3 build has no FP8 forward"


ATTENTION_EXPECTED = ("one of auto (FlashAttention-3 where it runs, FP8 under INT8 weights, else SDPA), sdpa, fa3, "
                      "fp8 (fa3: FlashAttention-3 bf16; fp8: its FP8 forward, on Hopper)")


def check_attention(value, name: str = "attention") -> str:
    """`value` when it is an attention choice, else a refusal naming the input `name`."""
    if value not in ATTENTION_CHOICES:
        raise InputError(name, value, ATTENTION_EXPECTED)
    return value


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


class Fa3Fp8Attention(Fa3Attention):
    """FlashAttention-3 for a step whose graph entries keep e4m3 K/V: `fp8` attends e4m3 q/k/v with per-head
    descales; a bf16 call (the prefix pass, an eager step) is FA3's bf16 forward, as `Fa3Attention`'s."""

    name = FA3_FP8

    def fp8(self, q8, k8, v8, descale, out_dtype):
        """`[B, S, H, D]` e4m3 q and `[B, L, H, D]` e4m3 k/v; `descale` `[3, B, H]` fp32 (q, k, v scales)."""
        out = self._forward(q8, k8, v8, q_descale=descale[0], k_descale=descale[1], v_descale=descale[2])[0]
        return out.to(out_dtype)


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
    """`(backend, reason)`: the kernel for `device` and `dtype`; `reason` says why FlashAttention-3 (or, for `fp8`,
    its FP8 forward) was not taken where it was asked for (None when it was, or when SDPA was asked for)."""
    backend, reason = _choose(device, dtype, requested, loader)
    if requested == FP8 and reason is not None:
        reason = f"{FP8_FALLBACK}: {reason}"
    return backend, reason


def _choose(device, dtype, requested, loader):
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
    if requested == FP8:
        reason = probe_fp8(forward, device)
        return (Fa3Attention(forward), reason) if reason else (Fa3Fp8Attention(forward), None)
    return Fa3Attention(forward), None


def probe_fp8(forward, device) -> str | None:
    """None when FlashAttention-3's FP8 forward runs on `device` (one tiny call, made once per device when the
    kernel is chosen, before any capture), else the reason: a build may leave its FP8 kernels out."""
    try:
        q = torch.zeros(1, 128, 1, 128, device=device, dtype=torch.float8_e4m3fn)
        one = torch.ones(1, 1, device=device)
        forward(q, q, q, q_descale=one, k_descale=one, v_descale=one)
    except Exception as exc:  # noqa: BLE001 - a missing or broken FP8 kernel must not stop the model
        return f"{NO_FP8_KERNEL}: {type(exc).__name__}: {exc}"[:300]
    return None


_KERNEL_NAMES = {SDPA: "SDPA", FA3: "FlashAttention-3", FA3_FP8: "FlashAttention-3 FP8 (e4m3 K/V in graph entries)"}
_logged: set[str] = set()  # fallback reasons already logged in this process


class AttentionChoice:
    """One step's kernel per (device, dtype), chosen at its first use and kept. `requested`: "auto" (FA3 where it
    runs, its FP8 forward where `prefers_fp8` says so), "sdpa", "fa3" (the same as auto, but a fallback is logged as a warning), or "fp8" (FA3 with e4m3 K/V in
    the graph entries; a fallback is a warning too). Fallbacks are counted in `fallbacks` (reason -> devices),
    which the engine's statistics read."""

    def __init__(self, requested: str = "auto", loader=_load_fa3, prefers_fp8=None):
        """`prefers_fp8`: a callable saying, at the first choice on a device, whether `auto` takes FP8 attention for
        this model (the step's rule); None: it never does."""
        if requested not in ATTENTION_CHOICES:
            raise ValueError(f"attention {requested!r} is invalid: expected one of {', '.join(ATTENTION_CHOICES)}")
        self.requested = requested
        self._loader = loader
        self._prefers_fp8 = prefers_fp8
        self._chosen: dict[tuple, object] = {}
        self.fallbacks: Counter = Counter()

    def pick(self, device, dtype):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # one choice however the device is named
        key = (str(device), dtype)
        backend = self._chosen.get(key)
        if backend is None:
            backend, reason = self._choose(device, dtype)
            self._chosen[key] = backend
            if reason is not None:
                self.fallbacks[reason] += 1
                if reason not in _logged:
                    _logged.add(reason)
                    level = logging.WARNING if self.requested in (FA3, FP8) else logging.INFO
                    logger.log(level, "KV-Graph: attention runs on %s on %s: %s.", _KERNEL_NAMES[backend.name],
                               device, reason)
            elif backend.name != SDPA:
                logger.info("KV-Graph: attention runs on %s on %s.", _KERNEL_NAMES[backend.name], device)
        return backend

    def _choose(self, device, dtype):
        if self.requested != AUTO or self._prefers_fp8 is None or not self._prefers_fp8():
            return choose(device, dtype, self.requested, self._loader)
        backend, reason = choose(device, dtype, FP8, self._loader)
        if backend.name == SDPA:  # no FlashAttention-3 at all: what plain `auto` says about it
            reason = reason.removeprefix(f"{FP8_FALLBACK}: ")
        return backend, reason

    def count_fallback(self, reason: str, device) -> None:
        """Count (and log once per process) a fallback decided after the kernel was chosen."""
        self.fallbacks[reason] += 1
        if reason not in _logged:
            _logged.add(reason)
            logger.log(logging.INFO if self.requested == AUTO else logging.WARNING, "KV-Graph: on %s: %s.", device,
                       reason)

    def chosen(self) -> dict:
        """`{device: kernel name}` of every choice made so far (for the statistics)."""
        return {f"{device} {str(dtype).removeprefix('torch.')}": backend.name
                for (device, dtype), backend in self._chosen.items()}
