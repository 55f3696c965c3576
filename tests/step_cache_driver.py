"""Runs core's own EasyCache and LazyCache nodes (comfy_extras/nodes_easycache.py of a real ComfyUI) on the pack's MODEL
and on a core reference model, and the KV-Graph Step Cache on the KV-Graph Sampler; prints what it measured as JSON.

Run with ComfyUI's Python, from the repository root (tests/test_step_cache_comfyui.py does, and asserts):

    COMFYUI_DIR=/path/to/ComfyUI $COMFYUI_PYTHON tests/step_cache_driver.py

The reference ("a core model") is the same tiny transformer run through core's plain model path: a
`comfy.model_base.BaseModel` whose diffusion model calls diffusers' `QwenImage21Transformer2DModel` on the whole joint
sequence every step, behind the DIFFUSION_MODEL wrappers exactly where core's own diffusion models put them, with
core's own `_apply_model` (input conversion, dtype, denoised). Same weights, latent format and sampling shift as the
pack's MODEL, so the caches see the same inputs and outputs up to float32 round-off; core's own Qwen-Image (1.x) model
would be another network, whose outputs (and so skipped steps) differ.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from core_sampling_driver import custom_advanced, ksampler, run_node, setup  # noqa: E402

STEPS = 10
SIZE = (128, 128)  # width, height in pixels: 8 x 8 latent tokens, one point of core's 8x subsampled grid per axis
SKIP_LINE = re.compile(r"(EasyCache|LazyCache) - skipped (\d+)/(\d+) steps")
THRESHOLDS = (0.2, 0.5)


class SkipLines(logging.Handler):
    """Collects core's per-run cache summary lines ("EasyCache - skipped 3/10 steps ...")."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.runs = []

    def emit(self, record):
        found = SKIP_LINE.search(record.getMessage())
        if found:
            self.runs.append({"node": found.group(1), "skipped": int(found.group(2)), "steps": int(found.group(3))})


def reference_patcher(kv_model):
    """The core reference model over the pack MODEL's transformer (see the module docstring)."""
    import comfy.conds
    import comfy.model_base
    import comfy.model_patcher
    import comfy.patcher_extension

    from graph_runtime.core_model import PrefixSource
    from graph_runtime.sampling.sampler import pack, unpack
    from graph_runtime.sampling.schedule import sigma_timestep

    transformer = kv_model.diffusion_model

    class PlainDiffusionModel(torch.nn.Module):
        """diffusers' transformer over the whole sequence, called the way core calls its diffusion models."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        @property
        def dtype(self):
            return next(transformer.parameters()).dtype

        def forward(self, x, timestep, context, ref_latents=None, image_slots=None, transformer_options={}, **kw):
            return comfy.patcher_extension.WrapperExecutor.new_class_executor(
                self._forward, self, comfy.patcher_extension.get_all_wrappers(
                    comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options),
            ).execute(x, timestep, context, ref_latents, image_slots, transformer_options, **kw)

        def _forward(self, x, timestep, context, ref_latents, image_slots, transformer_options, **kw):
            self.calls += 1
            source = kw["reference_source"]
            batch, _, height, width = x.shape
            embeds, text_mask = source.embeds_for(batch, x.device, x.dtype)
            image_mask = source.embeds.image_mask.to(x.device).bool().expand(batch, -1)
            # The pipeline's mask: the target's slots (one per 2x2 latent tokens) follow the prompt's.
            image_mask = torch.cat([image_mask, image_mask.new_ones(batch, height * width // 4)], dim=1)
            out = transformer(hidden_states=pack(x), encoder_hidden_states=embeds,
                              timestep=sigma_timestep(timestep.reshape(-1).expand(batch), x.dtype),
                              img_shapes=[[(1, height, width)]] * batch, img_mask=image_mask,
                              encoder_hidden_states_mask=text_mask, return_dict=False)[0]
            return unpack(out[:, -height * width:], height, width)

    class Reference(comfy.model_base.BaseModel):
        def __init__(self):
            super().__init__(kv_model.model_config, comfy.model_base.ModelType.FLUX, device=torch.device("cpu"))
            self.diffusion_model = PlainDiffusionModel()

        def extra_conds(self, **kwargs):
            source = PrefixSource.from_conditioning(kwargs["cross_attn"], kwargs, kv_model.latent_format.stats,
                                                    transformer.config.in_channels)
            return {"reference_source": comfy.conds.CONDConstant(source)}

    model = Reference()
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def transformer_steps(engine) -> int:
    stats = engine.stats.snapshot()
    return stats["replays"] + stats["eager_total"]  # a captured step also counts as replayed


def main() -> dict:
    env = setup()
    import comfy.model_management as mm
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    lines = SkipLines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.INFO)
    out = {"comfyui": os.environ["COMFYUI_DIR"], "device": str(mm.get_torch_device())}
    handle, model = run_node(env, "KVGraphLoadTransformer", transformer_name="qwen_image_2.1_bf16.safetensors",
                             dtype="fp32")
    text_encoder, = run_node(env, "KVGraphLoadTextEncoder", text_encoder_name="qwen3vl_8b_bf16.safetensors",
                             dtype="fp32", text_encoder_placement="gpu while encoding, then offload")
    positive, negative, latent = run_node(env, "KVGraphTextEncode", text_encoder=text_encoder,
                                          prompt="a red cube on a blue sphere", negative_prompt="blurry",
                                          width=SIZE[0], height=SIZE[1], size_from_reference=True,
                                          reference_resolution=128)
    sigmas, = run_node(env, "KVGraphSigmas", model=model, steps=STEPS, sigma_preset="auto", width=1024, height=1024,
                       denoise=1.0, latent=latent)
    reference = reference_patcher(model.model)
    engine = handle.engine

    def measure(node, patcher, threshold, cfg, sampler="custom"):
        """One run of `node` (core's cache node) on `patcher`: core's reported skips and the transformer calls."""
        cached, = node.execute(patcher, reuse_threshold=threshold, start_percent=0.15, end_percent=0.95,
                               verbose=False).args
        before_lines, before_engine = len(lines.runs), transformer_steps(engine)
        before_ref = reference.model.diffusion_model.calls
        if sampler == "custom":
            result = custom_advanced(cached, positive, negative, latent, sigmas, "euler", cfg, 5)
        else:
            result = ksampler(cached, positive, negative, latent, 5, STEPS, cfg)
        reported = lines.runs[before_lines:]
        return {"reported": reported, "latents": result,
                "pack_transformer_steps": transformer_steps(engine) - before_engine,
                "reference_calls": reference.model.diffusion_model.calls - before_ref}

    def compare(node, threshold, cfg, sampler="custom"):
        pack = measure(node, model, threshold, cfg, sampler)
        ref = measure(node, reference, threshold, cfg, sampler)
        return {"pack": {k: v for k, v in pack.items() if k != "latents"},
                "reference": {k: v for k, v in ref.items() if k != "latents"},
                "max_diff": float((pack["latents"] - ref["latents"]).abs().max()),
                "magnitude": float(ref["latents"].abs().max())}

    def plain(patcher, cfg, sampler="custom"):
        if sampler == "custom":
            return custom_advanced(patcher, positive, negative, latent, sigmas, "euler", cfg, 5)
        return ksampler(patcher, positive, negative, latent, 5, STEPS, cfg)

    out["no_cache"] = {"max_diff": float((plain(model, 1.0) - plain(reference, 1.0)).abs().max())}
    no_cache_latents = plain(model, 1.0)
    out["cases"] = {}
    for name, node in (("EasyCache", EasyCacheNode), ("LazyCache", LazyCacheNode)):
        for threshold in THRESHOLDS:
            out["cases"][f"{name} {threshold} cfg1"] = compare(node, threshold, 1.0)
        out["cases"][f"{name} 0.2 cfg4"] = compare(node, 0.2, 4.0)
        out["cases"][f"{name} 0.2 ksampler"] = compare(node, 0.2, 1.0, "ksampler")
    easy = measure(EasyCacheNode, model, 0.2, 1.0)
    out["easycache_changes_output"] = float((easy["latents"] - no_cache_latents).abs().max())

    # The KV-Graph Step Cache on the KV-Graph Sampler against core's EasyCache on the MODEL, same settings. In bf16:
    # in fp32, core's `_apply_model` hands the diffusion model the sampler's own input tensor (no dtype copy), and
    # EasyCache adds the cached difference into it in place, so its skipped steps come out differently from what the
    # rule says (on any fp32 model: the reference above does the same); in bf16 the input is a copy.
    handle16, model16 = run_node(env, "KVGraphLoadTransformer", transformer_name="qwen_image_2.1_bf16.safetensors",
                                 dtype="bf16")
    engine16 = handle16.engine
    for threshold in THRESHOLDS:
        cached_handle, = run_node(env, "KVGraphStepCache", model=handle16, reuse_threshold=threshold,
                                  start_percent=0.15, end_percent=0.95)
        before = engine16.stats.snapshot()
        ours = run_node(env, "KVGraphSampler", model=cached_handle, positive=positive, negative=negative,
                        latent=latent, seed=5, steps=STEPS, cfg=1.0, sigma_preset="auto", denoise=1.0,
                        decode_mode="auto", compile="off")[0]["samples"].float()
        delta = engine16.stats.delta(before)
        before_lines = len(lines.runs)
        cached_model, = EasyCacheNode.execute(model16, reuse_threshold=threshold, start_percent=0.15,
                                              end_percent=0.95, verbose=False).args
        core = custom_advanced(cached_model, positive, negative, latent, sigmas, "euler", 1.0, 5)
        plain16 = run_node(env, "KVGraphSampler", model=handle16, positive=positive, negative=negative,
                           latent=latent, seed=5, steps=STEPS, cfg=1.0, sigma_preset="auto", denoise=1.0,
                           decode_mode="auto", compile="off")[0]["samples"].float()
        core_plain = custom_advanced(model16, positive, negative, latent, sigmas, "euler", 1.0, 5)
        out[f"kv_sampler {threshold}"] = {
            "no_cache_max_diff_vs_core": float((plain16 - core_plain).abs().max()),
            "skipped_steps": delta["skipped_steps"],
            "decode_steps": delta["replays"] + sum(delta["eager_steps"].values()),
            "core_reported": lines.runs[before_lines:], "max_diff_vs_core": float((ours - core).abs().max()),
            "changed_by_cache": float((ours - plain16).abs().max()), "magnitude": float(core.abs().max())}

    import importlib

    in_flight = importlib.import_module(f"{env.pack.__name__}.graph_runtime.in_flight")
    out["after"] = {"runs": in_flight.runs(), "busy": handle.loaded.busy,
                    "owned_entries": sum(engine.graphs.owners.alive(k) for k in engine.graphs.entries),
                    "skipped_steps_total": engine.stats.skipped_steps}
    return out


if __name__ == "__main__":
    result = main()
    print("KVGRAPH-RESULT " + json.dumps(result))
