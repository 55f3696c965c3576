"""One loaded transformer and everything that belongs to it, in one owner you can name.

Whoever loads a transformer holds its `LoadedTransformer`: the command line's generator, the ComfyUI nodes' model
handle (and the core MODEL built on it). It owns
- the decode engine (compiled blocks, captured graphs, statistics), created on first use and kept for as long as the
  model stays loaded, so graphs survive from one prompt to the next; one engine per attention kernel asked for
  (`use_attention`): changing the attention rebuilds the decode step over the same weights, never reloads them;
- the merged LoRA set (lora/merge.py);
- the multi-GPU runtime and its workers (parallel/runtime.py), when the model is sampled on several devices;
- the sampling runs using it now, and a release of its graphs asked for meanwhile: a run in flight keeps the entries
  it replays, so such a release is deferred until its last run ends;
- its block streamer while it is loaded only partly on its device (streaming.py; ComfyUI's lowvram loads), with the
  device slots its streamed blocks take turns in (stream_slots.py).

Nothing is attached to the transformer itself, and there is no process-wide list of engines: to enumerate the
loaded models, ask whoever holds them (the nodes' model cache).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref

import torch

from .decode import DecodeEngine
from .decode.attention import check_attention
from .lora.merge import LoraMerge, canonical
from .report import mib
from .streaming import DEFAULT_SLOTS, BlockStreamer, StreamPlan, plan_stream, plan_with

logger = logging.getLogger("kvgraph")


class LoadedTransformer:
    def __init__(self, transformer, attention: str = "auto", **engine_options):
        self.transformer = transformer
        self._engine_options = engine_options
        self._attention = check_attention(attention)  # what `engine` gives: the attention last asked for
        self._engines: dict[str, DecodeEngine] = {}  # attention -> its engine, each made on first use
        self._lora: LoraMerge | None = None
        self._parallel = None
        # Guards creating the engine, the LoRA state and the parallel runtime (each once: a prompt's thread and a
        # status route may ask at the same moment), and the run count with the release deferred until it is 0.
        self._lock = threading.RLock()
        self._runs = 0
        self._deferred_release: str | None = None
        self._streamer: BlockStreamer | None = None
        self._plans_seen: set = set()  # (resident blocks, blocks) of each partial load so far: each is logged once
        # The memory plan (memory/plan.py) of the request being loaded (`following`): its resident blocks bound a
        # partial load. The hook through which a plan reaches the load; the sampling request carries it too.
        self.memory_plan = None

    def __repr__(self) -> str:
        return f"LoadedTransformer({type(self.transformer).__name__})"

    # -- the engine ----------------------------------------------------------------------------------------------

    @property
    def engine(self) -> DecodeEngine:
        """The decode engine of the attention last asked for (`use_attention`; at first the one given at load),
        created on first use."""
        with self._lock:
            return self._engine_for(self._attention)

    @property
    def attention(self) -> str:
        """The attention kernel asked for last ("auto", "sdpa", "fa3" or "fp8"; decode/attention.py)."""
        return self._attention

    def use_attention(self, attention: str) -> DecodeEngine:
        """The engine whose decode step attends with `attention`, which becomes what `engine` gives. Another
        attention than the last one releases the graphs captured with the old one (at the end of the runs using them,
        if any), so only one kernel's graph entries hold memory; the weights stay where they are."""
        attention = check_attention(attention)
        with self._lock:
            changed, self._attention = attention != self._attention, attention
            engine = self._engine_for(attention)
        if changed:
            logger.info("KV-Graph: attention set to %s for %s.", attention, type(self.transformer).__name__)
            self.release_graphs(reason=f"attention changed to {attention}")
        return engine

    def _engine_for(self, attention: str) -> DecodeEngine:
        engine = self._engines.get(attention)
        if engine is None:
            engine = self._engines[attention] = DecodeEngine(self.transformer, attention=attention,
                                                             **self._engine_options)
        return engine

    def engines(self) -> list:
        """Every decode engine holding graphs of this model: its own (one per attention asked for) and, while it is
        sampled on several devices, rank 0's engines (one per rank plan), so the status and the release reach them
        all."""
        with self._lock:
            engines = list(self._engines.values())
        ranks = self._parallel.ranks if self._parallel is not None else None
        if ranks is not None:
            engines += [engine.local for engine in list(ranks.engines.values())]
        return engines

    # -- LoRA --------------------------------------------------------------------------------------------------------

    def lora_state(self, create: bool = True) -> LoraMerge | None:
        """The merged LoRA set's state, created on first use (None without `create` when there is none yet)."""
        if self._lora is None and create:
            with self._lock:
                if self._lora is None:
                    self._lora = LoraMerge(self.transformer)
        return self._lora

    def loras_in_use(self, choices):
        """Context manager for a sampling run with `choices` merged. A model that never had a LoRA and is asked for
        none is left untouched (no state is made for it)."""
        state = self.lora_state(create=bool(canonical(choices)))
        return contextlib.nullcontext(False) if state is None else state.using(choices)

    def merged_loras(self) -> dict:
        """What the status route reports: the merged LoRAs and the host memory their originals hold."""
        state = self.lora_state(create=False)
        return state.describe() if state is not None else {"loras": [], "weights": 0, "originals_bytes": 0,
                                                            "merges": 0, "last_merge_ms": 0.0}

    # -- several devices ---------------------------------------------------------------------------------------------

    def parallel_runtime(self, world: int):
        """The runtime for `world` ranks; another count stops the old one's workers first."""
        from .parallel.runtime import ParallelRuntime  # torch.distributed and the workers only when asked for

        with self._lock:
            runtime = self._parallel
            if runtime is not None and runtime.world != world:
                runtime.shutdown()
                runtime = None
            if runtime is None:
                runtime = self._parallel = ParallelRuntime(self, world)
                # The workers go with the model: when its owner is freed, so are they.
                weakref.finalize(self, runtime.shutdown)
        return runtime

    def shutdown_parallel(self) -> bool:
        """Stop the workers now (they start again on the next parallel prompt). True when any ran."""
        runtime = self._parallel
        if runtime is None or runtime.ranks is None:
            return False
        runtime.shutdown()
        return True

    # -- runs and release --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self):
        """Marks one sampling run for the duration of the block; a release asked for meanwhile happens at its end."""
        with self._lock:
            self._runs += 1
        try:
            yield self
        finally:
            with self._lock:
                self._runs -= 1
                reason = self._deferred_release if not self._runs else None
                if reason is not None:
                    self._deferred_release = None
            if reason is not None:
                self._release_now(reason)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._runs > 0

    def release_graphs(self, reason: str = "requested") -> str:
        """Release the graphs now, or when the runs using them end. Returns "released" or "deferred"."""
        with self._lock:
            if self._runs:
                self._deferred_release = reason
                return "deferred"
        self._release_now(reason)
        return "released"

    def _release_now(self, reason: str) -> None:
        for engine in self.engines():
            held = engine.release()
            if held.get("entries"):
                logger.info("KV-Graph: released %d decode graph entries (%s) of %s: %s.", held["entries"],
                            mib(held.get("bytes", 0)), engine.name, reason)


    # -- partial loads -----------------------------------------------------------------------------------------------

    def plan_within(self, budget: float, slots: int | None = None) -> StreamPlan | None:
        """How the transformer runs with at most `budget` bytes on its device (its streamed blocks taking turns in
        `slots` device slots: the memory plan's, else DEFAULT_SLOTS), or None when it fits whole; while `following` a
        memory plan that streams blocks, no more resident blocks than it keeps."""
        planned = self.memory_plan
        if slots is None:
            slots = planned.slots if planned is not None and planned.streamed_blocks else DEFAULT_SLOTS
        stream = plan_stream(self.transformer, budget, slots)
        if planned is None or not planned.streamed_blocks:
            return stream
        resident = planned.resident_blocks if stream is None else min(stream.resident_blocks, planned.resident_blocks)
        return plan_with(self.transformer, resident, slots, budget=budget)

    @property
    def wants_streaming(self) -> bool:
        """Whether the memory plan being followed streams blocks (then a whole load must become a streamed one)."""
        return self.memory_plan is not None and self.memory_plan.streamed_blocks > 0

    @contextlib.contextmanager
    def following(self, memory_plan):
        """Loads inside the block follow `memory_plan` (memory/plan.py; None: ComfyUI's figure alone)."""
        previous, self.memory_plan = self.memory_plan, memory_plan
        try:
            yield self
        finally:
            self.memory_plan = previous

    def follow_plan(self, device, memory_plan) -> None:
        """Load for `memory_plan` where nothing else manages the model (the command line): its resident blocks on
        `device` and the others streamed, or all of it there."""
        if memory_plan is None:
            return
        if memory_plan.streamed_blocks:
            plan = plan_with(self.transformer, memory_plan.resident_blocks, memory_plan.slots)
            if self.load_streamed(device, plan):
                logger.info("KV-Graph: %s.", plan.describe(device))
        elif self.streaming is not None:
            self.stop_streaming()
            self.transformer.to(device)

    @property
    def streaming(self) -> StreamPlan | None:
        """The plan it runs under while loaded partly (some blocks stream from the host), else None."""
        streamer = self._streamer
        return streamer.plan if streamer is not None else None

    @property
    def streamer(self) -> BlockStreamer | None:
        return self._streamer

    def load_streamed(self, device, plan: StreamPlan) -> bool:
        """Put the transformer on `device` under `plan` (a streamer with the same resident blocks and slots on the
        same device is kept as it is). Returns True the first time this model runs with this many resident blocks,
        so the caller says so once. Its captured graphs go: a whole load's read weights at addresses the streamed
        load does not keep, and a streamed step's graph is keyed on its plan and captured again."""
        with self._lock:
            current = self._streamer
            if current is not None and current.device == torch.device(device) and \
                    current.plan.resident_blocks == plan.resident_blocks and current.plan.slots == plan.slots:
                return False
            self.release_graphs(reason="loaded partly: its blocks stream from the host")
            if current is not None:
                current.stop()
                self._streamer = None
            self._streamer = BlockStreamer(self.transformer, device, plan).start()
            key = (plan.resident_blocks, plan.blocks, plan.slots)
            first = key not in self._plans_seen
            self._plans_seen.add(key)
            return first

    def stop_streaming(self, device=None) -> None:
        """Back from a partial load: the graphs captured over the streamer's slots are released, the slots freed,
        and every streamed block gets tensors of its own: on `device` when given (a whole load), else on the host,
        where an unload expects them."""
        with self._lock:
            streamer, self._streamer = self._streamer, None
            if streamer is not None:
                self.release_graphs(reason="streaming stopped: its graphs read the freed device slots")
        if streamer is not None:
            streamer.stop(device)
