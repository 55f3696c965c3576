"""Node behaviour on the tiny model (CPU, a fake of the few ComfyUI pieces the pack touches; no ComfyUI needed).

Covers: loaders and the process-wide model cache, the encode node's conditioning and latent, the sampler against the
runtime it wraps, CFG / denoise / turbo, interruption, progress and previews, websocket events, the VAE nodes, the
text encoder's placement policy, ComfyUI memory management hooks, the cache nodes and the HTTP routes.
"""

import importlib
import asyncio
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake import InterruptProcessingException  # noqa: E402
from comfy_fake.fixtures import close_env, comfy_env, make_env  # noqa: E402,F401

T_FILE, TE_FILE, VAE_FILE = ("qwen_image_2.1_bf16.safetensors", "qwen3vl_8b_bf16.safetensors",
                             "qwen_image_2.1_vae_bf16.safetensors")
OFFLOAD = "gpu while encoding, then offload"


def run(env, node_id, **inputs):
    return env.nodes[node_id].execute(**inputs).args


def load_all(env, dtype="fp32", placement=OFFLOAD):
    transformer, _ = run(env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype=dtype)
    text_encoder, = run(env, "KVGraphLoadTextEncoder", text_encoder_name=TE_FILE, dtype=dtype,
                        text_encoder_placement=placement)
    vae, = run(env, "KVGraphLoadVAE", vae_name=VAE_FILE, dtype=dtype)
    return transformer, text_encoder, vae


def encode(env, text_encoder, **overrides):
    inputs = dict(text_encoder=text_encoder, prompt="a red cube on a blue sphere", negative_prompt="blurry",
                  width=128, height=96, size_from_reference=True, reference_resolution=128)
    inputs.update(overrides)
    return run(env, "KVGraphTextEncode", **inputs)


def sampler(env, model, positive, latent, **overrides):
    inputs = dict(model=model, positive=positive, latent=latent, seed=7, steps=3, cfg=1.0, sigma_preset="dynamic",
                  denoise=1.0, decode_mode="auto", compile="off")
    inputs.update(overrides)
    return run(env, "KVGraphSampler", **inputs)[0]


def image(height, width, seed=0, channels=3):
    return torch.from_numpy(np.random.RandomState(seed).rand(1, height, width, channels).astype("float32"))


@pytest.fixture(scope="module")
def models(comfy_env):
    return load_all(comfy_env)


# -- loaders -------------------------------------------------------------------------------------------------------


def test_loaders_return_the_cached_model_for_the_same_file(comfy_env, models):
    transformer, text_encoder, vae = models
    cache = comfy_env.pack.nodes.comfyui.model_cache
    again = load_all(comfy_env)
    assert again[0] is transformer and again[1] is text_encoder and again[2] is vae
    assert cache.load_count(transformer.key) == 1 and cache.load_count(vae.key) == 1
    assert transformer.engine is again[0].engine  # the same graph manager answers every workflow
    assert type(transformer.module).__name__ == "QwenImage21Transformer2DModel"
    assert transformer.patcher.model.diffusion_model is transformer.module
    assert text_encoder.processor is not None and vae.module.config.z_dim == 64
    other, _ = run(comfy_env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="bf16")
    assert other is not transformer and next(other.module.parameters()).dtype == torch.bfloat16


def test_loader_fingerprint_follows_the_file(comfy_env, tmp_path):
    node = comfy_env.nodes["KVGraphLoadVAE"]
    first = node.fingerprint_inputs(vae_name=VAE_FILE, dtype="bf16")
    assert first == node.fingerprint_inputs(vae_name=VAE_FILE, dtype="bf16")
    assert first != node.fingerprint_inputs(vae_name=VAE_FILE, dtype="fp32")
    assert node.fingerprint_inputs(vae_name="missing.safetensors", dtype="bf16")  # no exception before execute


def test_missing_model_file_names_the_file_and_the_input(comfy_env):
    from_pack = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.errors")
    with pytest.raises(from_pack.CheckpointError) as err:
        run(comfy_env, "KVGraphLoadTransformer", transformer_name="qwen_image_2.1_fp8.safetensors", dtype="bf16")
    assert "qwen_image_2.1_fp8.safetensors" in str(err.value) and "transformer_name" in str(err.value)


def test_broken_model_file_names_the_file(comfy_env):
    broken = comfy_env.models / "diffusion_models" / "kvgraph_broken.safetensors"
    broken.write_bytes(b"\x00" * 64)
    try:
        with pytest.raises(ValueError) as err:
            run(comfy_env, "KVGraphLoadTransformer", transformer_name=broken.name, dtype="bf16")
        assert str(broken) in str(err.value)
    finally:
        broken.unlink()


def test_diffusers_folder_loader(comfy_env):
    transformer, text_encoder, vae, _ = run(comfy_env, "KVGraphLoadDiffusers", folder="qwen-image-2.1-tiny",
                                         dtype="fp32", text_encoder_placement="cpu")
    assert transformer.kind == "transformer" and text_encoder.kind == "text_encoder" and vae.kind == "vae"
    assert transformer.scheduler_config["shift_terminal"] == 0.02
    assert text_encoder.placement == "cpu" and str(text_encoder.patcher.load_device) == "cpu"
    again = run(comfy_env, "KVGraphLoadDiffusers", folder="qwen-image-2.1-tiny", dtype="fp32",
                text_encoder_placement="cpu")
    assert again[0] is transformer


# -- encode --------------------------------------------------------------------------------------------------------


def test_encode_text_to_image(comfy_env, models):
    positive, negative, latent = encode(comfy_env, models[1])
    cond, extras = positive[0]
    assert cond.dim() == 3 and cond.shape[0] == 1 and cond.shape[2] == 64 and cond.device.type == "cpu"
    assert "image_slots" not in extras and "reference_latents" not in extras
    assert not torch.equal(negative[0][0][:, :5], cond[:, :5]) or negative[0][0].shape != cond.shape
    assert latent["samples"].shape == (1, 64, 6, 8) and not latent["samples"].any()


@pytest.mark.parametrize("name, value", [("width", 100), ("height", 8)])
def test_encode_rejects_sizes_off_the_16px_grid(comfy_env, models, name, value):
    from_pack = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.errors")
    with pytest.raises(from_pack.InputError) as err:
        encode(comfy_env, models[1], **{name: value})
    assert f"{name}={value}" in str(err.value) and "multiple of 16" in str(err.value)


def test_reference_images_need_the_vae(comfy_env, models):
    with pytest.raises(ValueError, match="vae"):
        encode(comfy_env, models[1], images={"image1": image(96, 128)})


def test_encode_with_references(comfy_env, models):
    from graph_runtime.encoding.images import reference_size
    from graph_runtime.comfy_interop import comfy_image_to_pil

    first, second = image(96, 128, 1), image(160, 96, 2, channels=4)
    positive, negative, latent = encode(comfy_env, models[1], vae=models[2], images={"image1": first, "image2": second})
    extras = positive[0][1]
    assert len(extras["image_slots"]) == 2 and len(extras["reference_latents"]) == 2
    w, h = reference_size(comfy_image_to_pil(second), 128)
    assert extras["reference_latents"][1].shape == (1, 64, h // 16, w // 16)
    assert latent["samples"].shape == (1, 64, h // 16, w // 16)  # sized like the last reference
    assert negative[0][1]["image_slots"] == extras["image_slots"]
    _, _, fixed = encode(comfy_env, models[1], vae=models[2], images={"image1": first},
                      size_from_reference=False)
    assert fixed["samples"].shape == (1, 64, 6, 8)


# -- sampler -------------------------------------------------------------------------------------------------------


def test_sampler_equals_the_runtime_and_reports_progress_and_events(comfy_env, models, caplog):
    rt = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.sampling.sampler")
    ci = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.comfy_interop")
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder)
    fake = comfy_env.fake
    fake.set_context("prompt-A", "42")
    fake.progress.clear(), fake.sent.clear(), fake.load_calls.clear()
    caplog.set_level(logging.INFO, logger="kvgraph")
    out = sampler(comfy_env, transformer, positive, latent)
    summary = [r.getMessage() for r in caplog.records if "ms/step" in r.getMessage()]
    assert len(summary) == 1  # one summary line per run
    assert all(part in summary[0] for part in ("prefill", "decode", "captures 0", "replays 0",
                                               "eager steps 3 (no CUDA: 3)", "128x96", "3 steps"))
    assert out["samples"].shape == (1, 64, 6, 8) and out["samples"].dtype == torch.float32

    parsed = ci.conditioning_to_prompt(positive)
    request = rt.SamplingRequest(positive=parsed.embeds, latent_height=6, latent_width=8, seed=7, steps=3,
                                 scheduler_config=transformer.scheduler_config)
    expected = ci.normalized_to_raw(rt.sample(transformer.engine, request).latents.float(), ci.latent_stats())
    assert torch.equal(out["samples"], expected)

    assert [p[:2] for p in fake.progress] == [(1, 3), (2, 3), (3, 3)] and fake.progress[0][2] is None
    assert any(c["force_full_load"] and transformer.patcher in c["models"] for c in fake.load_calls)
    phases = [e["phase"] for e in fake.events()]
    assert phases[0] == "prefill" and "fallback" in phases and phases[-1] == "done"
    assert all(e["prompt_id"] == "prompt-A" and e["node"] == "42" for e in fake.events())
    assert fake.events("fallback")[0]["reason"] == "no CUDA"
    done = fake.events("done")[-1]
    assert done["captures"] == 0 and done["eager_steps"] == {"no CUDA": 3}  # every step, step 1 included


def test_status_events_go_only_to_the_client_that_queued_the_prompt(comfy_env, models, monkeypatch):
    """Every `kvgraph.status` event of a run is addressed to the prompt's client (ComfyUI's `client_id` while the
    prompt runs), never broadcast (sid None) to every connected browser; a prompt queued without a client id sends
    none, as core sends it no `executed`. The run's result is the same either way."""
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder)
    fake = comfy_env.fake
    server = sys.modules["server"].PromptServer.instance
    fake.set_context("prompt-B", "7")
    monkeypatch.setattr(server, "client_id", "browser-of-B")
    fake.sent.clear(), fake.recipients.clear()
    first = sampler(comfy_env, transformer, positive, latent)
    status = [sid for (event, _), sid in zip(fake.sent, fake.recipients) if event == "kvgraph.status"]
    assert status and set(status) == {"browser-of-B"}
    monkeypatch.setattr(server, "client_id", None)
    fake.sent.clear(), fake.recipients.clear()
    second = sampler(comfy_env, transformer, positive, latent)
    assert fake.events() == [] and torch.equal(first["samples"], second["samples"])


def test_sampler_reads_core_conditioning_without_slots(comfy_env, models):
    """References with no image_slots (as core's ReferenceLatent node adds them) go after the prompt's text."""
    transformer, text_encoder, vae = models
    positive, _, latent = encode(comfy_env, text_encoder)
    cond = positive[0][0]
    core = [[cond, {"pooled_output": None, "reference_latents": [torch.randn(1, 64, 4, 6)]}]]
    out = sampler(comfy_env, transformer, core, latent)
    plain = sampler(comfy_env, transformer, positive, latent)
    assert out["samples"].shape == plain["samples"].shape and not torch.equal(out["samples"], plain["samples"])


def test_cfg_uses_the_negative_only_above_one(comfy_env, models):
    transformer, text_encoder, _ = models
    positive, negative, latent = encode(comfy_env, text_encoder)
    base = sampler(comfy_env, transformer, positive, latent)["samples"]
    assert torch.equal(sampler(comfy_env, transformer, positive, latent, negative=negative)["samples"], base)
    assert torch.equal(sampler(comfy_env, transformer, positive, latent, cfg=4.0)["samples"], base)
    guided = sampler(comfy_env, transformer, positive, latent, negative=negative, cfg=4.0)["samples"]
    assert not torch.allclose(guided, base)


def test_denoise_below_one_starts_from_the_input_latent(comfy_env, models):
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder)
    other = {"samples": torch.randn_like(latent["samples"]) * 3}
    full = [sampler(comfy_env, transformer, positive, lat)["samples"] for lat in (latent, other)]
    assert torch.equal(full[0], full[1])  # denoise 1: only the input's shape matters
    partial = [sampler(comfy_env, transformer, positive, lat, denoise=0.5)["samples"] for lat in (latent, other)]
    assert not torch.allclose(partial[0], partial[1])


def test_turbo_runs_its_fixed_eight_steps(comfy_env, models):
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder)
    comfy_env.fake.progress.clear()
    sampler(comfy_env, transformer, positive, latent, sigma_preset="turbo", steps=40)
    assert comfy_env.fake.progress[-1][:2] == (8, 8) and len(comfy_env.fake.progress) == 8


@pytest.mark.parametrize("case, name", [
    ("latent_channels", "latent"), ("two_entries", "positive"), ("preset", "sigma_preset"),
    ("decode", "decode_mode"),
])
def test_sampler_rejects_bad_inputs_by_name(comfy_env, models, case, name):
    transformer, text_encoder, vae = models
    positive, negative, latent = encode(comfy_env, text_encoder)
    kwargs = {}
    if case == "latent_channels":
        latent = {"samples": torch.zeros(1, 16, 6, 8)}
    elif case == "two_entries":
        positive = positive + positive
    elif case == "preset":
        kwargs = {"sigma_preset": "karras"}
    elif case == "decode":
        kwargs = {"decode_mode": "fast"}
    with pytest.raises(ValueError) as err:
        sampler(comfy_env, transformer, positive, latent, **kwargs)
    assert name in str(err.value) and "expected" in str(err.value)


def test_interrupt_stops_the_run_and_the_next_prompt_works(comfy_env, models):
    transformer, text_encoder, _ = models
    in_flight = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.in_flight")
    positive, _, latent = encode(comfy_env, text_encoder)
    comfy_env.fake.interrupt_at_step = 2
    try:
        with pytest.raises(InterruptProcessingException):
            sampler(comfy_env, transformer, positive, latent, steps=20)
    finally:
        comfy_env.fake.interrupt_at_step = None
    assert in_flight.runs() == [] and not transformer.loaded.busy
    assert comfy_env.fake.interrupted is False  # consumed by the exception, as ComfyUI's check does
    assert sampler(comfy_env, transformer, positive, latent)["samples"].shape == (1, 64, 6, 8)


def test_previews_follow_comfyui_preview_setting(comfy_env, models):
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder)
    cli = comfy_env.fake.cli_args
    cli.args.preview_method = cli.LatentPreviewMethod.Auto
    comfy_env.fake.progress.clear()
    try:
        sampler(comfy_env, transformer, positive, latent)
    finally:
        cli.args.preview_method = cli.LatentPreviewMethod.NoPreviews
    previews = [p[2] for p in comfy_env.fake.progress]
    assert all(p is not None and p[0] == "JPEG" and p[2] == 512 for p in previews)
    assert previews[0][1].size == (8, 6) and previews[0][1].mode == "RGB"


# -- VAE -----------------------------------------------------------------------------------------------------------


def test_vae_decode_and_encode(comfy_env, models):
    vae = models[2]
    images, _ = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": torch.randn(2, 64, 6, 8)})
    assert images.shape == (2, 96, 128, 3) and float(images.min()) >= 0 and float(images.max()) <= 1
    latent, = run(comfy_env, "KVGraphVAEEncode", vae=vae, image=images)
    assert latent["samples"].shape == (2, 64, 6, 8)
    cropped, = run(comfy_env, "KVGraphVAEEncode", vae=vae, image=image(90, 100))
    assert cropped["samples"].shape == (1, 64, 5, 6)
    with pytest.raises(ValueError, match="latent"):
        run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": torch.zeros(1, 4, 8, 8)})


def test_vae_decode_outputs_the_alpha_channel_as_cores_mask(comfy_env, models):
    """Next to the IMAGE (unchanged: alpha composited over white) the node outputs the VAE's alpha as a MASK in core's
    Load Image convention, 1 - alpha, one per image of the batch: what the VAE decoded, within float32 round-off."""
    from graph_runtime.comfy_interop import vae_pixels_to_comfy_image
    from graph_runtime.encoding.images import vae_decode

    vae = models[2]
    raw = torch.randn(2, 64, 6, 8, generator=torch.Generator().manual_seed(3))
    images, masks = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": raw})
    decoded = torch.cat([vae_decode(vae.module, raw[i:i + 1]) for i in range(2)]).float()
    alpha = ((decoded[:, 3] + 1) / 2).clamp(0, 1)
    assert masks.shape == (2, 96, 128) and masks.dtype == torch.float32
    assert (masks - (1 - alpha)).abs().max() <= 1e-6 and float(alpha.std()) > 1e-3
    assert torch.equal(images, vae_pixels_to_comfy_image(decoded))
    schema = comfy_env.nodes["KVGraphVAEDecode"].define_schema()
    assert [o.display_name for o in schema.outputs] == ["image", "mask"]


# -- memory management ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement, offloads", [(OFFLOAD, 1), ("always gpu", 0)])
def test_text_encoder_placement_policy(comfy_env, monkeypatch, placement, offloads):
    handle, = run(comfy_env, "KVGraphLoadTextEncoder", text_encoder_name=TE_FILE, dtype="fp32",
                  text_encoder_placement=placement)
    calls = []
    monkeypatch.setattr(handle, "offload", lambda: calls.append("offload"))
    comfy_env.fake.load_calls.clear()
    encode(comfy_env, handle)
    assert len(calls) == offloads
    assert any(handle.patcher in c["models"] for c in comfy_env.fake.load_calls)


def test_patcher_loads_whole_or_streams_and_unloading_releases_graphs(comfy_env, models, monkeypatch):
    transformer = models[0]
    patcher = transformer.patcher
    transformer.ensure_loaded()
    patcher.calls.clear()
    assert patcher.partially_load(patcher.load_device, 1e32) == 0 and patcher.calls == []  # already resident
    released = []
    monkeypatch.setattr(transformer.engine, "release", lambda: released.append(1) or {"entries": 0})
    freed = patcher.partially_unload(patcher.offload_device, memory_to_free=1)
    assert freed == patcher.model_size() and patcher.loaded_size() == 0  # all of it, never a part
    assert released == [1]
    patcher.partially_load(patcher.load_device, 1.0)  # the transformer streams within ComfyUI's figure
    plan = patcher.stream_plan()
    assert plan is not None and plan.resident_blocks == 0 and patcher.loaded_size() == plan.resident
    patcher.detach(unpatch_all=True)
    assert patcher.stream_plan() is None and patcher.loaded_size() == 0
    vae = models[2].patcher  # a model that cannot stream loads whole, whatever ComfyUI offered
    vae.detach(unpatch_all=True)
    vae.calls.clear()
    vae.partially_load(vae.load_device, 1.0)
    assert ("patch_model", vae.load_device, 0) in vae.calls
    assert vae.loaded_size() == vae.model_size()


def test_release_waits_for_a_running_sampler(comfy_env, models, monkeypatch):
    nodes = comfy_env.pack.nodes
    engine = models[0].engine
    released = []
    monkeypatch.setattr(engine, "release", lambda: released.append(1) or {"entries": 0})
    in_flight = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.in_flight")
    with in_flight.sampling(models[0].loaded, "p", "1", 10):
        result = nodes.comfyui.model_cache.release()
        assert {"model": engine.graphs.name, "result": "deferred"}.items() <= next(
            g for g in result["graphs"] if g["engine_id"] == f"{id(engine):x}").items()
        assert released == []
    assert released == [1]


# -- cache nodes and routes ----------------------------------------------------------------------------------------


class Request:
    """The part of aiohttp's request the routes read: the raw body."""

    def __init__(self, body: bytes | None = None):
        self.body = body
        self.can_read_body = body is not None

    async def read(self):
        return self.body


def response_json(response):
    if hasattr(response, "data"):  # the fake aiohttp
        return response.data
    import json

    return json.loads(response.text)  # real aiohttp installed


def test_status_route_and_node_report_the_graph_cache(comfy_env, models):
    transformer, text_encoder, _ = models
    positive, _, latent = encode(comfy_env, text_encoder)
    sampler(comfy_env, transformer, positive, latent)
    payload = response_json(asyncio.run(comfy_env.fake.routes[("GET", "/kvgraph/status")](Request())))
    model = next(m for m in payload["models"] if m["engine_id"] == f"{id(transformer.engine):x}")
    assert model["source"].endswith(T_FILE) and model["loads"] == 1 and model["captures"] == 0
    assert model["eager_steps"]["no CUDA"] >= 2 and model["busy"] is False
    assert {"kind": "vae"}.items() <= next(m for m in payload["loaded"] if m["kind"] == "vae").items()
    assert (model["prefill_captures"], model["prefill_replays"], model["eager_prefills"]) == (0, 0, {})
    report, passthrough = run(comfy_env, "KVGraphCacheStatus")
    assert passthrough is None
    assert T_FILE in report and "no CUDA" in report and "prefills: 0 captured, 0 replayed, eager: none" in report


def test_status_survives_an_engine_that_cannot_report(comfy_env, models):
    class Broken:  # e.g. an engine built against an older runtime
        @property
        def transformer(self):
            raise AttributeError("no transformer here")

    class Owner:  # a loaded model whose engine is that one
        def engines(self):
            return [broken]

    broken, owner = Broken(), Owner()
    comfy_env.pack.nodes.comfyui.model_cache._transformers.add(owner)
    try:
        payload = comfy_env.pack.nodes.comfyui.model_cache.status_payload()
        assert {"engine_id": f"{id(broken):x}", "error": "AttributeError: no transformer here"} in payload["models"]
        assert any(m.get("source", "") and m["source"].endswith(T_FILE) for m in payload["models"])
        assert "unreadable" in comfy_env.pack.nodes.comfyui.model_cache.status_report()
        assert any(g["result"].startswith("failed")
                   for g in comfy_env.pack.nodes.comfyui.model_cache.release()["graphs"])
    finally:
        comfy_env.pack.nodes.comfyui.model_cache._transformers.discard(owner)


def test_release_route_validates_its_body(comfy_env):
    routes = comfy_env.pack.nodes.comfyui.server_routes
    assert routes.release_response(b'{"models": "yes"}')[0] == 400
    assert routes.release_response(b"[1]")[0] == 400
    code, payload = routes.release_response(None)
    assert code == 200 and payload["models"] == []


def test_release_models_then_reload(comfy_env):
    env = make_env()  # its own pack copy: dropping models here must not disturb the module's shared ones
    try:
        transformer, _, _ = load_all(env)
        report, _ = run(env, "KVGraphReleaseCaches", release_models=True)
        assert "dropped" in report and env.pack.nodes.comfyui.model_cache.handles() == []
        again, _, _ = load_all(env)
        assert again is not transformer and env.pack.nodes.comfyui.model_cache.load_count(again.key) == 2
        run(env, "KVGraphReleaseCaches", release_models=True)
        # ComfyUI's output cache may still hand the released handle to a sampler: once used it is cached again,
        # so the next loader gets it instead of reading the file a third time.
        again.ensure_loaded()
        assert env.pack.nodes.comfyui.model_cache.handles() == [again]
        reloaded, _ = run(env, "KVGraphLoadTransformer", transformer_name=T_FILE, dtype="fp32")
        assert reloaded is again
    finally:
        close_env(env)


@pytest.mark.parametrize("stats, expected", [
    ({"prefill_replays": 1, "prefill_captures": 0, "eager_prefills": {}}, "prefill 18.0 ms (replayed)"),
    ({"prefill_replays": 1, "prefill_captures": 1, "eager_prefills": {}}, "prefill 18.0 ms (captured)"),
    ({"prefill_replays": 0, "prefill_captures": 0, "eager_prefills": {"graph capture failed": 1}},
     "prefill 18.0 ms (eager: graph capture failed)"),
    ({}, "prefill 18.0 ms, decode"),
])
def test_summary_line_says_how_the_prefill_ran(comfy_env, stats, expected):
    """The run's one log line tells whether its prefill replayed a captured prefix pass, captured one, or ran
    eagerly and why (nothing when the request had no graph entry: its eager steps say why)."""
    import types

    report = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.report")
    result = types.SimpleNamespace(stats={"captures": 0, "replays": 8, "eager_steps": {}, **stats},
                                   timings={"steps": 8, "prefill_ms": 18.0, "decode_ms_per_step": 107.0})
    line = report.run_summary(1024, 1024, 1, result, "turbo", 1.0)
    assert expected in line and "replays 8" in line
