"""LoRA files that must not merge silently, or be blamed on the wrong file: a model checkpoint given to the LoRA loader
is "not a LoRA" (saying what it looks like), a text encoder's LoRA is named as such, integer factors are refused as the
model loaders refuse integer weights, and a merge that overflows the weights' dtype names the LoRA file and its
strength, leaving the original weights in place.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

from lora_layouts import write_keys, write_layout  # noqa: E402

from graph_runtime.errors import CheckpointError  # noqa: E402
from graph_runtime.lora import LoraChoice, read_lora  # noqa: E402
from tests.owners import forget, loaded_for  # noqa: E402

Q = "diffusion_model.transformer_blocks.0.attn.to_q"


@pytest.fixture()
def model(tiny_models):
    model = copy.deepcopy(tiny_models.transformer).to(torch.bfloat16).requires_grad_(False)
    yield model
    forget(model)


@pytest.fixture(scope="module")
def comfy_files(tmp_path_factory):
    from graph_runtime.tiny import write_comfyui_files

    return write_comfyui_files(tmp_path_factory.mktemp("models"))


def _refused(path, model) -> str:
    with pytest.raises(CheckpointError) as err:
        read_lora(path, model)
    message = str(err.value)
    assert message.startswith(str(path)), message
    return message


@pytest.mark.parametrize("component, looks_like", [
    ("text_encoder", "a Qwen3-VL text encoder"),
    ("vae", "the Qwen-Image-2.1 VAE"),
    ("transformer", "a Qwen-Image-2.1 transformer"),
])
def test_a_model_checkpoint_is_not_a_lora(model, comfy_files, component, looks_like):
    """A text encoder, VAE or transformer file picked in the LoRA loader is refused as not a LoRA, saying what it
    looks like; never as a LoRA for another model (a text encoder's self_attn keys once read as Wan's)."""
    message = _refused(comfy_files[component], model)
    assert "is not a LoRA" in message and looks_like in message
    assert "LoRA for" not in message and "Wan" not in message


def test_an_unknown_file_without_lora_keys_is_not_a_lora(model, tmp_path):
    keys = {f"encoder.layer{i}.weight": (4, 8) for i in range(5)}
    message = _refused(write_keys(tmp_path / "other.safetensors", keys), model)
    assert "is not a LoRA: none of its 5 tensors is a LoRA factor" in message
    assert "no model checkpoint KV-Graph recognises" in message and "'encoder.layer0.weight'" in message


@pytest.mark.parametrize("keys", [
    {"lora_te_model_layers_0_self_attn_q_proj.lora_down.weight": (4, 64),
     "lora_te_model_layers_0_self_attn_q_proj.lora_up.weight": (64, 4)},
    {"text_encoder.model.layers.0.mlp.gate_proj.lora_A.weight": (4, 64),
     "text_encoder.model.layers.0.mlp.gate_proj.lora_B.weight": (128, 4)},
])
def test_a_text_encoder_lora_is_named_as_such(model, tmp_path, keys):
    message = _refused(write_keys(tmp_path / "te_lora.safetensors", keys), model)
    assert "is a LoRA for a text encoder" in message and "Wan" not in message


def test_a_wan_lora_is_still_named_wan(model, tmp_path):
    keys = {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": (4, 32),
            "diffusion_model.blocks.0.cross_attn.k.lora_down.weight": (4, 32)}
    assert "is a LoRA for Wan" in _refused(write_keys(tmp_path / "wan.safetensors", keys), model)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_integer_factors_are_refused(model, tmp_path, dtype):
    """Integer or boolean factors are a damaged or wrongly converted file (the model loaders refuse integer weights
    alike); an integer alpha, one number, is read."""
    path = tmp_path / "int.safetensors"
    save_file({f"{Q}.lora_up.weight": torch.ones(32, 4, dtype=dtype),
               f"{Q}.lora_down.weight": torch.ones(4, 32), f"{Q}.alpha": torch.tensor(4.0)}, str(path))
    message = _refused(path, model)
    assert "as integers or booleans" in message and f"{Q}.lora_up.weight" in message
    alpha_int = tmp_path / "alpha_int.safetensors"
    save_file({f"{Q}.lora_up.weight": torch.ones(32, 4), f"{Q}.lora_down.weight": torch.ones(4, 32),
               f"{Q}.alpha": torch.tensor(4, dtype=torch.int64)}, str(alpha_int))
    assert read_lora(alpha_int, model).patches


def _big_pair(path, value):
    save_file({f"{Q}.lora_up.weight": torch.full((32, 4), value), f"{Q}.lora_down.weight": torch.full((4, 32), value)},
              str(path))
    return path


@pytest.mark.parametrize("dtype, value, strength", [
    (torch.bfloat16, 1e19, 1.0),  # the fp32 sum itself overflows (4 * 1e38)
    (torch.float16, 100.0, 2.0),  # finite in fp32 (80000), beyond fp16's 65504 once rounded to the weight
])
def test_a_merge_that_overflows_names_the_lora_and_restores_the_weights(tiny_models, tmp_path, dtype, value, strength):
    model = copy.deepcopy(tiny_models.transformer).to(dtype).requires_grad_(False)
    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        lora = read_lora(_big_pair(tmp_path / "loud.safetensors", value), model)
        state = loaded_for(model).lora_state()
        with pytest.raises(CheckpointError) as err:
            state.apply([LoraChoice(lora, strength)])
        message = str(err.value)
        assert message.startswith(str(tmp_path / "loud.safetensors"))
        assert f"loud.safetensors at strength {strength:g}" in message
        assert "transformer_blocks.0.attn.to_q.weight" in message and "infinite or NaN" in message
        assert str(dtype).removeprefix("torch.") in message
        assert state.merged == ()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        # The same LoRA at a strength the weights can hold merges, and the model stays usable.
        good = write_layout(tmp_path / "good.safetensors", "kohya", model, dtype=dtype)
        assert state.apply([LoraChoice(read_lora(tmp_path / "good.safetensors", model), 0.5)]) is True
        assert set(good) and all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        forget(model)


def test_two_loras_overflowing_together_are_both_named(model, tmp_path):
    """Each LoRA alone fits; their sum on one weight overflows: both are named with their strengths."""
    a = read_lora(_big_pair(tmp_path / "a.safetensors", 0.7e19), model)  # 4 * 0.49e38 each, fp32's max 3.4e38
    b = read_lora(_big_pair(tmp_path / "b.safetensors", 0.7e19), model)
    state = loaded_for(model).lora_state()
    for single in (a, b):
        state.apply([LoraChoice(single, 1.0)])
    with pytest.raises(CheckpointError) as err:
        state.apply([LoraChoice(a, 1.0), LoraChoice(b, 1.0)])
    assert "a.safetensors at strength 1" in str(err.value) and "b.safetensors at strength 1" in str(err.value)


def test_nan_latents_during_a_run_with_a_lora_blame_the_lora(tiny_models, tmp_path):
    """A LoRA whose merged weights stay finite but whose changes overflow the model's activations: the sampler's NaN
    check names the LoRA and its strength instead of the transformer's weights."""
    from graph_runtime.errors import NonFiniteError
    from graph_runtime.sampling.sampler import SamplingRequest, sample
    from tests.owners import generator_for

    model = copy.deepcopy(tiny_models.transformer).requires_grad_(False)
    try:
        path = tmp_path / "loud.safetensors"
        # The MLP's gate and up rows ~1e20 each (finite in fp32): their SwiGLU product ~1e40 is not.
        tensors = {}
        for target in ("transformer_blocks.0.img_mlp.gate_layer", "transformer_blocks.0.img_mlp.proj"):
            rows, cols = model.get_parameter(f"{target}.weight").shape
            tensors[f"diffusion_model.{target}.lora_up.weight"] = torch.full((rows, 4), 3e9)
            tensors[f"diffusion_model.{target}.lora_down.weight"] = torch.full((4, cols), 3e9)
        save_file(tensors, str(path))
        lora = read_lora(path, model)
        owner = loaded_for(model)
        embeds = generator_for(copy.copy(tiny_models)).encoder.encode("a red cube")
        request = SamplingRequest(positive=embeds, latent_height=8, latent_width=8, steps=2, decode_mode="eager",
                                  scheduler_config=tiny_models.scheduler_config)
        with pytest.raises(NonFiniteError) as err:
            with owner.loras_in_use([LoraChoice(lora, 1.0)]):
                sample(owner.engine, request)
        assert "loud.safetensors at strength 1" in str(err.value) and "transformer's weights" not in str(err.value)
    finally:
        forget(model)
