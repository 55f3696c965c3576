"""The LoRA set merged into one loaded transformer, and the runs that use it.

One `LoraMerge` belongs to each loaded transformer (its owner, graph_runtime/loaded.py, holds it beside the decode
engine), so every workflow that drives the model sees the same merged set. A run asks for its set with `using`:
when it differs from the merged one, the weights are restored and the new set merged (in place, see `weights.py`);
the same set again does nothing. Runs that want the merged set may overlap; a run that wants another set waits
until they end, so weights never change under a prompt that is sampling.

The set is what the user chained: each LoRA file by identity (path, size, mtime) with its strength. It is compared
in a canonical order (the sum of the deltas does not depend on the chain's order), and strength-0 entries are left
out (they change nothing), so strength 0 and no LoRA are the same set: the original weights, restored bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ..errors import CheckpointError, NonFiniteError
from ..stream_slots import merge_device, weights_on_host
from .file import LoraFile
from .weights import weight_slot

logger = logging.getLogger("kvgraph")

@dataclass(frozen=True, eq=False)
class LoraChoice:
    """One KV-Graph Load LoRA node's pick: a read LoRA file and the strength to merge it at."""

    lora: LoraFile
    strength: float

    @property
    def key(self) -> tuple:
        return (self.lora.identity, self.strength)

    def describe(self) -> dict:
        return {"name": self.lora.name, "path": self.lora.path, "strength": self.strength}


def canonical(choices) -> tuple[LoraChoice, ...]:
    """The choices that change the model, in an order that depends only on the set."""
    return tuple(sorted((c for c in choices if c.strength != 0.0), key=lambda c: repr(c.key)))


class LoraMerge:
    def __init__(self, transformer: torch.nn.Module):
        self._model = weakref.ref(transformer)
        self._slots: dict[str, object] = {}  # parameter name -> PlainWeight / QuantizedWeight, holding its original
        self.merged: tuple[LoraChoice, ...] = ()
        self._changed = threading.Condition()
        self._runs = 0
        self.merges = 0  # times the weights were changed (a merge, a switch or a restore)
        self.last_merge_ms = 0.0

    @property
    def merged_key(self) -> tuple:
        return tuple(c.key for c in self.merged)

    @contextlib.contextmanager
    def using(self, choices):
        """Hold `choices` merged for the duration of a run: merge them first if another set is merged (waiting
        for the runs using that one to end). Yields True when this call changed the weights."""
        wanted = canonical(choices)
        key = tuple(c.key for c in wanted)
        with self._changed:
            while self._runs and key != self.merged_key:
                self._changed.wait()
            changed = key != self.merged_key
            if changed:
                self._switch(wanted)
            self._runs += 1
            merged = self.merged
        try:
            yield changed
        except NonFiniteError as exc:
            if not merged:
                raise
            # The model's own weights were checked finite at load and the merged ones at the merge: what overflowed
            # is the model run with these LoRAs, so they are named, not the checkpoint.
            names = ", ".join(f"{c.lora.name} at strength {c.strength:g}" for c in merged)
            raise NonFiniteError(exc.what, f"the run had LoRAs merged ({names}), which are the likely cause: their "
                                           "changes overflow the model's activations at this strength; lower it, or "
                                           "run without them to check the model") from exc
        finally:
            with self._changed:
                self._runs -= 1
                self._changed.notify_all()

    def apply(self, choices) -> bool:
        """Merge `choices` now (restore and re-merge when the set differs). Returns True when the weights changed."""
        with self.using(choices) as changed:
            return changed

    def _switch(self, wanted: tuple[LoraChoice, ...]) -> None:
        model = self._model()
        if model is None:
            return
        started = time.perf_counter()
        patches: dict[str, list] = {}
        for choice in wanted:
            for name, items in choice.lora.patches.items():
                patches.setdefault(name, []).extend((choice.strength, patch) for patch in items)
        try:
            overflowed = self._write(model, patches)
            if overflowed:
                raise merge_overflow(wanted, overflowed, model)
        except BaseException:
            # Never leave a half-merged model behind: back to the originals, so the next run starts clean.
            self.merged = ()
            self._write(model, {})
            raise
        self.merged = wanted
        self.merges += 1
        self.last_merge_ms = (time.perf_counter() - started) * 1e3
        if wanted:
            names = ", ".join(f"{c.lora.name} ({c.strength:g})" for c in wanted)
            logger.info("KV-Graph: merged %s into %d weights of %s in %.0f ms.", names, len(patches),
                        type(model).__name__, self.last_merge_ms)
        else:
            logger.info("KV-Graph: restored the original weights of %s (no LoRA) in %.0f ms.", type(model).__name__,
                        self.last_merge_ms)

    def _write(self, model, patches: dict[str, list]) -> list[str]:
        """Restore every weight not in `patches`, merge every weight in it (from its original). Returns the merged
        weights that are not finite in their dtype (one host sync for all of them)."""
        # Deltas and host copies are made as normal tensors (ComfyUI runs nodes under inference mode; each weight is
        # written in its own mode, see weights.writable), and in true fp32 (TF32 would round the products to
        # 10-bit mantissas).
        # A streamed block's weights are merged into its host copy, which every step copies into its device slot
        # (a write into the slot would be overwritten by the next upload).
        with torch.inference_mode(False), torch.no_grad(), _ieee_fp32_matmul(), weights_on_host(model):
            for name, slot in self._slots.items():
                if name not in patches:
                    slot.restore()
            checks = {}
            compute = merge_device(model)
            for name, items in patches.items():
                slot = self._slots.get(name)
                if slot is None:
                    slot = self._slots[name] = weight_slot(model, name)  # keeps the original before changing it
                device = slot.device if compute is None or slot.device.type != "cpu" else compute
                delta = items[0][1].delta(device, items[0][0])
                for strength, patch in items[1:]:
                    delta.add_(patch.delta(device, strength))
                checks[name] = slot.merge(delta)
            if not patches:
                self._slots.clear()  # every weight is its original again: the host copies can go
            if next(model.parameters()).device.type == "cuda":
                torch.cuda.synchronize()
            if not checks:
                return []
            flags = torch.stack([flag.cpu() for flag in checks.values()])
            return [] if bool(flags.all()) else [name for name, ok in zip(checks, flags.tolist()) if not ok]

    def forget(self) -> None:
        """Call when the weights were put back to the file's values by other means (a reload from the file or
        from a pinned copy made at load): nothing is merged any more, and the kept originals are dropped."""
        with self._changed:
            self._slots.clear()
            self.merged = ()

    def originals_bytes(self) -> int:
        return sum(slot.nbytes for slot in list(self._slots.values()))  # list(): one C-level snapshot of the dict

    def describe(self) -> dict:
        """Read without the lock: the status route runs on ComfyUI's event loop and must not wait for a merge (it
        then reports the set merged before it)."""
        return {"loras": [c.describe() for c in self.merged], "weights": len(self._slots),
                "originals_bytes": self.originals_bytes(), "merges": self.merges,
                "last_merge_ms": round(self.last_merge_ms, 1)}


def merge_overflow(wanted: tuple[LoraChoice, ...], weights: list[str], model) -> CheckpointError:
    """The refusal of a merge that left weights infinite or NaN: the transformer's own weights were checked finite
    when it was loaded, so the LoRA (its values times its strength) is what overflowed; it names the LoRA file(s)
    changing the first such weight, with their strengths."""
    first = weights[0]
    culprits = [c for c in wanted if first in c.lora.patches] or list(wanted)
    param = model.get_parameter(first)
    # A quantized weight is checked as the float32 sum it is re-quantized from.
    dtype = str(param.dtype if param.is_floating_point() else torch.float32).removeprefix("torch.")
    named = " and ".join(f"{c.lora.name} at strength {c.strength:g}" for c in culprits)
    more = f" (and {len(weights) - 1} more weight{'s' if len(weights) > 2 else ''})" if len(weights) > 1 else ""
    problem = (f"merging this LoRA ({named}) makes the weight {first}{more} infinite or NaN in {dtype}: the LoRA's "
               "changes overflow the weights, which were finite before the merge. The original weights are back; "
               "lower the strength or check the LoRA file.")
    return CheckpointError(culprits[0].lora.path, problem, f"a LoRA whose changes at this strength stay within "
                                                           f"{dtype}'s range")


@contextlib.contextmanager
def _ieee_fp32_matmul():
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = saved
