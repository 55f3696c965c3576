"""Core ComfyUI's LoRA loaders on the pack's MODEL (CPU, the ComfyUI fake): what core's `load_lora_for_models` hands
the MODEL's `add_patches` joins its LoRA chain and is merged in place by the run, as KV-Graph Load LoRA's file is.

`core_loader` below is what core's LoraLoaderModelOnly does with a file: its key map for a generic model
(`diffusion_model.<weight name>` -> that weight), one LoRA adapter per matched key (up, down, alpha), then
`add_patches(patches, strength)` on a clone. A real ComfyUI's loader runs in tests/test_core_sampling_comfyui.py.

Tolerances: one LoRA through either loader becomes the same fp32 deltas merged by the same code, so the outputs are
equal bit for bit; a stack sums the same deltas in another order (the chain is merged in a canonical order), so
float32 round-off of the merged weights: 2e-5 on raw latents of magnitude ~5 (as tests/test_nodes_core_model.py).
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from lora_layouts import write_layout  # noqa: E402
from test_nodes_core_model import ATOL, core_sample, sigmas_node  # noqa: E402
from test_nodes_execute import encode, load_all, run  # noqa: E402

STYLE, DETAIL = "kvgraph_core_lora_style.safetensors", "kvgraph_core_lora_detail.safetensors"


@pytest.fixture(scope="module")
def setup(comfy_env):
    transformer, text_encoder, _ = load_all(comfy_env)
    positive, _, latent = encode(comfy_env, text_encoder)
    loras = comfy_env.models / "loras"
    loras.mkdir(exist_ok=True)
    write_layout(loras / STYLE, "kohya", transformer.module, seed=5)
    write_layout(loras / DETAIL, "kohya", transformer.module, seed=6)
    return transformer, transformer.model, positive, latent


def pack_module(env, name):
    return importlib.import_module(f"{env.pack.__name__}.{name}")


def core_patches(env, name, lora_keys=None):
    """What core's `load_lora` makes of a kohya file on this MODEL: {weight key: LoRAAdapter}."""
    import comfy.weight_adapter as adapters

    tensors = load_file(str(env.models / "loras" / name))
    patches = {}
    for key in tensors:
        if key.endswith(".lora_up.weight"):
            stem = key[: -len(".lora_up.weight")]
            alpha = tensors.get(f"{stem}.alpha")
            weights = (tensors[key], tensors[f"{stem}.lora_down.weight"], None if alpha is None else alpha.item(),
                       None, None, None)
            patches[f"{stem}.weight"] = adapters.LoRAAdapter(set(), weights)
    return patches


def core_loader(env, model, name, strength):
    clone = model.clone()
    taken = clone.add_patches(core_patches(env, name), strength)
    return clone, taken


def weights(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_core_lora_loader_equals_kvgraph_load_lora(comfy_env, setup):
    """LoraLoaderModelOnly's patches at strength 0.7 join a clone's chain (every key taken, the loader's MODEL and
    ComfyUI's own `patches` untouched) and sample exactly what KV-Graph Load LoRA at 0.7 samples; the next run without
    it restores every weight bit for bit."""
    handle, model, positive, latent = setup
    before = weights(handle.module)
    core_model = pack_module(comfy_env, "nodes.comfyui.core_model")
    lora_model, taken = core_loader(comfy_env, model, STYLE, 0.7)
    assert len(taken) == len(core_patches(comfy_env, STYLE)) and lora_model.patches == {} and model.patches == {}
    assert len(lora_model.attachments[core_model.LORAS]) == 1 and core_model.LORAS not in model.attachments
    kv_model, = run(comfy_env, "KVGraphLoadLoRA", model=model, lora_name=STYLE, strength=0.7)
    sigmas = sigmas_node(comfy_env, model, latent)
    core = core_sample(comfy_env, lora_model, positive, latent, sigmas, seed=3)
    ours = core_sample(comfy_env, kv_model, positive, latent, sigmas, seed=3)
    plain = core_sample(comfy_env, model, positive, latent, sigmas, seed=3)
    assert torch.equal(core, ours) and (core - plain).abs().max() > 1e-3
    after = weights(handle.module)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_a_stack_of_core_and_kvgraph_loaders_equals_the_kvgraph_chain(comfy_env, setup):
    """Core loader -> KV-Graph Load LoRA -> core loader (negative strength) on one MODEL: the three LoRAs merged
    together, as the same chain of KV-Graph Load LoRA nodes merges them (float32 round-off of the summed deltas)."""
    _, model, positive, latent = setup
    first, _ = core_loader(comfy_env, model, STYLE, 1.0)
    second, = run(comfy_env, "KVGraphLoadLoRA", model=first, lora_name=DETAIL, strength=0.5)
    stack, _ = core_loader(comfy_env, second, DETAIL, -0.25)
    chain, = run(comfy_env, "KVGraphLoadLoRA", model=model, lora_name=STYLE, strength=1.0)
    chain, = run(comfy_env, "KVGraphLoadLoRA", model=chain, lora_name=DETAIL, strength=0.5)
    chain, = run(comfy_env, "KVGraphLoadLoRA", model=chain, lora_name=DETAIL, strength=-0.25)
    sigmas = sigmas_node(comfy_env, model, latent)
    a = core_sample(comfy_env, stack, positive, latent, sigmas, seed=4)
    b = core_sample(comfy_env, chain, positive, latent, sigmas, seed=4)
    single = core_sample(comfy_env, first, positive, latent, sigmas, seed=4)
    assert (a - b).abs().max() <= ATOL and (a - single).abs().max() > 1e-3


def test_the_same_core_lora_again_merges_nothing(comfy_env, setup):
    """Core's loader keeps the file it read, so a second prompt hands over the same tensors: the same LoRA, already
    merged, so the run changes no weight (and its graphs keep replaying)."""
    handle, model, positive, latent = setup
    patches = core_patches(comfy_env, STYLE)
    sigmas = sigmas_node(comfy_env, model, latent)
    one = model.clone()
    one.add_patches(patches, 1.0)
    core_sample(comfy_env, one, positive, latent, sigmas, seed=5)
    merges = handle.loaded.merged_loras()["merges"]
    two = model.clone()
    two.add_patches(patches, 1.0)
    core_sample(comfy_env, two, positive, latent, sigmas, seed=5)
    assert handle.loaded.merged_loras()["merges"] == merges
    assert handle.loaded.merged_loras()["loras"][0]["name"] == "a LoRA from core's LoRA loader"


def test_what_cannot_merge_in_place_is_refused_by_name(comfy_env, setup):
    """Adapters other than LoRA pairs, DoRA, model merging (which scales the weights), a LoRA none of whose keys
    matched, and a fused-MLP LoRA core could map only in part: each refused when the loader runs, saying what it is
    and naming KV-Graph Load LoRA where that one reads the file; nothing joins the chain."""
    import comfy.weight_adapter as adapters

    _, model, *_ = setup
    errors = pack_module(comfy_env, "graph_runtime.errors")
    core_model = pack_module(comfy_env, "nodes.comfyui.core_model")
    good = core_patches(comfy_env, STYLE)
    key, pair = next(iter(good.items()))
    dora = adapters.LoRAAdapter(set(), (*pair.weights[:4], torch.ones(pair.weights[0].shape[0]), None))
    out_only = {k: v for k, v in good.items() if ".img_mlp.gate_layer." not in k and ".img_mlp.proj." not in k}
    cases = [
        ({key: adapters.LoHaAdapter(set(), ())}, 1.0, "a loha adapter"),
        ({key: dora}, 1.0, "DoRA"),
        ({key: ("set", (torch.zeros(1),))}, 1.0, "weight replacement"),
        ({key: [(torch.zeros(1), None)]}, 1.0, "model merging"),
        (good, 0.5, "model merging"),
        ({"diffusion_model.not_a_layer.weight": pair}, 1.0, "matched none"),
        (out_only, 1.0, "fused `img_mlp.gate_up`"),
    ]
    for patches, strength_model, message in cases:
        clone = model.clone()
        with pytest.raises(errors.KVGraphError, match=message):
            clone.add_patches(patches, 1.0, strength_model)
        assert core_model.LORAS not in clone.attachments
    with pytest.raises(errors.KVGraphError, match="Create Hook LoRA"):
        model.clone().add_hook_patches(None, {}, 1.0)
    with pytest.raises(errors.KVGraphError, match="Bypass"):
        model.clone().set_injections("bypass_lora", [])


def test_a_lora_that_does_not_fit_the_weights_is_refused(comfy_env, setup):
    """Factors of another model's size, or NaN values: refused naming the weight, before anything merges."""
    import comfy.weight_adapter as adapters

    _, model, *_ = setup
    errors = pack_module(comfy_env, "graph_runtime.errors")
    key, pair = next(iter(core_patches(comfy_env, STYLE).items()))
    up, down = pair.weights[:2]
    wide = adapters.LoRAAdapter(set(), (up, torch.zeros(down.shape[0], down.shape[1] + 1), None, None, None, None))
    nan = adapters.LoRAAdapter(set(), (up * float("nan"), down, None, None, None, None))
    for adapter, message in ((wide, "another size"), (nan, "NaN")):
        with pytest.raises(errors.CheckpointError, match=message):
            model.clone().add_patches({key: adapter}, 1.0)
