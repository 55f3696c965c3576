"""The memory budget through the nodes (CPU, the fake ComfyUI): the sampler refuses a request that cannot fit before
loading or allocating anything, names the settings to change, and the next request that fits runs; the budget is
logged and reported on /kvgraph/status; the VAE decode tiles when only that fits; the placement tooltip says what
each placement costs.

The fake's `get_free_memory` reports `fake.free_memory` when a test sets it (ComfyUI's own reports what the device
has free); the smaller of it and the runtime's own figure is used. On the CPU the runtime's figure is the host's
available memory, which moves while tests run: these tests pin it to the fake's default, so `free_memory` decides.
"""

import importlib
import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401

from graph_runtime import memory  # noqa: E402

FILES = ("qwen_image_2.1_bf16.safetensors", "qwen3vl_8b_bf16.safetensors", "qwen_image_2.1_vae_bf16.safetensors")
DEFAULT_FREE = 1 << 40  # what the fake reports on the CPU when no test sets it


def run(env, node_id, **inputs):
    return env.nodes[node_id].execute(**inputs).args


@pytest.fixture(scope="module")
def loaded(comfy_env):
    transformer, _ = run(comfy_env, "KVGraphLoadTransformer", transformer_name=FILES[0], dtype="fp32")
    text_encoder, = run(comfy_env, "KVGraphLoadTextEncoder", text_encoder_name=FILES[1], dtype="fp32",
                        text_encoder_placement="gpu while encoding, then offload")
    vae, = run(comfy_env, "KVGraphLoadVAE", vae_name=FILES[2], dtype="fp32")
    positive, _, latent = run(comfy_env, "KVGraphTextEncode", text_encoder=text_encoder, prompt="a red cube",
                              negative_prompt="", width=128, height=96, size_from_reference=True,
                              reference_resolution=128)
    return transformer, vae, positive, latent


def sample(env, transformer, positive, latent, **overrides):
    inputs = dict(model=transformer, positive=positive, latent=latent, seed=3, steps=2, cfg=1.0,
                  sigma_preset="dynamic", denoise=1.0, decode_mode="auto", compile="off")
    inputs.update(overrides)
    return run(env, "KVGraphSampler", **inputs)[0]


@pytest.fixture(autouse=True)
def steady_host_memory(comfy_env, monkeypatch):
    pack_memory = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.free_memory")
    monkeypatch.setattr(pack_memory, "host_available_bytes", lambda: DEFAULT_FREE)


@pytest.fixture
def free_memory(comfy_env):
    def set_free(value):
        comfy_env.fake.free_memory = value

    yield set_free
    comfy_env.fake.free_memory = None


def test_refusal_names_the_setting_and_the_next_fitting_request_runs(comfy_env, loaded, free_memory, caplog):
    transformer, _, positive, latent = loaded
    caplog.set_level(logging.INFO, logger="kvgraph")
    sample(comfy_env, transformer, positive, latent)
    small = transformer.last_budget
    assert any("memory budget for 1x 128x96" in r.getMessage() for r in caplog.records)
    # The device may hold the request's models, plus what ComfyUI could unload: all but the free memory itself.
    beyond_free = small["available_bytes"] - DEFAULT_FREE
    free_memory(small["total_bytes"] - beyond_free + (1 << 20))  # room for this request and 1 MiB more

    loads, entries = len(comfy_env.fake.load_calls), dict(transformer.engine.graphs.entries)
    big = {"samples": torch.zeros(1, 64, 64, 64)}  # 1024x1024
    from_pack = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.memory.budget")
    with pytest.raises(from_pack.MemoryBudgetError) as info:
        sample(comfy_env, transformer, positive, big)
    message = str(info.value)
    assert "width x height at most" in message and "(fits)" in message and "Nothing was allocated" in message
    assert "of models ComfyUI can unload" in message
    # Refused before anything was loaded or allocated.
    assert len(comfy_env.fake.load_calls) == loads and dict(transformer.engine.graphs.entries) == entries

    out = sample(comfy_env, transformer, positive, latent)  # the fitting request, with the same free memory
    assert out["samples"].shape == (1, 64, 6, 8) and torch.isfinite(out["samples"]).all()
    assert transformer.last_budget["total_bytes"] == small["total_bytes"]


def test_budget_is_on_the_status_route_and_report(comfy_env, loaded):
    transformer, _, positive, latent = loaded
    transformer.last_budget = None
    # Through a handle chained on the loader's (as KV-Graph Load LoRA makes one): the loader's handle reports it.
    sample(comfy_env, dataclasses.replace(transformer, base=transformer), positive, latent)
    assert transformer.last_budget is not None
    status = sys.modules[comfy_env.pack.__name__ + ".nodes.comfyui.model_cache"]
    model = next(m for m in status.status_payload()["models"] if m.get("source") == transformer.source)
    budget = model["budget"]
    assert budget["total_bytes"] == transformer.last_budget["total_bytes"] > budget["margin_bytes"] > 0
    assert budget["parts"]["transformer weights"] == transformer.size_bytes
    assert "last request's memory budget" in status.status_report()
    loaded_items = {item["kind"]: item for item in status.status_payload()["loaded"]}
    assert loaded_items["transformer"]["bytes"] == transformer.size_bytes  # the loaders' weight sizes


def test_vae_decode_tiles_when_only_a_tiled_decode_fits(comfy_env, loaded, free_memory, caplog):
    _, vae, _, _ = loaded
    dims = memory.VaeDims.of(vae.module)
    whole = memory.vae_decode_bytes(dims, 512, 512) + memory.MARGIN_BYTES
    tiled = memory.vae_decode_bytes(dims, 512, 512, tiled=True) + memory.MARGIN_BYTES
    assert tiled < whole
    caplog.set_level(logging.INFO, logger="kvgraph")
    free_memory((whole + tiled) // 2)
    image, _ = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": torch.randn(1, 64, 32, 32)})
    assert image.shape == (1, 512, 512, 3) and torch.isfinite(image).all()
    assert any("VAE decode at 512x512 is tiled" in r.getMessage() for r in caplog.records)
    free_memory(None)
    whole_image, _ = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": torch.randn(1, 64, 8, 8)})
    assert whole_image.shape == (1, 128, 128, 3)


def test_placement_tooltip_states_the_costs(comfy_env):
    """The placement tooltip names every choice and what each costs (host RAM for the pinned copy, VRAM, time per
    changed prompt), and points to the page with the measured times."""
    schema = comfy_env.nodes["KVGraphLoadTextEncoder"].define_schema()
    placement = next(i for i in schema.inputs if i.id == "text_encoder_placement")
    assert len(placement.options) == 5
    for choice in placement.options:
        assert f"'{choice}'" in placement.tooltip, choice
    for cost in ("host RAM", "VRAM", "pinned", "per changed prompt", "docs/memory.md", "two of its 36 decoder layers"):
        assert cost in placement.tooltip


def test_vae_decode_refuses_a_batch_whose_image_host_memory_cannot_hold(comfy_env, loaded, free_memory):
    """KV-Graph VAE Decode budgets the whole batch: its IMAGE and MASK (float32, in host memory) and, the VAE running on
    the CPU here, one image's decode. A batch that cannot fit is refused before the VAE is loaded or anything decoded,
    naming the largest batch that fits; that batch then decodes, and equals, image for image, the first decode."""
    _, vae, _, _ = loaded
    latents = torch.randn(6, 64, 8, 8, generator=torch.Generator().manual_seed(1))
    first, _ = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": latents})
    assert first.shape == (6, 128, 128, 3)
    per_image = memory.decoded_images_bytes(128, 128, 1, memory.IMAGE_BYTES_PER_PIXEL + memory.MASK_BYTES_PER_PIXEL)
    decode = memory.vae_decode_bytes(memory.VaeDims.of(vae.module), 128, 128)
    # Room for the decode and 3.5 images' IMAGE, margin included.
    free_memory(int((3.5 * per_image + decode) * (1 + memory.MARGIN_FRACTION)) + memory.MARGIN_BYTES)
    loads = len(comfy_env.fake.load_calls)
    from_pack = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.memory.budget")
    with pytest.raises(from_pack.MemoryBudgetError) as info:
        run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": latents})
    message = str(info.value)
    assert "decoded images (6x 128x128)" in message and "Change one of: a latent batch at most 3 " in message
    assert len(comfy_env.fake.load_calls) == loads  # nothing loaded, nothing decoded
    part, _ = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": latents[:3]})
    assert torch.equal(part, first[:3])


def test_vae_decode_checks_for_an_interrupt_between_images(comfy_env, loaded):
    """A long batch decode reports its progress per image and stops at ComfyUI's interrupt between two images (here
    after the second), instead of decoding the rest of the batch first; the next decode runs whole."""
    _, vae, _, _ = loaded
    fake = comfy_env.fake
    interrupted = sys.modules["comfy.model_management"].InterruptProcessingException
    fake.progress.clear()
    fake.interrupt_at_step = 2
    try:
        with pytest.raises(interrupted):
            run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": torch.randn(5, 64, 8, 8)})
    finally:
        fake.interrupt_at_step, fake.interrupted = None, False
    assert [value for value, total, _ in fake.progress] == [0, 1, 2]
    image, _ = run(comfy_env, "KVGraphVAEDecode", vae=vae, latent={"samples": torch.randn(5, 64, 8, 8)})
    assert image.shape == (5, 128, 128, 3)


def test_on_the_cpu_cached_models_are_not_counted_as_memory_to_free(comfy_env, loaded, free_memory):
    """On the CPU, ComfyUI unloading a model moves it to its offload device, the CPU: nothing is freed. So another
    model in the pack's cache is not counted as available; a request that would fit only if it were is refused, and
    the refusal says releasing it would help."""
    transformer, _, positive, latent = loaded
    other = run(comfy_env, "KVGraphLoadTransformer", transformer_name=FILES[0], dtype="bf16")[0]  # a second copy
    assert other is not transformer and other.size_bytes > 0
    sample(comfy_env, transformer, positive, latent)
    budget = transformer.last_budget
    assert budget["available_bytes"] is not None
    own = budget["parts"]["transformer weights"] + budget["parts"]["VAE weights"]  # on the CPU already
    free_memory(budget["total_bytes"] - own - (1 << 20))  # 1 MiB short, unless the other copy counted
    from_pack = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.memory.budget")
    with pytest.raises(from_pack.MemoryBudgetError) as info:
        sample(comfy_env, transformer, positive, latent)
    message = str(info.value)
    assert "0.0 GiB of models ComfyUI can unload" in message
    assert "release KV-Graph's other cached models" in message


# -- the model cache's bound ----------------------------------------------------------------------------------------


@pytest.fixture
def cache_env(monkeypatch):
    """A pack copy of its own (evictions here must not disturb the module's shared models)."""
    from comfy_fake.fixtures import close_env, make_env

    env = make_env()
    yield env
    close_env(env)


def test_the_model_cache_evicts_the_least_recently_used_model_over_its_limit(cache_env, monkeypatch, caplog):
    """Each distinct file/dtype/option is a cache entry; over KVGRAPH_MODEL_CACHE_GB (here: room for an fp32 copy and
    one and a half bf16/fp16 copies) the least recently used one is evicted and the eviction logged. An evicted model that something still
    holds comes back on the next load of the same file (no second copy); once nothing holds it, it is read again."""
    import gc

    cache = cache_env.pack.nodes.comfyui.model_cache
    load = lambda dtype: run(cache_env, "KVGraphLoadTransformer", transformer_name=FILES[0], dtype=dtype)[0]  # noqa
    fp32 = load("fp32")
    limit = 1.75 * cache.host_bytes(fp32)
    monkeypatch.setenv("KVGRAPH_MODEL_CACHE_GB", str(limit / 2**30))
    caplog.set_level(logging.INFO, logger="kvgraph")
    bf16 = load("bf16")
    assert load("fp32") is fp32  # used again: now bf16 is the least recently used
    fp16 = load("fp16")
    assert cache.handles() == [fp32, fp16]
    evicted = [r.getMessage() for r in caplog.records if "evicted, least recently used" in r.getMessage()]
    assert len(evicted) == 1 and "transformer" in evicted[0] and "KVGRAPH_MODEL_CACHE_GB" in evicted[0]
    assert sum(cache.host_bytes(h) for h in cache.handles()) <= limit

    again = load("bf16")  # still held (by this test): handed back, not read again; fp32 goes instead
    assert again is bf16 and cache.load_count(bf16.key) == 1
    assert cache.handles() == [fp16, bf16]
    key = fp32.key
    del fp32, again
    gc.collect()
    assert cache.load_count(key) == 1
    reloaded = load("fp32")  # nothing held the evicted one: read from the file again
    assert cache.load_count(key) == 2 and reloaded.module is not None


def test_the_model_cache_honours_comfyui_ram_headroom_but_keeps_what_is_in_use(cache_env, monkeypatch, caplog):
    """Where ComfyUI keeps RAM free (its RAM-pressure cache's headroom) and the host has less available, idle
    cached models are evicted, least recently used first; a model a node is using now is not."""
    cache = cache_env.pack.nodes.comfyui.model_cache
    in_flight = importlib.import_module(f"{cache_env.pack.__name__}.graph_runtime.in_flight")
    memory_module = sys.modules[f"{cache_env.pack.__name__}.nodes.comfyui.model_cache"]
    vae, = run(cache_env, "KVGraphLoadVAE", vae_name=FILES[2], dtype="fp32")
    transformer = run(cache_env, "KVGraphLoadTransformer", transformer_name=FILES[0], dtype="fp32")[0]
    monkeypatch.setattr(memory_module, "ram_headroom", lambda: 10 * 2**30)
    monkeypatch.setattr(memory_module, "host_available_bytes", lambda: 9 * 2**30)
    caplog.set_level(logging.INFO, logger="kvgraph")
    with in_flight.using(vae):
        assert cache.trim() == [transformer]  # 1 GiB short: the idle transformer goes, the VAE in use stays
    assert cache.handles() == [vae]
    message = next(r.getMessage() for r in caplog.records if "evicted" in r.getMessage())
    assert "ComfyUI keeps 10.0 GiB of RAM free and 9.0 GiB is available" in message
    assert cache.trim() == [vae]  # idle now
