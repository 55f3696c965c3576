"""KV-Graph Load LoRA in the pack (CPU, the ComfyUI fake): chaining onto the shared model, the sampler merging each
prompt's set, the status it reports, and files that fail at the LoRA node with their name."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from lora_layouts import write_keys, write_layout  # noqa: E402
from test_nodes_execute import encode, load_all, run, sampler  # noqa: E402


@pytest.fixture(scope="module")
def setup(comfy_env):
    transformer, text_encoder, _ = load_all(comfy_env)
    positive, _, latent = encode(comfy_env, text_encoder, width=64, height=64)
    loras = comfy_env.models / "loras"
    loras.mkdir(exist_ok=True)
    write_layout(loras / "kvgraph_test_style.safetensors", "kohya", transformer.module, seed=5)
    write_layout(loras / "kvgraph_test_detail.safetensors", "peft", transformer.module, seed=6)
    return transformer, positive, latent


def with_lora(env, model, name="kvgraph_test_style.safetensors", strength=1.0):
    return run(env, "KVGraphLoadLoRA", model=model, lora_name=name, strength=strength)[0]


def samples(env, model, positive, latent):
    return sampler(env, model, positive, latent, steps=2)["samples"]


def transformer_status(env, handle) -> dict:
    status = env.pack.nodes.comfyui.model_cache.status_payload()
    return next(m for m in status["models"] if m["source"] == handle.source and m["dtype"] == handle.dtype_name)


def test_schema(comfy_env):
    s = comfy_env.nodes["KVGraphLoadLoRA"].define_schema()
    inputs = {i.id: i for i in s.inputs}
    assert list(inputs) == ["model", "lora_name", "strength"] and s.category == "KV-Graph/loaders"
    # The model socket takes a KV-Graph transformer or a MODEL and hands on the kind it was given.
    template = inputs["model"].template
    assert inputs["model"].io_type == "COMFY_MATCHTYPE_V3" and s.outputs[0].template is template
    assert [t.io_type for t in template.allowed_types] == ["KVGRAPH_TRANSFORMER", "MODEL"]
    assert inputs["strength"].default == 1.0 and inputs["strength"].min < 0 < inputs["strength"].max
    assert all(o.tooltip for o in s.outputs)
    assert all(name.endswith(".safetensors") for name in inputs["lora_name"].options)


def test_chaining_extends_the_list_on_the_same_loaded_model(comfy_env, setup):
    transformer = setup[0]
    one = with_lora(comfy_env, transformer)
    two = with_lora(comfy_env, one, "kvgraph_test_detail.safetensors", -0.5)
    assert one.module is two.module is transformer.module and one.engine is transformer.engine
    assert transformer.loras == () and [c.lora.name for c in one.loras] == ["kvgraph_test_style.safetensors"]
    assert [(c.lora.name, c.strength) for c in two.loras] == [("kvgraph_test_style.safetensors", 1.0),
                                                               ("kvgraph_test_detail.safetensors", -0.5)]
    assert two.base is one.base is transformer
    # The cache holds models, not chains.
    assert comfy_env.pack.nodes.comfyui.model_cache.handles().count(transformer) == 1


def test_each_prompt_merges_its_own_set_without_reloading(comfy_env, setup):
    """Prompts with different LoRA sets over one loaded model: each output is its set's (the same set gives the
    same output, strength 0 and no LoRA give the plain model's), the file is loaded once, and the status shows
    what is merged."""
    transformer, positive, latent = setup
    cache = comfy_env.pack.nodes.comfyui.model_cache
    plain = samples(comfy_env, transformer, positive, latent)
    full = samples(comfy_env, with_lora(comfy_env, transformer), positive, latent)
    assert not torch.allclose(full, plain, atol=1e-3)
    status = transformer_status(comfy_env, transformer)
    assert [(item["name"], item["strength"]) for item in status["lora"]["loras"]] == [
        ("kvgraph_test_style.safetensors", 1.0)]
    merges = status["lora"]["merges"]
    half = samples(comfy_env, with_lora(comfy_env, transformer, strength=0.5), positive, latent)
    assert not torch.allclose(half, full, atol=1e-3)
    status = transformer_status(comfy_env, transformer)
    assert status["lora"]["loras"][0]["strength"] == 0.5 and status["lora"]["merges"] == merges + 1
    assert cache.load_count(transformer.key) == 1 and status["loads"] == 1
    assert torch.equal(samples(comfy_env, with_lora(comfy_env, transformer), positive, latent), full)
    assert torch.equal(samples(comfy_env, transformer, positive, latent), plain)
    assert torch.equal(samples(comfy_env, with_lora(comfy_env, transformer, strength=0.0), positive, latent), plain)
    report = comfy_env.pack.nodes.comfyui.model_cache.status_report()
    assert "LoRAs merged" not in report  # the last prompt had none
    samples(comfy_env, with_lora(comfy_env, transformer, strength=0.5), positive, latent)
    report = comfy_env.pack.nodes.comfyui.model_cache.status_report()
    assert "LoRAs merged: kvgraph_test_style.safetensors (0.5)" in report
    loaded = next(item for item in comfy_env.pack.nodes.comfyui.model_cache.status_payload()["loaded"]
                  if item["kind"] == "transformer" and item["source"] == transformer.source
                  and item["dtype"] == transformer.dtype_name)
    assert [item["strength"] for item in loaded["loras"]] == [0.5]

    # A fresh load of the same file, merged with the same strength, gives the same output: restores were exact.
    cache.forget_all("test")
    fresh, _, _ = load_all(comfy_env)
    assert fresh is not transformer and cache.load_count(fresh.key) == 2
    assert torch.equal(samples(comfy_env, with_lora(comfy_env, fresh, strength=0.5), positive, latent), half)


def test_missing_and_foreign_files_fail_at_the_lora_node(comfy_env, setup):
    from_pack = importlib.import_module(f"{comfy_env.pack.__name__}.graph_runtime.errors")
    transformer = setup[0]
    with pytest.raises(from_pack.CheckpointError) as err:
        with_lora(comfy_env, transformer, "kvgraph_missing.safetensors")
    assert "kvgraph_missing.safetensors" in str(err.value) and "lora_name" in str(err.value)
    foreign = write_keys(comfy_env.models / "loras" / "kvgraph_flux.safetensors",
                         {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": (4, 32)})
    with pytest.raises(from_pack.CheckpointError) as err:
        with_lora(comfy_env, transformer, foreign.name)
    assert str(foreign) in str(err.value) and "FLUX" in str(err.value)
    with pytest.raises(from_pack.InputError, match="strength"):
        with_lora(comfy_env, transformer, strength=float("nan"))


def test_fingerprint_follows_the_file(comfy_env, setup):
    node, transformer = comfy_env.nodes["KVGraphLoadLoRA"], setup[0]
    path = comfy_env.models / "loras" / "kvgraph_test_changing.safetensors"
    write_layout(path, "kohya", transformer.module, seed=1)
    first = node.fingerprint_inputs(model=transformer, lora_name=path.name, strength=1.0)
    assert first == node.fingerprint_inputs(model=transformer, lora_name=path.name, strength=1.0)
    assert first != node.fingerprint_inputs(model=transformer, lora_name=path.name, strength=0.9)
    write_layout(path, "kohya", transformer.module, seed=2, dtype=torch.bfloat16)
    assert first != node.fingerprint_inputs(model=transformer, lora_name=path.name, strength=1.0)
    assert node.fingerprint_inputs(model=transformer, lora_name="missing.safetensors", strength=1.0)
