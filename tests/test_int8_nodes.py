"""The loader and sampler nodes with ComfyUI's INT8 ConvRot files (the tiny ones, under the released names): both
weight modes, the cache key, Turbo detection and the sampler's auto preset, which runs the Turbo grid as ComfyUI's
Turbo template does (CPU, the small ComfyUI fake)."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

T_INT8, TURBO_INT8, TE_INT8 = ("qwen_image_2.1_int8_convrot.safetensors",
                               "qwen_image_2.1_turbo_int8_convrot.safetensors", "qwen3vl_8b_int8_convrot.safetensors")
T_BF16 = "qwen_image_2.1_bf16.safetensors"
# ComfyUI's Qwen-Image-2.1 Turbo templates: ManualSigmas "1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148,
# 0.704534, 0.414568, 0" into SamplerCustomAdvanced, CFGGuider cfg 1.
TEMPLATE_TURBO_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568, 0.0]


def pack_module(env, name):
    """A module of the pack as ComfyUI imported it (its classes are not the top-level graph_runtime's)."""
    return importlib.import_module(f"{env.pack.__name__}.{name}")


def run(env, node_id, **inputs):
    return env.nodes[node_id].execute(**inputs).args


def transformer(env, name=T_INT8, mode="int8", dtype="fp32"):
    return run(env, "KVGraphLoadTransformer", transformer_name=name, dtype=dtype, int8_weights=mode)[0]


def text_encoder(env, mode="int8"):
    return run(env, "KVGraphLoadTextEncoder", text_encoder_name=TE_INT8, dtype="fp32",
               text_encoder_placement="cpu", int8_weights=mode)[0]


@pytest.fixture(scope="module")
def conditioning(comfy_env):
    positive, _, latent = run(comfy_env, "KVGraphTextEncode", text_encoder=text_encoder(comfy_env),
                              prompt="a lighthouse at dusk", negative_prompt="", width=128, height=96,
                              size_from_reference=True, reference_resolution=128)
    return positive, latent


def sample(env, model, conditioning, **overrides):
    positive, latent = conditioning
    inputs = dict(model=model, positive=positive, latent=latent, seed=7, steps=3, cfg=1.0, sigma_preset="auto",
                  denoise=1.0, decode_mode="auto", compile="off")
    inputs.update(overrides)
    env.fake.progress.clear()
    out = run(env, "KVGraphSampler", **inputs)[0]["samples"]
    return out, env.fake.progress[-1][:2]


def test_int8_loaders_keep_int8_or_dequantize_and_cache_each_mode(comfy_env):
    int8_modules = pack_module(comfy_env, "graph_runtime.quantized").int8_modules
    kept, again = transformer(comfy_env), transformer(comfy_env)
    plain = transformer(comfy_env, mode="dequantize")
    assert kept is again and plain is not kept  # the mode is part of the model cache key
    assert kept.key[-1] == "int8" and plain.key[-1] == "dequantize"
    assert len(int8_modules(kept.module)) == 14 and not int8_modules(plain.module)
    assert kept.describe()["weights"] == "int8" and plain.describe()["weights"].startswith("float")
    # an int8 handle is about half the bytes of the dequantized one (the small layers outside the blocks and the
    # embedders stay float, so a bit more than half at this toy width)
    assert kept.size_bytes < 0.75 * plain.size_bytes
    te_int8, te_plain = text_encoder(comfy_env), text_encoder(comfy_env, mode="dequantize")
    assert te_int8 is not te_plain and te_int8.describe()["weights"] == "int8"
    fingerprint = comfy_env.nodes["KVGraphLoadTransformer"].fingerprint_inputs
    assert fingerprint(T_INT8, "fp32", "int8") != fingerprint(T_INT8, "fp32", "dequantize")


def test_bad_weight_mode_is_refused_by_name(comfy_env):
    with pytest.raises(ValueError, match="int8_weights"):
        transformer(comfy_env, mode="int4")


def test_turbo_checkpoint_is_detected_and_auto_runs_its_eight_steps(comfy_env, conditioning):
    turbo, base = transformer(comfy_env, TURBO_INT8), transformer(comfy_env)
    assert turbo.describe()["variant"] == "turbo" and base.describe()["variant"] == "base"
    _, progress = sample(comfy_env, turbo, conditioning, steps=40)
    assert progress == (8, 8)
    _, progress = sample(comfy_env, base, conditioning, steps=3)
    assert progress == (3, 3)  # auto on the base model: the dynamic schedule over `steps`
    _, progress = sample(comfy_env, turbo, conditioning, sigma_preset="dynamic", steps=3)
    assert progress == (3, 3)  # an explicit preset wins


def test_turbo_grid_is_comfyuis_template_schedule(comfy_env, conditioning):
    """The schedule the runtime samples for the node's Turbo grid is the template's ManualSigmas, value for value (no
    resolution shift, last sigma 0.414568, not diffusers' terminal-stretched 0.02)."""
    nodes_sampler = pack_module(comfy_env, "nodes.sampler")
    schedule = pack_module(comfy_env, "graph_runtime.sampling.schedule")
    positive, latent = conditioning
    for model, preset in ((transformer(comfy_env, TURBO_INT8), "auto"), (transformer(comfy_env), "turbo")):
        request, _ = nodes_sampler.build_request(model, positive, None, latent, 7, 40, 1.0, preset, 1.0, "auto",
                                                 "off")
        assert request.sigma_preset == "turbo"
        sigmas_in = schedule.resolve_sigmas(request.sigma_preset, request.steps, request.sigmas)
        config = schedule.scheduler_config_for(request.sigma_preset, request.scheduler_config)
        timesteps, sigmas = schedule.build_schedule(config, request.steps, 48, sigmas_in)
        expected = torch.tensor(TEMPLATE_TURBO_SIGMAS, dtype=sigmas.dtype)
        assert torch.equal(sigmas.cpu(), expected)
        assert torch.allclose(timesteps.cpu(), expected[:-1] * 1000, rtol=0, atol=1e-3)
    dynamic, _ = nodes_sampler.build_request(transformer(comfy_env), positive, None, latent, 7, 40, 1.0, "auto",
                                             1.0, "auto", "off")
    assert dynamic.sigma_preset == "dynamic" and dynamic.scheduler_config == transformer(comfy_env).scheduler_config


def test_both_modes_sample_through_the_nodes(comfy_env, conditioning):
    """End to end through the nodes, both modes run and the int8 GEMMs really ran (the latents differ from the
    dequantized run's; tests/test_int8_convrot.py bounds by how much)."""
    int8, _ = sample(comfy_env, transformer(comfy_env), conditioning)
    plain, _ = sample(comfy_env, transformer(comfy_env, mode="dequantize"), conditioning)
    assert int8.shape == plain.shape == (1, 64, 6, 8) and bool(torch.isfinite(int8).all())
    assert not torch.equal(int8, plain)
    bf16_file = transformer(comfy_env, T_BF16, mode="int8")
    assert not bf16_file.describe().get("int8_layers")


def test_the_load_log_names_the_storage_as_it_is(comfy_env, caplog):
    """An INT8 file kept int8 is logged as int8 ConvRot weights computing in the loader's dtype, the same file
    dequantized as plain float weights: never "bf16" (the loader's dtype input) for weights that are int8."""
    import logging

    comfy_env.pack.nodes.comfyui.model_cache.forget_all("test")
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        transformer(comfy_env, mode="int8", dtype="bf16")
        transformer(comfy_env, mode="dequantize", dtype="bf16")
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV-Graph: loaded transformer")]
    assert len(loaded) == 2
    assert "int8 ConvRot" in loaded[0] and "bf16 compute" in loaded[0]
    assert "(bf16 weights, bf16 compute" in loaded[1]
    precision = [r.getMessage() for r in caplog.records if "transformer precision" in r.getMessage()]
    assert precision[0].endswith(")") and "precision: int8 (" in precision[0] and "int8 ConvRot" in precision[0]
