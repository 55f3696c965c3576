"""The loaders' ComfyUI MODEL on CPU with the fake of core's sampling stack (tests/comfy_fake/core.py): what core
reads from it (latent format, sampling, dtype), how it prepares conditioning, the run its sampling call opens and
closes, the LoRA chain it carries (core's LoRA loaders: tests/test_nodes_core_lora.py), and the KV-Graph Sigmas and
sampler nodes around it.
A real ComfyUI's samplers run on it in tests/test_core_sampling_comfyui.py.

`core_sample` below is the part of `CFGGuider.sample` the MODEL takes part in: the OUTER_SAMPLE wrappers around the
sampling call, the conditioning prepared once by `extra_conds`, and one `apply_model` per Euler step with the run's
transformer options. Tolerance: the fp32 tiny model; core's Euler against the KV-Graph Sampler's differ by float32
round-off (tests/test_core_model.py), so 2e-5 on raw latents of magnitude ~5.
"""

import importlib
import copy
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_execute import encode, load_all, run, sampler  # noqa: E402

ATOL = 2e-5


@pytest.fixture(scope="module")
def setup(comfy_env):
    transformer, text_encoder, _ = load_all(comfy_env)
    positive, negative, latent = encode(comfy_env, text_encoder)
    return transformer, transformer.model, positive, negative, latent


def pack_module(env, name):
    return importlib.import_module(f"{env.pack.__name__}.{name}")


def core_sample(env, patcher, conditioning, latent, sigmas, seed, during=None):
    """Euler over the MODEL as core's CFGGuider drives it (cfg 1): returns raw latents."""
    import comfy.patcher_extension as ext

    model = patcher.model
    cond, extras = conditioning[0]
    prepared = model.extra_conds(cross_attn=cond, **extras, prompt_type="positive")
    guider = types.SimpleNamespace(model_patcher=patcher, model_options=copy.deepcopy(patcher.model_options))
    guider.model_options["transformer_options"]["wrappers"] = patcher.wrappers  # prepare_model_patcher's merge

    def outer_sample(noise, latent_image, sampler_obj, sigmas, denoise_mask=None, callback=None, *rest):
        x = noise * sigmas[0]
        options = dict(guider.model_options["transformer_options"], cond_or_uncond=[0])
        for i in range(len(sigmas) - 1):
            if during is not None:
                during(options)
            key = next(iter(prepared))
            denoised = model.apply_model(x, sigmas[i].expand(x.shape[0]), transformer_options=options,
                                         **{key: prepared[key].process_cond(x.shape[0]).cond})
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
            if callback is not None:
                callback(i, denoised, x, len(sigmas) - 1)
        return model.process_latent_out(x)

    noise = torch.randn(latent["samples"].shape, generator=torch.Generator("cpu").manual_seed(seed))
    executor = ext.WrapperExecutor.new_class_executor(
        outer_sample, guider, ext.get_all_wrappers(ext.WrappersMP.OUTER_SAMPLE, guider.model_options, True))
    return executor.execute(noise, latent["samples"], None, sigmas, None, None, False, seed)


def sigmas_node(env, model, latent, steps=3, preset="auto"):
    return run(env, "KVGraphSigmas", model=model, steps=steps, sigma_preset=preset, width=1024, height=1024,
               denoise=1.0, latent=latent)[0]


def test_the_model_is_what_core_reads(comfy_env, setup):
    """The MODEL wraps the same loaded transformer (one patcher for ComfyUI's memory management), with Qwen-Image-2.1's
    64-channel latent format (the pack's VAE statistics) and flow-matching sampling at the model's 1024x1024 shift."""
    from graph_runtime.comfy_interop.latents import latent_stats, raw_to_normalized
    from graph_runtime.sampling.schedule import dynamic_shift

    handle, model, *_ = setup
    assert model is handle.patcher and model.model.diffusion_model is handle.module
    fmt = model.model.latent_format
    raw = torch.randn(1, 64, 6, 8)
    assert fmt.latent_channels == 64 and torch.equal(fmt.process_in(raw), raw_to_normalized(raw, latent_stats()))
    assert torch.allclose(fmt.process_out(fmt.process_in(raw)), raw, atol=1e-5)
    sampling = model.model.model_sampling
    assert sampling.shift == pytest.approx(dynamic_shift(handle.scheduler_config, 1024, 1024))
    sigma = torch.tensor(0.3)
    assert float(sampling.sigma_max) == pytest.approx(1.0) and torch.equal(sampling.timestep(sigma), sigma)
    assert model.model.get_dtype() == torch.float32


def test_the_model_type_is_flow_matching_not_flux(comfy_env, setup):
    """ComfyUI logs the MODEL's type when it is built: FLOW (flow matching), which is what it is, not FLUX; the
    sampling stays the exponential shift of the model's schedule (sigma(t) = e^mu / (e^mu + 1/t - 1))."""
    import math

    _, model, *_ = setup
    assert model.model.model_type.name == "FLOW"
    sampling = model.model.model_sampling
    t = 0.25
    expected = math.exp(sampling.shift) / (math.exp(sampling.shift) + 1 / t - 1)
    assert float(sampling.sigma(torch.tensor(t))) == pytest.approx(expected, rel=1e-6)  # fp32 arithmetic


def test_core_euler_over_kvgraph_sigmas_equals_the_kvgraph_sampler(comfy_env, setup):
    """Through the MODEL's own glue (prepared conditioning, the run wrapper, apply_model) core's Euler over the
    KV-Graph Sigmas node's schedule gives the KV-Graph Sampler node's latents; the run is gone afterwards."""
    handle, model, positive, _, latent = setup
    sigmas = sigmas_node(comfy_env, model, latent)
    core = core_sample(comfy_env, model, positive, latent, sigmas, seed=7)
    ours = sampler(comfy_env, handle, positive, latent, sigma_preset="auto")["samples"]
    assert (core - ours).abs().max() <= ATOL
    in_flight = pack_module(comfy_env, "graph_runtime.in_flight")
    assert in_flight.runs() == [] and not handle.loaded.busy


def test_the_run_is_open_for_the_sampling_call_only(comfy_env, setup):
    """The wrapper opens one run per sampling call: its model calls see it (and the engine busy, the step in the
    status), and it is released when the call ends, also when the call fails."""
    handle, model, positive, _, latent = setup
    core_model = pack_module(comfy_env, "nodes.comfyui.core_model")
    seen = []

    def during(options):
        seen.append((options[core_model.RUN], handle.loaded.busy))

    core_sample(comfy_env, model, positive, latent, sigmas_node(comfy_env, model, latent), 1, during)
    runs = {id(run) for run, _ in seen}
    assert len(seen) == 3 and len(runs) == 1 and all(busy for _, busy in seen)
    assert seen[0][0].released and seen[0][0].counts.calls == 3 and seen[0][0].counts.prefills == 1

    def fail(options):
        seen.append(options[core_model.RUN])
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        core_sample(comfy_env, model, positive, latent, sigmas_node(comfy_env, model, latent), 1, fail)
    assert seen[-1].released and not handle.loaded.busy


def test_equal_conditioning_is_one_prefix(comfy_env, setup):
    """Core prepares each conditioning entry once per run; entries with the same content may share a model call,
    entries with different content never do (their model conditions do not concatenate)."""
    _, model, positive, negative, _ = setup
    prepare = model.model.extra_conds
    a = prepare(cross_attn=positive[0][0], **positive[0][1])
    b = prepare(cross_attn=positive[0][0].clone(), **positive[0][1])
    c = prepare(cross_attn=negative[0][0], **negative[0][1])
    (key,) = a
    assert a[key].can_concat(b[key]) and not a[key].can_concat(c[key])


def test_a_clone_still_releases_the_graphs_when_it_unloads(comfy_env, setup):
    """ComfyUI may unload the weights through any clone (a LoRA node's, a sampler's): the owner still hears of it."""
    _, model, *_ = setup
    clone = model.clone()
    assert clone.on_unload is model.on_unload and clone.on_unload is not None
    assert clone.wrappers == model.wrappers


def test_kvgraph_lora_on_the_model_merges_for_the_run(comfy_env, setup):
    """KV-Graph Load LoRA on the MODEL gives a clone carrying the chain (the loader's MODEL is unchanged); a run on it
    samples what the KV-Graph Sampler samples with the same LoRA on the transformer."""
    from lora_layouts import write_layout

    handle, model, positive, _, latent = setup
    loras = comfy_env.models / "loras"
    loras.mkdir(exist_ok=True)
    write_layout(loras / "kvgraph_core_style.safetensors", "kohya", handle.module, seed=5)
    lora_model, = run(comfy_env, "KVGraphLoadLoRA", model=model, lora_name="kvgraph_core_style.safetensors",
                      strength=1.0)
    lora_handle, = run(comfy_env, "KVGraphLoadLoRA", model=handle, lora_name="kvgraph_core_style.safetensors",
                       strength=1.0)
    core_model = pack_module(comfy_env, "nodes.comfyui.core_model")
    assert lora_model is not model and lora_model.model is model.model
    assert len(lora_model.attachments[core_model.LORAS]) == 1 and core_model.LORAS not in model.attachments
    sigmas = sigmas_node(comfy_env, model, latent)
    with_lora = core_sample(comfy_env, lora_model, positive, latent, sigmas, seed=3)
    without = core_sample(comfy_env, model, positive, latent, sigmas, seed=3)
    ours = sampler(comfy_env, lora_handle, positive, latent, sigma_preset="auto", seed=3)["samples"]
    assert (with_lora - ours).abs().max() <= ATOL and (with_lora - without).abs().max() > 1e-3


def test_sigmas_node_gives_the_kvgraph_samplers_schedule(comfy_env, setup):
    """The dynamic schedule shifts with the latent's size (or width and height); auto on the Turbo checkpoint and
    turbo are the fixed 8-step grid; anything but a KV-Graph MODEL is refused by name."""
    from graph_runtime.sampling.schedule import TURBO_SIGMAS, schedule_for

    handle, model, _, _, latent = setup
    sigmas = sigmas_node(comfy_env, model, latent, steps=5)
    _, expected = schedule_for("dynamic", 5, 6 * 8, handle.scheduler_config)
    assert torch.equal(sigmas, expected.float()) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    big = run(comfy_env, "KVGraphSigmas", model=model, steps=5, sigma_preset="dynamic", width=1024, height=1024,
              denoise=1.0)[0]
    assert (big[1:-1] > sigmas[1:-1]).all()  # a larger image shifts the schedule towards noise
    turbo = sigmas_node(comfy_env, model, latent, preset="turbo")
    assert turbo[:-1].tolist() == pytest.approx(list(TURBO_SIGMAS)) and turbo[-1] == 0.0
    errors = pack_module(comfy_env, "graph_runtime.errors")
    with pytest.raises(errors.InputError, match="KV-Graph MODEL"):
        sigmas_node(comfy_env, types.SimpleNamespace(model=torch.nn.Linear(1, 1)), latent)


def test_the_kvgraph_sampler_inpaints_from_the_latents_noise_mask(comfy_env, setup):
    """SetLatentNoiseMask's mask (pixel resolution, `[N, 1, H, W]`) on the sampler's latent: the region where it is 0
    keeps the input latent, the rest is sampled; without the mask the whole image changes."""
    handle, _, positive, _, latent = setup
    start = sampler(comfy_env, handle, positive, latent, seed=1)["samples"]
    mask = torch.zeros(1, 1, 96, 128)
    mask[..., 64:] = 1.0
    out = sampler(comfy_env, handle, positive, {"samples": start, "noise_mask": mask}, seed=2)["samples"]
    assert (out[..., :4] - start[..., :4]).abs().max() <= 1e-5
    assert (out[..., 4:] - start[..., 4:]).abs().max() > 1e-1


def test_another_text_encoders_conditioning_is_refused_by_name(comfy_env, setup):
    """Conditioning from another model's text encoder (e.g. CLIP's 768 wide) fails when core prepares it, saying
    what the model reads, before any model call."""
    _, model, *_ = setup
    errors = pack_module(comfy_env, "graph_runtime.errors")
    with pytest.raises(errors.InputError, match=r"width 768.*Qwen-Image-2.1 conditioning of width 64"):
        model.model.extra_conds(cross_attn=torch.zeros(1, 77, 768), pooled_output=torch.zeros(1, 768),
                                prompt_type="negative")


def test_core_cache_placement_is_what_the_models_memory_estimate_prices(comfy_env, setup):
    """Core's Qwen Image 2.1 Cache setting on the MODEL (dtype int8: the int8 placement) is kept as set: during the
    sampling call (where core asks the model what it needs before loading it) `memory_required` prices the int8
    prefix, less than the bf16 one (its single working buffer against every block's target rows); outside a run it
    prices the GPU prefix again, and the run prefills int8."""
    handle, model, positive, _, latent = setup
    patched = model.clone()
    patched.model_options.setdefault("transformer_options", {})["qwen_image21_cache"] = {"device": "gpu",
                                                                                         "dtype": "int8"}
    shape, conds = [1, 64, 64, 64], {"kvgraph_prefix": [[4096 + 128]]}
    outside = model.model.memory_required(shape, conds)
    seen = []
    core_sample(comfy_env, patched, positive, latent, sigmas_node(comfy_env, patched, latent), 1,
                lambda options: seen.append(model.model.memory_required(shape, conds)))
    assert seen and all(need == seen[0] for need in seen) and seen[0] < outside
    assert model.model.memory_required(shape, conds) == outside
    assert handle.loaded.engine.stats.prefix_placements["int8"] >= 1

