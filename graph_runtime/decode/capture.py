"""What a captured graph holds and how it is captured and replayed: the decode entry's static buffers, a prefix
pass's static inputs, and the CUDA graph backend that captures and replays both into one memory pool.

Nothing here decides whether to replay or who may use an entry: `graphs.py` does, under its lock.
"""

from __future__ import annotations

import contextlib
import operator
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..kernels.preload import wait_for_preload
from ..free_memory import device_free_bytes
from .eligibility import static_reason
from .kv_format import FP8, NATIVE, Fp8KVStore, fp8_bytes
from .prefill import PrefixCache
from .prefix_store import GPU, PrefixStore, store_bytes
from .step import DecodeInputs, PrefixInputs


class CaptureRecord:
    """What a backend reads and writes on anything it captures and replays (a decode entry or a prefix pass).

    The backend reads `inputs` (the static buffers the body reads, set by the subclass) and `warmups`; capture sets
    `graph`, `output` (None when the body's results are buffers it writes), the counters and timings, and
    `graphs.py` records the weights' fingerprint it was captured against."""

    warmups = 1  # eager runs before capture

    def __init__(self):
        self.graph = None
        self.output = None
        self.captures = 0
        self.replays = 0
        self.pool_bytes = 0
        self.warmup_seconds = 0.0
        self.capture_seconds = 0.0
        self.weights_fingerprint: tuple | None = None


@dataclass(frozen=True)
class EntrySpec:
    """Shapes and dtypes of an entry's static buffers, known before the prefill runs."""

    batch: int
    prefix_len: int
    target_tokens: int
    heads: int
    head_dim: int
    num_blocks: int
    in_channels: int
    dtype: torch.dtype
    device: torch.device
    # The request's per-block residuals (a ControlNet), whose static copy the entry holds too; None for none.
    residuals: object = field(default=None, compare=False)
    kv_format: str = NATIVE  # how the K/V buffers hold values (kv_format.py); a stored placement's are native
    # fp8 only: per block, the q/k RMSNorm weights whose bound scales e4m3 q/k.
    qk_norms: tuple = field(default=(), compare=False)
    placement: str = GPU  # where the prefix K/V live (prefix_store.py)

    @classmethod
    def for_request(cls, transformer, layout, batch: int, heads: int | None = None,
                    residuals=None, kv_format: str = NATIVE, placement: str = GPU) -> "EntrySpec":
        """`heads`: the heads whose K/V the entry keeps (default all); `kv_format`: "native" or "fp8" (an int8 or
        host prefix's working buffers are native: `entry_kv_format`)."""
        config = transformer.config
        param = next(transformer.parameters())
        norms = () if kv_format != FP8 else tuple((b.attn.norm_q.weight, b.attn.norm_k.weight)
                                                  for b in transformer.transformer_blocks)
        return cls(batch=batch, prefix_len=layout.prefix_len, target_tokens=layout.target_tokens,
                   heads=heads or config.num_attention_heads, head_dim=config.attention_head_dim,
                   num_blocks=len(transformer.transformer_blocks), in_channels=config.in_channels,
                   dtype=param.dtype, device=param.device, residuals=residuals, kv_format=kv_format,
                   qk_norms=norms, placement=placement)

    @property
    def static_bytes(self) -> int:
        """What the entry's static buffers take on the device (K/V dominate: with the prefix on the GPU, 0.5 MiB
        per token per branch)."""
        kv, _ = store_bytes(self.placement, self.batch, self.prefix_len, self.target_tokens, self.heads,
                            self.head_dim, self.num_blocks, self.dtype.itemsize)
        hidden = self.batch * self.target_tokens * self.in_channels
        extra = 0 if self.residuals is None else self.residuals.static_bytes(self.batch, self.prefix_len,
                                                                            self.target_tokens, self.dtype)
        if self.kv_format == FP8:
            kv = fp8_bytes(self.batch, self.prefix_len, self.target_tokens, self.heads, self.head_dim,
                           self.num_blocks, self.dtype)
        return kv + hidden * self.dtype.itemsize + extra


def entry_kv_format(step, placement: str, device=None, dtype=None) -> str:
    """The K/V format of a graph entry for `placement`: the step's (fp8 where FlashAttention-3's FP8 forward runs)
    for a gpu prefix; native for an int8 or host prefix, whose working buffers the store fills in the model's dtype."""
    return step.kv_format(device, dtype) if placement == GPU else NATIVE


class DecodeGraphEntry(CaptureRecord):
    """Static buffers for one key, and the graph once captured.

    Buffers are allocated outside inference mode so `copy_` into them is legal whatever grad mode the caller runs
    in (ComfyUI runs nodes under `torch.inference_mode()`).
    """

    # Eager runs before the capture: one does the lazy set-up (kernels loaded, cuBLAS and cuDNN plans made, Triton
    # binaries compiled or read from their cache); compiled blocks may compile on the first call and settle on the
    # second, so a compiled step gets `COMPILED_WARMUPS`. Each warm-up is a whole step, paid on the first prompt of
    # every new shape.
    warmups = 1
    COMPILED_WARMUPS = 2

    def __init__(self, key, spec: EntrySpec):
        """`key`: the `graphs.GraphKey` it is stored under (None for a throwaway entry)."""
        super().__init__()
        self.key = key
        with torch.inference_mode(False):
            kv_shape = (spec.batch, spec.prefix_len + spec.target_tokens, spec.heads, spec.head_dim)
            rope_shape = (spec.target_tokens, 1, spec.head_dim // 2)
            zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=spec.device)  # noqa: E731
            # The "fp8" K/V format: e4m3 buffers, their scales, and the prefix pass's staging copy (kv_format.py).
            fp8 = None if spec.kv_format != FP8 else Fp8KVStore(
                spec.batch, spec.prefix_len, spec.target_tokens, spec.heads, spec.head_dim, spec.num_blocks,
                spec.dtype, spec.device, spec.qk_norms)
            # An int8 or host prefix: the store's working buffers stand in for the per-block ones.
            self.store = None if spec.placement == GPU else PrefixStore(
                spec.placement, spec.batch, spec.prefix_len, spec.target_tokens, spec.heads, spec.head_dim,
                spec.num_blocks, spec.dtype, spec.device)
            blocks = spec.num_blocks if self.store is None else 0
            self.inputs = DecodeInputs(
                hidden=zeros((spec.batch, spec.target_tokens, spec.in_channels), spec.dtype),
                timestep=zeros((spec.batch,), spec.dtype),
                k=fp8.k if fp8 else [zeros(kv_shape, spec.dtype) for _ in range(blocks)],
                v=fp8.v if fp8 else [zeros(kv_shape, spec.dtype) for _ in range(blocks)],
                cos=zeros(rope_shape, torch.float32),
                sin=zeros(rope_shape, torch.float32),
                prefix_len=spec.prefix_len,
                static_kv=True,
                skip=frozenset(getattr(key, "skip", ())),
                kv_format=spec.kv_format,
                fp8=fp8,
            )
            if self.store is not None:
                self.inputs.extra["prefix_store"] = self.store
            if spec.residuals is not None:
                self.inputs.extra["block_residuals"] = spec.residuals.static_copy(spec.prefix_len,
                                                                                  spec.target_tokens)
        self.prefix_graph: PrefixGraph | str | None = None  # the captured prefix pass, or why it failed
        self._sources: list[weakref.ReferenceType] = []  # what the prefix rows hold (see refresh_prefix)
        self._versions: list[tuple[int, int]] = []  # (index, version) of the normal tensors among them

    def prefill_kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Where a prefill writes the prefix rows: the K/V buffers themselves, or the fp8 format's model-dtype
        staging (loaded into the e4m3 buffers by `mark_current`)."""
        fp8 = self.inputs.fp8
        return (fp8.prefix_k, fp8.prefix_v) if fp8 is not None else (self.inputs.k, self.inputs.v)

    def _write_prefix(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """The prefix rows into the K/V buffers: copied, or quantized in the fp8 format."""
        if self.inputs.fp8 is not None:
            self.inputs.fp8.load_prefix(k, v)
            return
        prefix_len = self.inputs.prefix_len
        for dst, src in zip([*self.inputs.k, *self.inputs.v], [*k, *v]):
            dst[:, :prefix_len].copy_(src)

    @property
    def captured_prefix(self) -> PrefixGraph | None:
        return self.prefix_graph if isinstance(self.prefix_graph, PrefixGraph) else None

    @property
    def holds_graph(self) -> bool:
        """Whether a captured graph (decode step or prefix pass) of this entry uses the backend's pool."""
        return self.graph is not None or self.captured_prefix is not None

    def set_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """The target RoPE tables depend only on the layout, which the key pins; copied once per registration."""
        self.inputs.cos.copy_(cos)
        self.inputs.sin.copy_(sin)

    @property
    def nbytes(self) -> int:
        tensors = [self.inputs.hidden, self.inputs.timestep, self.inputs.cos, self.inputs.sin]
        tensors += self.inputs.fp8.tensors if self.inputs.fp8 is not None else [*self.inputs.k, *self.inputs.v]
        residuals = self.inputs.extra.get("block_residuals")
        if residuals is not None:
            tensors += [residuals.tokens, residuals.strength, *residuals.k, *residuals.v]
        prefix_graph = self.captured_prefix.nbytes if self.captured_prefix is not None else 0
        store = 0 if self.store is None else self.store.device_bytes
        return sum(t.numel() * t.element_size() for t in tensors) + self.pool_bytes + prefix_graph + store

    @property
    def host_bytes(self) -> int:
        """The pinned host memory a host prefix holds."""
        return 0 if self.store is None else self.store.host_bytes

    def load_inputs(self, hidden: torch.Tensor, timestep: torch.Tensor, residuals=None) -> None:
        self.inputs.hidden.copy_(hidden)
        self.inputs.timestep.copy_(timestep)
        if residuals is not None:
            residuals.load_into(self.inputs.extra["block_residuals"], self.inputs.prefix_len)

    def refresh_prefix(self, prefix: PrefixCache) -> bool:
        """Copy the request's prefix into the static buffers, unless they already hold exactly these tensors.

        Sameness is identity (weak references, so a finished request is not kept alive and a recycled address is
        not mistaken for it) plus the version counter for normal tensors, which in-place writes bump. Inference
        tensors have no version counter, but the runtime never writes a prefix after the prefill. Returns True
        when it copied.
        """
        sources = [*prefix.k, *prefix.v]
        if self._holds(sources):
            return False
        if self.store is not None:
            self.store.copy_from(prefix.store)
        else:
            self._write_prefix(prefix.k, prefix.v)
        self._sources = [weakref.ref(t) for t in sources]
        self._versions = [(i, t._version) for i, t in enumerate(sources) if not t.is_inference()]
        return True

    def _holds(self, sources: list[torch.Tensor]) -> bool:
        # Runs every step: identity is checked with C-level map()s (64 tensors for 32 blocks).
        if len(sources) != len(self._sources) or not all(map(operator.is_, map(_deref, self._sources), sources)):
            return False
        return all(sources[i]._version == seen for i, seen in self._versions)

    def forget_prefix(self) -> None:
        self._sources, self._versions = [], []

    def mark_current(self, prefix: PrefixCache) -> None:
        """Record `prefix` as what the buffers hold: the prefill wrote it there, and its tensors are views of them.

        No version is recorded: the views share the buffers' version counter, which every decode step bumps by
        writing the target rows, while the prefix rows themselves are only ever written by a prefill. In the fp8
        format the prefill wrote the staging copy, which is quantized into the e4m3 buffers here.
        """
        if self.inputs.fp8 is not None:
            self._write_prefix(prefix.k, prefix.v)
        self._sources = [weakref.ref(t) for t in (*prefix.k, *prefix.v)]
        self._versions = []


_deref = weakref.ReferenceType.__call__


class PrefixGraph(CaptureRecord):
    """One graph entry's captured prefix pass: static copies of the per-prompt inputs, and the graph.

    The backend captures and replays it like a decode entry; the pass returns nothing (its results are
    the K/V rows). One warm-up before capture is enough: an eager pass has no state that a second call would
    settle.
    """

    def __init__(self, like: PrefixInputs):
        super().__init__()
        # Outside inference mode, so copy_ into them is legal from any grad mode (as the decode entry's buffers).
        with torch.inference_mode(False):
            self.inputs = PrefixInputs(hidden=torch.empty_like(like.hidden),
                                       modulation=torch.empty_like(like.modulation), cos=like.cos.clone(),
                                       sin=like.sin.clone(), mask=like.mask.clone(),
                                       # own lists: a request's release clears its
                                       k=list(like.k), v=list(like.v), skip=like.skip,
                                       segments=like.segments)  # the key pins the layout, so its segments too

    def load(self, inputs: PrefixInputs) -> None:
        self.inputs.hidden.copy_(inputs.hidden)
        self.inputs.modulation.copy_(inputs.modulation)

    @property
    def nbytes(self) -> int:
        own = (self.inputs.hidden, self.inputs.modulation, self.inputs.cos, self.inputs.sin, self.inputs.mask)
        return sum(t.numel() * t.element_size() for t in own) + self.pool_bytes


@contextlib.contextmanager
def without_blas_workspace():
    """cuBLAS / cuBLASLt given no workspace while a graph is warmed up and captured; yields whether it applied.

    Why: with a workspace, cuBLAS's Hopper GEMMs use a dynamic tile scheduler whose counters it clears with a memset
    before each GEMM, and a captured graph records all of them (a large share of a step's kernels). Without
    one it picks the static-schedule variant of the same kernel and records none, so a replay launches fewer
    kernels and issues in less host time at the same device time (docs/performance.md). Setting the size for the
    whole process instead (`CUBLAS_WORKSPACE_CONFIG=:0:0`) would also take split-K GEMMs away from every other model
    in it. Here only the warm-up and the capture run without, the sizes are restored before the caller runs another
    GEMM, and torch re-sizes a stream's workspace when the setting changes. A GEMM another thread ran in that window
    would only get a kernel without the workspace, the same result up to rounding. Needs
    `torch.backends.cuda.cublas_workspace_size` (torch 2.13 and later); on older torch the graph keeps the memsets,
    correct either way.
    """
    cuda = torch.backends.cuda
    if not (hasattr(cuda, "cublas_workspace_size") and hasattr(cuda, "cublaslt_workspace_size")):
        yield False
        return
    saved = cuda.cublas_workspace_size(), cuda.cublaslt_workspace_size()
    cuda.cublas_workspace_size(0)
    cuda.cublaslt_workspace_size(0)
    try:
        yield True
    finally:
        cuda.cublas_workspace_size(saved[0])
        cuda.cublaslt_workspace_size(saved[1])


class CudaGraphBackend:
    """Captures and replays with `torch.cuda.CUDAGraph`, every entry of one engine sharing one memory pool.

    Sharing the pool is safe because replays are serialized by the graphs' lock (`graphs.py`) and each replay's
    output is cloned before the lock is released; intermediates of one graph may be overwritten by the next replay.
    """

    name = "cuda-graph"

    def __init__(self):
        self._pool = None
        # Captures get no cuBLAS workspace (see `without_blas_workspace`); off only to measure the difference.
        self.capture_without_blas_workspace = True

    def reset_pool(self) -> None:
        """Forget the pool once no captured graph uses it: the allocator frees a private pool with its last graph,
        and capturing into the stale handle afterwards trips an internal assert."""
        self._pool = None

    def free_bytes(self, device: torch.device) -> int | None:
        """Memory a new entry can use without the allocator asking the driver for more than the card has left."""
        return device_free_bytes(device)

    def unavailable_reason(self, transformer, params=None) -> str | None:
        return static_reason(transformer, params)

    def capture_settings(self):
        """What a warm-up and capture run under. The same body run eagerly under these settings launches the
        graph's kernels, so it is what a replay is compared with exactly."""
        return without_blas_workspace() if self.capture_without_blas_workspace else contextlib.nullcontext()

    def capture(self, entry: DecodeGraphEntry, body) -> None:
        with self.capture_settings():
            self._capture(entry, body)

    def _capture(self, entry: DecodeGraphEntry, body) -> None:
        # The preload thread's GPU work and Triton set-up must not run beside a capture (kernels/preload.py).
        wait_for_preload()
        device = entry.inputs.hidden.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        # Warm up on a side stream with the exact computation to record, so cuBLAS workspaces, autotuning and lazy
        # buffers are created outside the capture. Decode only writes the target rows of the static K/V, which
        # the captured run overwrites, so warm-up runs are idempotent.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(entry.warmups):
                body(entry.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        # Warm-up includes compiling the blocks the first time a compiled step meets a shape.
        entry.warmup_seconds = time.perf_counter() - start
        start = time.perf_counter()
        # `torch.cuda.graph` empties the allocator's cache before capturing; doing it first makes the growth of the
        # reserved memory across the capture the pool's new segments, not that minus the warm-up's freed cache.
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.output = body(entry.inputs)
        entry.graph = graph
        entry.captures += 1
        entry.pool_bytes = max(0, torch.cuda.memory_reserved(device) - reserved_before)
        entry.capture_seconds = time.perf_counter() - start

    def replay(self, entry: DecodeGraphEntry) -> torch.Tensor | None:
        entry.graph.replay()
        entry.replays += 1
        # The output lives in the shared pool; the next replay of any entry may overwrite it. (A prefix pass has
        # none: its results are the K/V rows it writes.)
        return None if entry.output is None else entry.output.clone()
