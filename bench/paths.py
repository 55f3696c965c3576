"""The decode paths the benchmark measures, all over the same weights, inputs and prefix caches.

`diffusers` is the reference: the transformer's own `kv_cache_mode="cached"` forward, eager, host syncs included.
The others are this project's decode step: eager, captured, and captured with compiled blocks; `--paths all` adds
the compiled path without our kernels, to measure them; the INT8 ConvRot paths: the blocks' Linear layers quantized
on the GPU with comfy-kitchen from the same random bf16 weights and run int8 (W8A8, `graph-int8`) or dequantized back
to bf16 at load (`graph-dequantized`); and `fp8`, `fp8-attn` and `fp8-no-out`, the FP8 decode path (graph_runtime/fp8)
on FP8 copies of the same weights. (Fused q/k/v and gate/up GEMMs, a pinned cuDNN attention backend and max-autotune
GEMMs were measured too and not kept: docs/performance.md says what each gave.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from graph_runtime.decode import DecodeEngine
from graph_runtime.decode.attention import ATTENTION_CHOICES
from graph_runtime.fp8.convert import int8_factory

from .swap import (ATTENTION_8BIT, ATTENTION_FP8, ATTENTION_FP8_KV, ATTENTION_VARIANTS, attention_swapped,
                   quantized_linears, swapped)


@dataclass(frozen=True)
class PathSpec:
    name: str
    mode: str = "graph"  # our decode mode; unused by the reference
    compile: bool = False
    reference: bool = False
    kernels: bool = True  # the hand-written kernels of graph_runtime/kernels (off: inductor's own code)
    weights: str = "bf16"  # "int8" / "dequantized": a ConvRot copy of the blocks (see quantized_transformer)
    precision: str = "bf16"  # graph_runtime/fp8's presets: FP8 block Linears swapped in beside the bf16 ones
    # The engine's attention kernel: "auto" (FlashAttention-3 where it runs, else SDPA), "sdpa", "fa3" or "fp8"
    # (the runtime's FP8 attention); "int8" / "fp8-pass": an 8-bit attention swapped in (swap.attention_swapped).
    attention: str = "auto"


ALL_PATHS = [
    PathSpec("diffusers", reference=True),
    PathSpec("eager", mode="eager"),
    PathSpec("graph"),
    # Not in the default set: the graph and int8 paths with SDPA pinned, to measure what FlashAttention-3 gives.
    PathSpec("graph-sdpa", attention="sdpa"),
    PathSpec("int8-sdpa", precision="int8", attention="sdpa"),
    # Not in the default set: int8 with FlashAttention-3 bf16 (`auto` runs FP8 attention under int8 Linears on Hopper).
    PathSpec("int8-fa3", precision="int8", attention="fa3"),
    PathSpec("compile+graph", compile=True),
    # Not in the default set: the same path with inductor's own code where our kernels would run, to measure them.
    PathSpec("compile+graph-inductor-only", compile=True, kernels=False),
    # Not in the default set: ComfyUI's INT8 ConvRot checkpoints, in the loaders' two modes.
    PathSpec("graph-int8", weights="int8"),
    PathSpec("graph-dequantized", weights="dequantized"),
    # Not in the default set: the FP8 decode path (fp8/convert.py's presets), graphed, and eagerly (for CPU runs).
    PathSpec("fp8", precision="fp8"),
    PathSpec("fp8-attn", precision="fp8-attn"),
    PathSpec("fp8-no-out", precision="fp8-no-out"),
    PathSpec("fp8-eager", mode="eager", precision="fp8"),
    # Not in the default set: `precision: int8`, a float file's block Linears quantized at load to INT8 ConvRot and
    # run on our INT8 GEMM (the same int8 weights as graph-int8, swapped in beside the bf16 ones).
    PathSpec("int8", precision="int8"),
    # Not in the default set: the same with 8-bit attention, to measure it over whole steps and against the bound.
    PathSpec(ATTENTION_8BIT, precision="int8", attention="int8"),
    # Not in the default set: the same with FlashAttention-3's FP8 attention (its error against the bound).
    PathSpec(ATTENTION_FP8, precision="int8", attention="fp8-pass"),
    # Not in the default set: `int8` with the runtime's FP8 attention (`attention: fp8`), its speed and error.
    PathSpec(ATTENTION_FP8_KV, precision="int8", attention="fp8"),
]
CONVROT_GROUP = 256  # ComfyUI's default group size, the one comfy-kitchen's fused CUDA quantizer runs
DEFAULT_PATHS = ["diffusers", "eager", "graph", "compile+graph"]
CPU_PATHS = ["diffusers", "eager"]


def reference_caches(prefixes: dict) -> dict:
    """diffusers KV caches holding the very tensors of our prefill (identical K/V for every path)."""
    caches = {}
    for name, prefix in prefixes.items():
        cache = QwenImage21KVCache(len(prefix.k))
        for layer, k, v in zip(cache.layer_caches, prefix.k, prefix.v):
            layer.store(k, v)
        caches[name] = cache
    return caches


def _reference_kwargs(inputs, branch):
    batch = inputs.latents.shape[0]
    target_slots = inputs.latents.shape[1] // 4
    img_mask = torch.cat([branch.vlm_mask, branch.vlm_mask.new_ones(1, target_slots)], dim=1).expand(batch, -1)
    return dict(hidden_states=inputs.hidden_all, encoder_hidden_states=branch.embeds, timestep=inputs.timestep,
                img_shapes=[inputs.img_shapes] * batch, img_mask=img_mask, return_dict=False)


def reference_prefill(transformer, inputs):
    """diffusers' prefill of every branch (`kv_cache_mode="extract"`), for its prefill time."""

    def prefill():
        for branch in inputs.branches:
            cache = QwenImage21KVCache(len(transformer.transformer_blocks))
            transformer(**_reference_kwargs(inputs, branch), kv_cache=cache, kv_cache_mode="extract")

    return prefill


def reference_step(transformer, inputs, caches):
    """One decode step of every CFG branch through diffusers' own cached forward."""

    def step():
        return [transformer(**_reference_kwargs(inputs, branch), kv_cache=caches[branch.name],
                            kv_cache_mode="cached")[0] for branch in inputs.branches]

    return step


def quantized_transformer(transformer, weights: str):
    """A copy of `transformer` whose blocks' Linear layers are INT8 ConvRot, quantized with comfy-kitchen on the
    weights' device ("int8"), or those int8 weights dequantized back to bf16 Linear layers ("dequantized"): the
    two ways the loaders run an INT8 file."""
    import copy

    from graph_runtime.quantized import dequantize_linears_, quantize_linears_

    model = copy.deepcopy(transformer)
    quantize_linears_(model, CONVROT_GROUP, lambda name, _: name.startswith("transformer_blocks."))
    if weights == "dequantized":
        dequantize_linears_(model, next(transformer.parameters()).dtype)
    return model.requires_grad_(False)


class OursPath:
    """An engine configured for one path; kept across scenarios so compiled code and graphs are reused."""

    def __init__(self, spec: PathSpec, transformer):
        self.spec = spec
        if spec.weights != "bf16":
            # the engine holds its transformer weakly: the path keeps its own copy alive
            transformer = quantized_transformer(transformer, spec.weights)
        self.transformer = transformer
        engine_attention = spec.attention if spec.attention in ATTENTION_CHOICES else "sdpa"
        self.engine = DecodeEngine(transformer, max_entries=4, kernels=spec.kernels, attention=engine_attention)
        if spec.attention == "fp8" and self.engine.step.kv_format() != "fp8":
            # Timed anyway (it is then the bf16 step), but never as FP8 attention.
            print(f"bench: {spec.name} runs bf16 attention: "
                  f"{'; '.join(self.engine.step.attention.fallbacks) or 'not chosen'}", flush=True)
        if spec.compile:
            self.engine.enable_compile()
        # FP8 paths keep their quantized Linears (7 GB for the full model) and swap them in while they run.
        factory = int8_factory() if spec.precision == "int8" else None
        self.modules = ({} if spec.precision == "bf16" else
                        quantized_linears(transformer, spec.precision, **({"factory": factory} if factory else {})))

    @contextlib.contextmanager
    def installed(self):
        """This path's Linears in the model, and its attention in the blocks, while inside."""
        with swapped(self.transformer, self.modules) if self.modules else contextlib.nullcontext():
            with attention_swapped(self.spec.attention if self.spec.attention in ATTENTION_VARIANTS.values()
                                   else "sdpa"):
                yield

    def step(self, inputs, prefixes):
        engine, mode = self.engine, self.spec.mode
        for prefix in prefixes.values():
            # The scenario's prefixes are shared by every path, and a prefix remembers the key of the engine that
            # decoded it last: each path's engine keys them anew (its step variant differs).
            prefix.graph_key = None

        def step():
            return [engine.decode_step(prefixes[b.name], inputs.latents, inputs.timestep, mode).output
                    for b in inputs.branches]

        return step
