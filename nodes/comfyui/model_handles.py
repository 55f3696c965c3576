"""Loaded models wrapped so that ComfyUI's model management sees them, sizes them and can unload them.

Each model (transformer, text encoder, VAE) gets a ComfyUI `ModelPatcher`; `ensure_loaded` asks ComfyUI to put
it on its compute device (`comfy.model_management.load_models_gpu`), which first unloads whatever else is needed to
make room, and ComfyUI can later unload ours the same way when another model wants the VRAM.

The text encoder's weights never change, so on a CUDA device it keeps one pinned host copy
(graph_runtime/placement.py): its patcher loads by copying from it and unloads by dropping the GPU copy, whoever
asks (the encode node, or ComfyUI making room).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

import comfy.model_management as mm

from ...graph_runtime.decode.attention import AUTO as AUTO_ATTENTION, check_attention
from ...graph_runtime.encoding.prompt import PromptEncoder
from ...graph_runtime.errors import InputError
from ...graph_runtime.encoding.streamed import layer_stream
from ...graph_runtime.memory import gib, module_bytes
from ...graph_runtime.memory.plan import TE_AUTO, TE_CPU, TE_GPU, TE_OFFLOAD, TE_STREAMED
from ...graph_runtime.placement import PinnedWeights
from ...graph_runtime.loaded import LoadedTransformer
from ...graph_runtime.report import storage_text
from ...graph_runtime.validation import check_kind
from .core_model import make_model_patcher, with_attention, with_loras
from .patcher import FullLoadPatcher, ModuleHost, same_device  # noqa: F401 - same_device: other nodes import it here

logger = logging.getLogger("kvgraph")

# The choices of the loaders' `text_encoder_placement`: `auto` (the default) runs the memory plan's placement for each
# encode (nodes/comfyui/memory.py `encode_placement`); the others are the plan's placements, forced.
TE_PLACEMENTS = (TE_AUTO, TE_OFFLOAD, TE_GPU, TE_STREAMED, TE_CPU)


@dataclass(eq=False)  # handles are compared and hashed by identity, like the models they hold
class ModelHandle:
    """One loaded model as the pack's nodes pass it around (the KVGRAPH_* socket types)."""

    kind: str
    module: torch.nn.Module
    patcher: FullLoadPatcher
    source: str
    dtype_name: str
    key: tuple = ()
    info: dict = field(default_factory=dict)
    last_prompt: str | None = None  # the prompt that last asked for it (the model cache spares the running one's)

    @classmethod
    def create(cls, kind: str, module: torch.nn.Module, source: str, dtype_name: str, load_device, offload_device,
               **extra):
        module = module.to(offload_device)
        patcher = cls.make_patcher(module, load_device, offload_device, extra)
        handle = cls(kind=kind, module=module, patcher=patcher, source=source, dtype_name=dtype_name, **extra)
        patcher.on_unload = handle._weights_leaving
        if handle.pinned_host_copy and not same_device(load_device, offload_device):
            placement = PinnedWeights(module, load_device)
            patcher.placement = placement if placement.fallback_reason is None else None
        return handle

    # Weights that never change on the GPU get one pinned host copy (placement.py) instead of moves both ways.
    pinned_host_copy = False

    @staticmethod
    def make_patcher(module, load_device, offload_device, extra: dict) -> FullLoadPatcher:
        host = ModuleHost(module, torch.device(offload_device))
        return FullLoadPatcher(host, load_device=torch.device(load_device),
                               offload_device=torch.device(offload_device), size=module_bytes(module))

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def size_bytes(self) -> int:
        return self.patcher.model_size()

    @property
    def host_bytes(self) -> int:
        """Host memory this model holds now: its host copy when it keeps one (its tensors point into it while
        offloaded), else its weights that are on the CPU."""
        if self.patcher.placement is not None:
            return self.patcher.placement.host_bytes
        return sum(t.numel() * t.element_size() for t in (*self.module.parameters(), *self.module.buffers())
                   if t.device.type == "cpu")

    def get_ram_usage(self) -> int:
        """ComfyUI's RAM-pressure cache (0.8.0) weighs a cached output by this: the host memory it would free."""
        return self.host_bytes

    def ensure_loaded(self, memory_required: int = 0) -> None:
        """Have ComfyUI put the whole model on its compute device, making room first; fail clearly otherwise."""
        from . import model_cache

        model_cache.adopt(self)
        try:
            mm.load_models_gpu([self.patcher], memory_required=memory_required, force_full_load=True)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(
                f"KV-Graph: not enough free memory on {self.patcher.load_device} to load the {self.kind} "
                f"({gib(self.size_bytes)}, {self.source}). The KV-Graph nodes load the text encoder and the VAE "
                "whole, and the transformer as its memory plan says; close other models or use a smaller dtype."
            ) from exc
        if self.patcher.stream_plan() is not None:
            return  # ComfyUI had room for part of the transformer: its blocks stream from the host (patcher.py)
        devices = {p.device for p in self.module.parameters()}
        if len(devices) != 1 or not same_device(next(iter(devices)), self.patcher.load_device):
            # Never compute with weights split between devices: put everything back on the offload device.
            self.patcher.detach(unpatch_all=True)
            raise RuntimeError(
                f"KV-Graph: ComfyUI left the {self.kind} on {sorted(str(d) for d in devices)} instead of "
                f"{self.patcher.load_device} ({self.source}); it was moved back whole. Try again after freeing "
                "memory."
            )

    def offload(self) -> None:
        """Move the weights back to the offload device now (not waiting for ComfyUI to need the memory)."""
        if self.patcher.loaded_size() > 0 and not same_device(self.patcher.load_device,
                                                                self.patcher.offload_device):
            self.patcher.detach(unpatch_all=True)
            mm.soft_empty_cache()

    def _weights_leaving(self, patcher) -> None:
        """Called before ComfyUI (or `offload`) moves the weights away."""

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "source": self.source,
            "dtype": self.dtype_name,
            "storage": storage_text(self.module),
            "device": str(self.device),
            "bytes": self.size_bytes,
            "loaded_bytes": int(self.patcher.loaded_size()),
            "pinned_host_bytes": self.patcher.placement.host_bytes if self.patcher.placement is not None else 0,
            **{k: v for k, v in self.info.items() if isinstance(v, (str, int, float, bool))},
        }


@dataclass(eq=False)
class TransformerHandle(ModelHandle):
    scheduler_config: dict | None = None
    # The LoRAs chained onto this handle by KV-Graph Load LoRA nodes (LoraChoice each, in chain order); the sampler
    # merges them into the shared model at the start of its run. `base` is the loader's handle they were chained on.
    loras: tuple = ()
    base: "TransformerHandle | None" = field(default=None, repr=False)
    last_budget: dict | None = None  # the memory budget of the last request sampled with it (nodes/comfyui/memory.py)
    gpus: int = 1  # devices each image is decoded on (graph_runtime/parallel); the loader's gpus input
    control: object = None  # a ControlSpec from KV-Graph Apply ControlNet (graph_runtime/controlnet), or None
    step_cache: object = None  # StepCacheSettings from a KV-Graph Step Cache node: the sampler skips predictable steps
    attention: str = AUTO_ATTENTION  # the decode step's attention kernel (decode/attention.py); the loader's input
    prefix_placement: str = "auto"  # from a KV-Graph Prefix Cache node: where the sampler keeps the prefix K/V

    def with_attention(self, attention: str) -> "TransformerHandle":
        """The same loaded model, decoded with the attention kernel `attention` (this handle is left as it is): a
        change rebuilds the decode step over the same weights when it is sampled (loaded.py `use_attention`)."""
        attention = check_attention(attention)
        return self if attention == self.attention else dataclasses.replace(self, attention=attention,
                                                                              base=self.base or self)

    def with_gpus(self, gpus: int) -> "TransformerHandle":
        """The same loaded model, sampled on `gpus` devices (this handle is left as it is)."""
        return self if gpus == self.gpus else dataclasses.replace(self, gpus=gpus, base=self.base or self)

    @staticmethod
    def make_patcher(module, load_device, offload_device, extra: dict) -> FullLoadPatcher:
        # The handle's patcher is the core MODEL the loaders output: one patcher, one set of weights for ComfyUI's
        # model management whichever sampler runs them.
        return make_model_patcher(LoadedTransformer(module), extra.get("scheduler_config"),
                                  extra.get("info", {}).get("variant"), load_device, offload_device,
                                  size=module_bytes(module))

    @property
    def loaded(self) -> LoadedTransformer:
        """The transformer's owner (engine, graphs, LoRA state, runs): the core MODEL's, shared by every handle and
        MODEL clone of this loaded model."""
        return self.patcher.model.loaded

    @property
    def engine(self):
        return self.loaded.engine

    @property
    def model(self):
        """The core MODEL of this loaded transformer (ComfyUI's ModelPatcher), with this handle's LoRA chain and
        attention."""
        patcher = with_loras(self.patcher, self.loras) if self.loras else self.patcher
        return patcher if self.attention == AUTO_ATTENTION else with_attention(patcher, self.attention)

    def with_control(self, spec) -> "TransformerHandle":
        """The same loaded model sampled with the ControlNet `spec` (this handle is left as it is)."""
        if self.control is not None:
            raise InputError("model", "a KV-Graph transformer with a ControlNet applied already",
                             "one without (one KV-Graph Apply ControlNet per model)")
        return dataclasses.replace(self, control=spec, base=self.base or self)

    def with_step_cache(self, settings) -> "TransformerHandle":
        """The same loaded model, sampled with a step cache of `settings` (this handle is left as it is)."""
        return dataclasses.replace(self, step_cache=settings, base=self.base or self)

    def with_prefix_placement(self, placement: str) -> "TransformerHandle":
        """The same loaded model, sampled with its prefix K/V kept under `placement` (this handle is left as is)."""
        return dataclasses.replace(self, prefix_placement=placement, base=self.base or self)

    def with_lora(self, choice) -> "TransformerHandle":
        """The same loaded model with `choice` added to its LoRA chain (this handle is left as it is)."""
        return dataclasses.replace(self, loras=(*self.loras, choice), base=self.base or self)

    def describe(self) -> dict:
        return {**super().describe(), "loras": self.loaded.merged_loras()["loras"],
                "attention": self.loaded.attention}  # what the last run asked for (the engines report what ran)

    def _weights_leaving(self, patcher) -> None:
        # Captured graphs and their static buffers are worthless once the weights move; free the buffers with
        # the model (a sampler in flight keeps its entries until it finishes).
        self.loaded.release_graphs(reason=f"{self.kind} unloaded by ComfyUI")


@dataclass(eq=False)
class TextEncoderHandle(ModelHandle):
    processor: object = None
    placement: str = TE_AUTO
    _encoder: PromptEncoder | None = None
    _stream: object = None  # the LayerStream of an encode streamed by layer, while it runs
    _pageable: PinnedWeights | None = None  # the host copy streamed from where no pinned one could be made
    running: str | None = None  # the placement the encode in progress runs
    pinned_host_copy = True  # nothing writes the encoder's weights: an offload can just drop the GPU copy

    @property
    def encoder(self) -> PromptEncoder:
        if self._encoder is None:
            self._encoder = PromptEncoder(self.module, self.processor)
        return self._encoder

    @property
    def encode_device(self) -> torch.device:
        """Where the encode in progress computes."""
        return self._stream.device if self._stream is not None else self.encoder.device

    def before_encode(self, placement: str | None = None, need_bytes: int = 0) -> None:
        """Put the encoder where `placement` (default: the loader's choice; `auto` is resolved by the caller) says
        for one encode. Streamed by layer: ComfyUI first frees `need_bytes` (the outside part, the layers in flight,
        the encode's activations) on the device."""
        from ...graph_runtime import in_flight

        placement = placement or self.placement
        in_flight.begin_use(self)  # a release of models meanwhile waits for `after_encode`
        try:
            # An encoder already loaded whole (ComfyUI put it there) encodes whole; `auto`'s cpu encodes on the host
            # copy, where the weights are between encodes.
            streamed = (placement == TE_STREAMED and self.patcher.loaded_size() == 0 and self.streams_here()
                        and self._start_stream(need_bytes))
            if not streamed and not (placement == TE_CPU and self.placement == TE_AUTO):
                self.ensure_loaded()
            self.running = placement
        except BaseException:
            self._stop_stream()
            in_flight.end_use(self)
            raise

    def _start_stream(self, need_bytes: int) -> bool:
        weights = self.patcher.placement or self._pageable_copy()
        try:
            stream = layer_stream(self.module, self.patcher.load_device, weights)
        except TypeError as exc:  # no host copy to take layers from (tensor subclasses), or no decoder layers
            logger.warning("KV-Graph: the text encoder cannot stream by layer (%s); it loads whole for this encode.",
                           exc)
            return False
        mm.free_memory(need_bytes, self.patcher.load_device)
        self._stream = stream.start()
        return True

    def out_of_memory(self, exc: BaseException) -> RuntimeError:
        """The error for an encode that ran out of device memory, naming the placement it ran and what uses less."""
        running = self.running or self.placement
        return RuntimeError(
            f"KV-Graph: the text encoder ran out of memory on {self.patcher.load_device} while encoding with placement "
            f"'{running}' ({self.source}): {exc}. Free memory (close other models), or set the loader's "
            "text_encoder_placement to 'streamed by layer' (two of its layers on the GPU at a time) or 'cpu'.")

    def streams_here(self) -> bool:
        """Whether streaming by layer moves anything: not where the encoder's device is its host (the CPU)."""
        return not same_device(self.patcher.load_device, self.patcher.offload_device)

    def _pageable_copy(self) -> PinnedWeights:
        if self._pageable is None:
            self._pageable = PinnedWeights(self.module, self.patcher.load_device, pin=False, log=False)
        return self._pageable

    def _stop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.stop()
            mm.soft_empty_cache()

    def after_encode(self) -> None:
        from ...graph_runtime import in_flight

        # The 8B text encoder is 16 GB in bf16: by default it leaves the GPU as soon as the prompt is encoded, so
        # the transformer and its graphs never have to compete with it.
        try:
            if self._stream is not None:
                self._stop_stream()
            elif self.running != TE_GPU:
                self.offload()
        finally:
            self.running = None
            in_flight.end_use(self)


@dataclass(eq=False)
class VAEHandle(ModelHandle):
    _preview = None

    def preview_projection(self):
        """The latent -> RGB projection for live previews, fitted once to these weights."""
        if self._preview is None:
            from ...graph_runtime.comfy_interop.previews import fit_preview_projection

            self._preview = fit_preview_projection(self.module)
        return self._preview


HANDLE_EXPECTED = {
    TransformerHandle: ("a KV-Graph transformer: the 'transformer' output of a KV-Graph loader or of KV-Graph Load "
                        "LoRA (their 'model' output is core's MODEL, for core's samplers)"),
    TextEncoderHandle: "a KV-Graph text encoder: the 'text_encoder' output of a KV-Graph loader",
    VAEHandle: "a KV-Graph VAE: the 'vae' output of a KV-Graph loader",
}


def expect_handle(name: str, value, kind: type):
    """`value` when it is a loaded model of `kind`, else a refusal naming the input and what it needs."""
    return check_kind(name, value, kind, HANDLE_EXPECTED[kind])
