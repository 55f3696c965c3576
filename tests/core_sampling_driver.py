"""Runs ComfyUI's own sampling code (a real `comfy` package) on the pack's MODEL and prints what it measured as JSON.

Run with ComfyUI's Python, from the repository root (tests/test_core_sampling_comfyui.py does, and asserts on the
output):

    COMFYUI_DIR=/path/to/ComfyUI $COMFYUI_PYTHON tests/core_sampling_driver.py

It loads the pack as ComfyUI does, with the tiny models, over ComfyUI's real `comfy` package (model management,
ModelPatcher, BaseModel, samplers, CFGGuider, LoRA loading) and the test fake for the rest (node API, folders,
server). What `comfy.sample.sample` does is what the KSampler node does with its inputs; what `CFGGuider.sample` with
a sampler object does is what SamplerCustomAdvanced does. Model calls are counted by an APPLY_MODEL wrapper, ComfyUI's
own mechanism.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SAMPLERS = ("euler", "euler_ancestral", "heun", "dpmpp_2m", "res_multistep", "er_sde", "uni_pc")
STEPS = 4
SIZE = (128, 96)  # width, height in pixels


def setup():
    comfyui = os.environ["COMFYUI_DIR"]
    if not torch.cuda.is_available():
        sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI picks its device from its command line
    sys.path[:0] = [comfyui, str(REPO / "tests"), str(REPO)]
    import comfy.options

    comfy.options.enable_args_parsing()
    from comfy_fake.env import make_env

    return make_env(device="cuda" if torch.cuda.is_available() else "cpu", real_comfy=comfyui)


def run_node(env, node_id, **inputs):
    return env.nodes[node_id].execute(**inputs).args


def counted(model):
    """A clone of `model` whose model calls are counted (in `.calls`, one entry per call: its batch)."""
    import comfy.patcher_extension

    clone = model.clone()
    clone.calls = []

    def count(executor, x, t, *args, **kwargs):
        clone.calls.append(int(x.shape[0]))
        return executor(x, t, *args, **kwargs)

    clone.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "count", count)
    return clone


def custom_advanced(model, positive, negative, latent, sigmas, sampler_name, cfg, seed):
    """SamplerCustomAdvanced with RandomNoise(seed), CFGGuider(model, positive, negative, cfg) and a sampler."""
    import comfy.sample
    import comfy.samplers

    samples = comfy.sample.fix_empty_latent_channels(model, latent["samples"])
    noise = comfy.sample.prepare_noise(samples, seed)
    guider = comfy.samplers.CFGGuider(model)
    guider.set_conds(positive, negative)
    guider.set_cfg(cfg)
    # A copy: some samplers write into the sigmas they are given (uni_pc replaces a final 0 with 1e-3).
    out = guider.sample(noise, samples, comfy.samplers.sampler_object(sampler_name), sigmas.clone(),
                        denoise_mask=latent.get("noise_mask"), seed=seed)
    return out.to(torch.float32).cpu()


def ksampler(model, positive, negative, latent, seed, steps, cfg, sampler_name="euler", scheduler="simple"):
    """The KSampler node: comfy.sample.sample with the latent's noise mask."""
    import comfy.sample

    samples = comfy.sample.fix_empty_latent_channels(model, latent["samples"])
    noise = comfy.sample.prepare_noise(samples, seed)
    return comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive, negative, samples,
                               noise_mask=latent.get("noise_mask"), seed=seed).float().cpu()


def refusal(call) -> dict:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the refusal is what is measured
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def partial_load(model, handle, positive, negative, latent, sigmas) -> dict:
    """SamplerCustomAdvanced after ComfyUI's own `LoadedModel.model_load` asked for part of the MODEL (one of the tiny
    model's two blocks), against the same run loaded whole. ComfyUI forces whole loads on a CPU device, so its figure
    is capped here where `model_load` hands it to the patcher (`model_use_more_vram` -> `partially_load`); the rest
    is ComfyUI's real ModelPatcher and sampling code."""
    import comfy.model_management as mm

    from graph_runtime.memory import module_bytes

    whole = custom_advanced(model, positive, negative, latent, sigmas, "euler", 1.0, 61)
    blocks = [module_bytes(b) for b in handle.module.transformer_blocks]
    budget = module_bytes(handle.module) - sum(blocks) + blocks[0]
    original = mm.LoadedModel.model_use_more_vram

    def capped(self, extra_memory, force_patch_weights=False):
        return original(self, min(extra_memory, budget - self.model.loaded_size()), force_patch_weights)

    model.detach(unpatch_all=True)
    mm.LoadedModel.model_use_more_vram = capped
    seen = {}

    def during(executor, *args, **kwargs):  # at each model call: after ComfyUI loaded the model for the run
        plan = model.stream_plan()
        seen.update(streamed_blocks=plan.streamed_blocks if plan else 0, loaded=int(model.loaded_size()),
                    lowvram=bool(model.model.model_lowvram),
                    hooked=bool(handle.module.transformer_blocks[1]._forward_pre_hooks))
        return executor(*args, **kwargs)

    import comfy.patcher_extension

    clone = model.clone()
    clone.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "see", during)
    try:
        partial = custom_advanced(clone, positive, negative, latent, sigmas, "euler", 1.0, 61)
    finally:
        mm.LoadedModel.model_use_more_vram = original
    model.detach(unpatch_all=True)  # ComfyUI unloading it: the streaming ends
    after = {"streaming": model.stream_plan() is not None, "loaded": int(model.loaded_size()),
             "hooked": any(b._forward_pre_hooks for b in handle.module.transformer_blocks)}
    again = custom_advanced(model, positive, negative, latent, sigmas, "euler", 1.0, 61)
    return {"budget": budget, "during": seen, "max_diff": diff(partial, whole), "after_unload": after,
            "whole_again_max_diff": diff(again, whole), "whole_again_loaded": int(model.loaded_size()),
            "size": int(model.model_size())}


def merge_simple(model, other, ratio):
    """What core's ModelMergeSimple does: `other`'s weights as patches of a clone of `model`, scaled by the ratio."""
    merged = model.clone()
    patches = other.get_key_patches("diffusion_model.")
    for key in patches:
        merged.add_patches({key: patches[key]}, 1.0 - ratio, ratio)
    return merged


def core_lora(env, model, handle, positive, negative, latent, sigmas) -> dict:
    """Core's own LoRA loading on the MODEL: what LoraLoaderModelOnly does (`load_torch_file`, then
    `load_lora_for_models` with no CLIP), alone and stacked with KV-Graph Load LoRA, against KV-Graph Load LoRA at the
    same strengths; the weights after a run without LoRA; and what is refused (a PEFT file core maps nothing of on
    this MODEL, a fused-MLP file it maps in part, a hook LoRA on the conditioning)."""
    import comfy.hooks
    import comfy.sd
    import comfy.utils

    from safetensors.torch import save_file

    from graph_runtime.lora.tiny import tiny_lora_tensors, write_tiny_lora
    from lora_layouts import write_layout

    folder = env.models / "loras"
    write_tiny_lora(folder / "kvgraph_test_lora_b.safetensors", seed=1, dtype=torch.float32)
    write_layout(folder / "kvgraph_test_peft.safetensors", "peft", handle.module, seed=2)
    fused = {}  # the tiny LoRA as a LoRA trained on ComfyUI's fused MLP weight names it
    for key, tensor in tiny_lora_tensors(seed=3).items():
        if ".img_mlp.proj." not in key:
            fused[key.replace(".img_mlp.gate_layer.", ".img_mlp.gate_up.")] = tensor
    for key in [k for k in fused if ".img_mlp.gate_up.lora_up" in k]:
        fused[key] = torch.cat([fused[key], fused[key]])
    save_file(fused, str(folder / "kvgraph_test_fused.safetensors"))

    def core_loader(model_in, name, strength):  # LoraLoaderModelOnly
        lora = comfy.utils.load_torch_file(str(folder / name), safe_load=True)
        return comfy.sd.load_lora_for_models(model_in, None, lora, strength, 0)[0]

    def kv_loader(model_in, name, strength):
        return run_node(env, "KVGraphLoadLoRA", model=model_in, lora_name=name, strength=strength)[0]

    without = custom_advanced(model, positive, negative, latent, sigmas, "euler", 1.0, 41)  # restores the originals
    original = {name: p.detach().clone() for name, p in handle.module.named_parameters()}
    core = custom_advanced(core_loader(model, "kvgraph_test_lora.safetensors", 0.8), positive, negative, latent,
                           sigmas, "euler", 1.0, 41)
    kv = custom_advanced(kv_loader(model, "kvgraph_test_lora.safetensors", 0.8), positive, negative, latent, sigmas,
                         "euler", 1.0, 41)
    stack = core_loader(kv_loader(core_loader(model, "kvgraph_test_lora.safetensors", 1.0),
                                  "kvgraph_test_lora_b.safetensors", 0.5), "kvgraph_test_lora_b.safetensors", -0.25)
    chain = kv_loader(kv_loader(kv_loader(model, "kvgraph_test_lora.safetensors", 1.0),
                                "kvgraph_test_lora_b.safetensors", 0.5), "kvgraph_test_lora_b.safetensors", -0.25)
    stacked = custom_advanced(stack, positive, negative, latent, sigmas, "euler", 1.0, 42)
    chained = custom_advanced(chain, positive, negative, latent, sigmas, "euler", 1.0, 42)
    plain = custom_advanced(model, positive, negative, latent, sigmas, "euler", 1.0, 41)
    changed = [name for name, p in handle.module.named_parameters() if not torch.equal(p, original[name])]
    hook = comfy.hooks.create_hook_lora(comfy.utils.load_torch_file(str(folder / "kvgraph_test_lora.safetensors")),
                                        1.0, 0.0)
    hooked = comfy.hooks.set_hooks_for_conditioning(positive, hook)
    return {
        "max_diff_vs_kvgraph": diff(core, kv), "changed_by_lora": diff(core, without),
        "stack_max_diff_vs_kvgraph": diff(stacked, chained), "stack_changed": diff(stacked, core),
        "ksampler_finite": bool(torch.isfinite(ksampler(core_loader(model, "kvgraph_test_lora.safetensors", 1.0),
                                                        positive, negative, latent, 43, STEPS, 1.0)).all()),
        "plain_after_equal": bool(torch.equal(plain, without)), "weights_changed": changed,
        "peft": refusal(lambda: core_loader(model, "kvgraph_test_peft.safetensors", 1.0)),
        "fused": refusal(lambda: core_loader(model, "kvgraph_test_fused.safetensors", 1.0)),
        "hook": refusal(lambda: ksampler(model, hooked, negative, latent, 44, STEPS, 1.0)),
        "merge": refusal(lambda: merge_simple(model, model, 0.5)),
        "bypass": refusal(lambda: comfy.sd.load_bypass_lora_for_models(
            model, None, comfy.utils.load_torch_file(str(folder / "kvgraph_test_lora.safetensors")), 1.0, 0))
        if hasattr(comfy.sd, "load_bypass_lora_for_models") else None,
        "after_refusals_equal": bool(torch.equal(custom_advanced(model, positive, negative, latent, sigmas, "euler",
                                                                 1.0, 41), without)),
    }


def main() -> dict:
    env = setup()
    import comfy.model_management as mm
    import comfy.sd

    from graph_runtime.lora.tiny import write_tiny_lora

    write_tiny_lora(env.models / "loras" / "kvgraph_test_lora.safetensors", dtype=torch.float32)
    out = {"comfyui": os.environ["COMFYUI_DIR"], "device": str(mm.get_torch_device())}
    handle, model = run_node(env, "KVGraphLoadTransformer", transformer_name="qwen_image_2.1_bf16.safetensors",
                             dtype="fp32")
    text_encoder, = run_node(env, "KVGraphLoadTextEncoder", text_encoder_name="qwen3vl_8b_bf16.safetensors",
                             dtype="fp32", text_encoder_placement="gpu while encoding, then offload")
    vae, = run_node(env, "KVGraphLoadVAE", vae_name="qwen_image_2.1_vae_bf16.safetensors", dtype="fp32")
    positive, negative, latent = run_node(env, "KVGraphTextEncode", text_encoder=text_encoder,
                                          prompt="a red cube on a blue sphere", negative_prompt="blurry",
                                          width=SIZE[0], height=SIZE[1], size_from_reference=True,
                                          reference_resolution=128)
    sigmas, = run_node(env, "KVGraphSigmas", model=model, steps=STEPS, sigma_preset="auto", width=1024, height=1024,
                       denoise=1.0, latent=latent)
    out["sigmas"] = [float(s) for s in sigmas]

    def kv_sampler(seed, cfg=1.0, model_in=handle, latent_in=latent, **extra):
        return run_node(env, "KVGraphSampler", model=model_in, positive=positive, negative=negative,
                        latent=latent_in, seed=seed, steps=STEPS, cfg=cfg, sigma_preset="auto", denoise=1.0,
                        decode_mode="auto", compile="off", **extra)[0]["samples"].float()

    # SamplerCustomAdvanced + euler over KV-Graph Sigmas = the KV-Graph Sampler (and so diffusers' pipeline).
    model_c = counted(model)
    core = custom_advanced(model_c, positive, negative, latent, sigmas, "euler", 1.0, 11)
    out["euler_parity"] = {"max_diff": diff(core, kv_sampler(11)), "calls": model_c.calls,
                           "magnitude": float(core.abs().max())}
    model_c = counted(model)
    core = custom_advanced(model_c, positive, negative, latent, sigmas, "euler", 4.0, 12)
    out["cfg_parity"] = {"max_diff": diff(core, kv_sampler(12, cfg=4.0)), "calls": model_c.calls}

    # A negative carrying other reference latents than the positive (another image of the same size): core's
    # CFGGuider gives each branch its own; the KV-Graph Sampler must too.
    ref_pos, ref_neg, ref_latent = run_node(env, "KVGraphTextEncode", text_encoder=text_encoder, vae=vae,
                                            prompt="make the sky purple", negative_prompt="blurry", width=SIZE[0],
                                            height=SIZE[1], size_from_reference=True, reference_resolution=128,
                                            images={"image1": torch.rand(1, SIZE[1], SIZE[0], 3,
                                                                         generator=torch.Generator().manual_seed(1))})
    (neg_cond, neg_extras), = ref_neg
    other_neg = [[neg_cond, dict(neg_extras, reference_latents=[-r for r in neg_extras["reference_latents"]])]]
    ref_sigmas, = run_node(env, "KVGraphSigmas", model=model, steps=STEPS, sigma_preset="auto", width=1024,
                           height=1024, denoise=1.0, latent=ref_latent)
    core = custom_advanced(model, ref_pos, other_neg, ref_latent, ref_sigmas, "euler", 4.0, 14)
    kv = run_node(env, "KVGraphSampler", model=handle, positive=ref_pos, negative=other_neg, latent=ref_latent,
                  seed=14, steps=STEPS, cfg=4.0, sigma_preset="auto", denoise=1.0, decode_mode="auto",
                  compile="off")[0]["samples"].float()
    same = custom_advanced(model, ref_pos, ref_neg, ref_latent, ref_sigmas, "euler", 4.0, 14)
    out["cfg_other_references"] = {"max_diff": diff(core, kv), "changed_by_references": diff(core, same)}

    # Every sampler of the list: finite, and how many model calls it made for STEPS steps.
    out["samplers"] = {}
    for name in SAMPLERS:
        model_c = counted(model)
        result = custom_advanced(model_c, positive, negative, latent, sigmas, name, 1.0, 13)
        out["samplers"][name] = {"finite": bool(torch.isfinite(result).all()), "calls": model_c.calls,
                                 "std": float(result.std())}

    # KSampler (scheduler simple: the model's shift at 1024x1024) and a second prompt with the same shapes.
    model_c = counted(model)
    first = ksampler(model_c, positive, negative, latent, 21, STEPS, 1.0)
    out["ksampler"] = {"finite": bool(torch.isfinite(first).all()), "calls": model_c.calls}

    # Inpainting: SetLatentNoiseMask's mask on an input latent; the region where it is 0 keeps the input.
    source = ksampler(model, positive, negative, latent, 31, STEPS, 1.0)
    mask = torch.zeros(1, 1, SIZE[1], SIZE[0])
    mask[..., :, SIZE[0] // 2:] = 1.0
    masked_latent = {"samples": source, "noise_mask": mask.reshape(-1, 1, SIZE[1], SIZE[0])}
    inpainted = ksampler(model, positive, negative, masked_latent, 32, STEPS, 1.0)
    half = source.shape[-1] // 2
    custom = custom_advanced(model, positive, negative, masked_latent, sigmas, "euler", 1.0, 32)
    out["inpaint"] = {"kept_max_diff": diff(inpainted[..., :half], source[..., :half]),
                      "sampled_max_diff": diff(inpainted[..., half:], source[..., half:]),
                      "custom_kept_max_diff": diff(custom[..., :half], source[..., :half]),
                      "kv_sampler_max_diff": diff(kv_sampler(32, latent_in=masked_latent), custom)}

    # Bad combinations fail with a message saying what was expected, and the next run works: another model's MODEL
    # into the KV-Graph nodes that take a MODEL, another text encoder's conditioning into KSampler on the MODEL.
    import comfy.model_patcher

    other = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), mm.get_torch_device(), "cpu")
    foreign = [[torch.zeros(1, 77, 768), {"pooled_output": torch.zeros(1, 768)}]]
    out["refused"] = {
        "sigmas": refusal(lambda: run_node(env, "KVGraphSigmas", model=other, steps=STEPS, sigma_preset="auto",
                                           width=1024, height=1024, denoise=1.0)),
        "lora": refusal(lambda: run_node(env, "KVGraphLoadLoRA", model=other, lora_name="kvgraph_test_lora.safetensors",
                                         strength=1.0)),
        "conditioning": refusal(lambda: ksampler(model, foreign, foreign, latent, 51, STEPS, 1.0)),
    }

    # LoRA: KV-Graph Load LoRA on the MODEL merges in place for the run (same latents as on the handle).
    lora_model, = run_node(env, "KVGraphLoadLoRA", model=model, lora_name="kvgraph_test_lora.safetensors",
                           strength=1.0)
    lora_handle, = run_node(env, "KVGraphLoadLoRA", model=handle, lora_name="kvgraph_test_lora.safetensors",
                            strength=1.0)
    with_lora = custom_advanced(lora_model, positive, negative, latent, sigmas, "euler", 1.0, 41)
    without = custom_advanced(model, positive, negative, latent, sigmas, "euler", 1.0, 41)
    out["lora"] = {"max_diff_vs_kv_sampler": diff(with_lora, kv_sampler(41, model_in=lora_handle)),
                   "changed_by_lora": diff(with_lora, without)}
    out["core_lora"] = core_lora(env, model, handle, positive, negative, latent, sigmas)
    out["partial_load"] = partial_load(model, handle, positive, negative, latent, sigmas)

    # Nothing of a run outlives it: no run in progress, the engine not busy, no prefix left owning an entry.
    in_flight = importlib.import_module(f"{env.pack.__name__}.graph_runtime.in_flight")
    engine = handle.engine
    out["after"] = {"runs": in_flight.runs(), "busy": handle.loaded.busy,
                    "owned_entries": sum(engine.graphs.owners.alive(k) for k in engine.graphs.entries),
                    "stats": engine.stats.snapshot()}
    return out


if __name__ == "__main__":
    result = main()
    print("KVGRAPH-RESULT " + json.dumps(result))
