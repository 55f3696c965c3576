"""One captured decode graph: its key, static buffers, the graph and its capture/replay mechanics."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from .prefill import PrefixCache
from .step import DecodeInputs


@dataclass(frozen=True)
class GraphKey:
    """Everything a captured step's shapes and addresses depend on.

    `layout` is the full token layout signature (prefix runs and every image shape), so equal token counts with
    different layouts, whose RoPE tables differ, never share an entry.
    """

    branch: str
    batch: int
    layout: tuple
    dtype: str
    device: str
    backend: str

    def describe(self) -> dict:
        prefix_len, target_tokens, shapes, _ = self.layout
        return {
            "branch": self.branch,
            "batch": self.batch,
            "prefix_tokens": prefix_len,
            "target_tokens": target_tokens,
            "image_shapes": [list(s) for s in shapes],
            "dtype": self.dtype,
            "device": self.device,
            "backend": self.backend,
        }


@dataclass
class FailedEntry:
    """Marker left where an allocation or capture failed: the key stays eager, holding no tensors."""

    reason: str
    detail: str


class DecodeGraphEntry:
    """Static buffers for one key, and the graph once captured.

    Buffers are allocated outside inference mode so `copy_` into them is legal whatever grad mode the caller runs
    in (ComfyUI runs nodes under `torch.inference_mode()`).
    """

    def __init__(self, key: GraphKey, prefix: PrefixCache, in_channels: int, dtype: torch.dtype):
        batch, prefix_len, heads, head_dim = prefix.k[0].shape
        target = prefix.layout.target_tokens
        device = prefix.k[0].device
        self.key = key
        with torch.inference_mode(False):
            kv_shape = (batch, prefix_len + target, heads, head_dim)
            self.inputs = DecodeInputs(
                hidden=torch.zeros(batch, target, in_channels, dtype=dtype, device=device),
                timestep=torch.zeros(batch, dtype=dtype, device=device),
                k=[torch.zeros(kv_shape, dtype=k.dtype, device=device) for k in prefix.k],
                v=[torch.zeros(kv_shape, dtype=v.dtype, device=device) for v in prefix.v],
                # The target RoPE tables depend only on the layout, which the key pins; clone them out of the
                # prefill's (possibly inference-mode) tensors.
                cos=prefix.cos.clone(),
                sin=prefix.sin.clone(),
                prefix_len=prefix_len,
                static_kv=True,
            )
        self.graph = None
        self.output: torch.Tensor | None = None
        self.captures = 0
        self.replays = 0
        self.pool_bytes = 0
        self.weights_fingerprint: int | None = None
        self._sources: list[tuple[weakref.ReferenceType, int | None]] = []

    @property
    def nbytes(self) -> int:
        tensors = [self.inputs.hidden, self.inputs.timestep, self.inputs.cos, self.inputs.sin,
                   *self.inputs.k, *self.inputs.v]
        return sum(t.numel() * t.element_size() for t in tensors) + self.pool_bytes

    def load_inputs(self, hidden: torch.Tensor, timestep: torch.Tensor) -> None:
        self.inputs.hidden.copy_(hidden)
        self.inputs.timestep.copy_(timestep)

    def refresh_prefix(self, prefix: PrefixCache) -> bool:
        """Copy the request's prefix into the static buffers, unless they already hold exactly these tensors.

        Sameness is identity (weak references, so a finished request is not kept alive and a recycled address is
        not mistaken for it) plus the version counter for normal tensors, which in-place writes bump. Inference
        tensors have no version counter, but the runtime never writes a prefix after the prefill. Returns True
        when it copied.
        """
        sources = [*prefix.k, *prefix.v]
        versions = [None if t.is_inference() else t._version for t in sources]
        if len(sources) == len(self._sources) and all(
            ref() is t and version == seen for (ref, seen), t, version in zip(self._sources, sources, versions)
        ):
            return False
        prefix_len = self.inputs.prefix_len
        for dst, src in zip([*self.inputs.k, *self.inputs.v], sources):
            dst[:, :prefix_len].copy_(src)
        self._sources = [(weakref.ref(t), v) for t, v in zip(sources, versions)]
        return True

    def forget_prefix(self) -> None:
        self._sources = []


class CudaGraphBackend:
    """Captures and replays with `torch.cuda.CUDAGraph`, every entry of a manager sharing one memory pool.

    Sharing the pool is safe because replays are serialized by the manager's lock and each replay's output is
    cloned before the lock is released; intermediates of one graph may be overwritten by the next replay.
    """

    name = "cuda-graph"

    def __init__(self):
        self._pool = None

    def unavailable_reason(self, transformer) -> str | None:
        from .eligibility import static_reason

        return static_reason(transformer)

    def capture(self, entry: DecodeGraphEntry, body) -> None:
        device = entry.inputs.hidden.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved(device)
        # Warm up on a side stream with the exact computation to record, so cuBLAS workspaces, autotuning and lazy
        # buffers are created outside the capture. Decode only writes the target rows of the static K/V, which
        # the captured run overwrites, so warm-up runs are idempotent.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                body(entry.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.output = body(entry.inputs)
        entry.graph = graph
        entry.captures += 1
        entry.pool_bytes = max(0, torch.cuda.memory_reserved(device) - reserved_before)
        entry.capture_seconds = time.perf_counter() - start

    def replay(self, entry: DecodeGraphEntry) -> torch.Tensor:
        entry.graph.replay()
        entry.replays += 1
        # The output lives in the shared pool; the next replay of any entry may overwrite it.
        return entry.output.clone()
