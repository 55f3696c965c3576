"""LoRA files: every key layout merges to the reference weights, and files that do not fit are refused clearly.

The tiny transformer is bf16 here, so "rounded once" is visible: the reference is the fp32 sum rounded to bf16 once,
and equality is exact (the merge and the reference do the same fp32 operations on the same values).
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from lora_layouts import LAYOUTS, reference_weights, write_keys, write_layout  # noqa: E402

from graph_runtime.errors import CheckpointError  # noqa: E402
from graph_runtime.lora import LoraChoice, read_lora  # noqa: E402
from tests.owners import loaded_for  # noqa: E402
from graph_runtime.lora.weights import PlainWeight, QuantizedWeight, weight_slot  # noqa: E402


@pytest.fixture()
def model(tiny_models):
    return copy.deepcopy(tiny_models.transformer).to(torch.bfloat16).requires_grad_(False)


def _snapshot(model):
    return {name: (p.detach().clone(), p.data_ptr()) for name, p in model.named_parameters()}


def _assert_weights(model, before, changed: dict):
    """Changed weights equal `changed` exactly, the rest equal `before` bit for bit; no weight moved."""
    for name, p in model.named_parameters():
        original, address = before[name]
        assert p.data_ptr() == address, f"{name} moved"
        if name in changed:
            assert torch.equal(p, changed[name]), f"{name} differs from the reference merge"
        else:
            assert torch.equal(p, original), f"{name} changed but the LoRA does not touch it"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_merges_to_the_reference_weights(model, tmp_path, layout):
    expected = write_layout(tmp_path / f"{layout}.safetensors", layout, model, dtype=torch.bfloat16)
    lora = read_lora(tmp_path / f"{layout}.safetensors", model)
    assert set(lora.patches) == set(expected)
    before = _snapshot(model)
    reference = reference_weights(model, [(0.7, expected)])
    assert loaded_for(model).lora_state().apply([LoraChoice(lora, 0.7)]) is True
    _assert_weights(model, before, reference)
    if layout == "diff":
        assert any("diff_b" in note for note in lora.notes)  # the zero bias difference is reported, not merged


def test_the_sum_is_rounded_once(model, tmp_path):
    """The merged bf16 weight is the fp32 sum rounded once, which differs from adding a bf16-rounded delta."""
    expected = write_layout(tmp_path / "k.safetensors", "kohya", model, dtype=torch.bfloat16)
    name = "transformer_blocks.0.img_mlp.out.weight"
    original = model.get_parameter(name).detach().clone()
    loaded_for(model).lora_state().apply([LoraChoice(read_lora(tmp_path / "k.safetensors", model), 1.0)])
    (_, up, down, scale), = expected[name]
    twice = original + (scale * (up.float() @ down.float())).to(torch.bfloat16)
    assert not torch.equal(model.get_parameter(name), twice)


def test_strength_zero_and_unload_restore_the_original_bits(model, tmp_path):
    write_layout(tmp_path / "k.safetensors", "kohya", model, dtype=torch.bfloat16)
    lora = read_lora(tmp_path / "k.safetensors", model)
    before = _snapshot(model)
    state = loaded_for(model).lora_state()
    assert state.apply([LoraChoice(lora, 0.0)]) is False  # strength 0 is no LoRA: nothing to do
    _assert_weights(model, before, {})
    assert state.apply([LoraChoice(lora, 1.0)]) is True
    assert state.apply([LoraChoice(lora, 1.0)]) is False  # the same set again does nothing
    assert state.originals_bytes() > 0
    assert state.apply([]) is True  # unload: copy the originals back
    _assert_weights(model, before, {})
    assert state.describe()["loras"] == [] and state.originals_bytes() == 0  # host copies freed


def test_negative_strength_and_two_loras_on_one_weight(model, tmp_path):
    a = write_layout(tmp_path / "a.safetensors", "kohya", model, seed=1, dtype=torch.bfloat16)
    b = write_layout(tmp_path / "b.safetensors", "peft", model, seed=2, dtype=torch.bfloat16)
    choices = [LoraChoice(read_lora(tmp_path / "a.safetensors", model), -0.5),
               LoraChoice(read_lora(tmp_path / "b.safetensors", model), 1.25)]
    reference = reference_weights(model, [(-0.5, a), (1.25, b)])
    loaded_for(model).lora_state().apply(choices)
    for name, want in reference.items():
        # Two deltas on one weight are summed in the merge's own order: fp32 round-off (~1e-7 relative) can move a
        # bf16 rounding by one step (2**-8 relative) on a few elements.
        torch.testing.assert_close(model.get_parameter(name), want, rtol=2**-7, atol=1e-6)
    assert loaded_for(model).lora_state().apply(list(reversed(choices))) is False  # the chain's order is not part of the set


def test_a_quantized_module_merges_by_dequantize_add_requantize(tmp_path):
    """A module with the INT8 protocol (`dequantized_weight`, `requantize_`) is merged through it, in its own
    storage, and restored to its original quantized tensors exactly. A toy row-wise int8 Linear stands in."""

    class ToyInt8Linear(torch.nn.Linear):
        def __init__(self, weight):
            super().__init__(weight.shape[1], weight.shape[0], bias=False)
            self.weight = torch.nn.Parameter(torch.zeros(weight.shape, dtype=torch.int8), requires_grad=False)
            self.register_buffer("weight_scale", torch.zeros(weight.shape[0], 1))
            self.requantize_(weight)

        def dequantized_weight(self, dtype=torch.float32):
            return self.weight.to(dtype) * self.weight_scale.to(dtype)

        def requantize_(self, weight):
            scale = weight.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
            self.weight_scale.copy_(scale)
            self.weight.copy_((weight / scale).round().clamp(-127, 127).to(torch.int8))

    holder = torch.nn.Module()
    holder.proj = ToyInt8Linear(torch.randn(8, 6))
    slot = weight_slot(holder, "proj.weight")
    assert isinstance(slot, QuantizedWeight) and isinstance(weight_slot(holder, "proj.weight_scale"), PlainWeight)
    weight, scale = holder.proj.weight.clone(), holder.proj.weight_scale.clone()
    addresses = holder.proj.weight.data_ptr(), holder.proj.weight_scale.data_ptr()
    delta = torch.randn(8, 6) * 0.3
    expected = ToyInt8Linear(holder.proj.dequantized_weight() + delta)
    slot.merge(delta.clone())
    assert torch.equal(holder.proj.weight, expected.weight)
    assert torch.equal(holder.proj.weight_scale, expected.weight_scale)
    slot.merge(delta.clone())  # merging again starts from the original, not from the last re-quantization
    assert torch.equal(holder.proj.weight, expected.weight)
    slot.restore()
    assert torch.equal(holder.proj.weight, weight) and torch.equal(holder.proj.weight_scale, scale)
    assert (holder.proj.weight.data_ptr(), holder.proj.weight_scale.data_ptr()) == addresses
    slot.merge(delta.clone())
    holder.proj._buffers["weight_scale"] = holder.proj.weight_scale.clone()  # what moving the module to a device does
    slot.restore()
    assert torch.equal(holder.proj.weight, weight) and torch.equal(holder.proj.weight_scale, scale)


def test_weights_replaced_by_a_device_move_are_found_again(model, tmp_path):
    """Moving a module between devices may give it new parameter tensors: a restore writes into the weight the
    module holds now, not into the one it held when it was merged."""
    write_layout(tmp_path / "k.safetensors", "kohya", model, dtype=torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = loaded_for(model).lora_state()
    state.apply([LoraChoice(read_lora(tmp_path / "k.safetensors", model), 1.0)])
    attn = model.transformer_blocks[0].attn.to_q
    attn._parameters["weight"] = torch.nn.Parameter(attn.weight.detach().clone(), requires_grad=False)
    state.apply([])
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_forget_after_the_weights_were_reloaded(model, tmp_path):
    """When the weights were put back to the file's values by a reload, `forget` clears the merged set, and the
    next merge starts from the reloaded weights instead of adding the LoRA twice."""
    expected = write_layout(tmp_path / "k.safetensors", "kohya", model, dtype=torch.bfloat16)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = reference_weights(model, [(1.0, expected)])
    choice = [LoraChoice(read_lora(tmp_path / "k.safetensors", model), 1.0)]
    state = loaded_for(model).lora_state()
    state.apply(choice)
    model.load_state_dict(original)  # a reload from the file
    state.forget()
    assert state.merged == () and state.originals_bytes() == 0
    assert state.apply(choice) is True
    assert all(torch.equal(model.get_parameter(name), want) for name, want in reference.items())


def _refused(path, model) -> str:
    with pytest.raises(CheckpointError) as err:
        read_lora(path, model)
    message = str(err.value)
    assert message.startswith(str(path)), message  # the file comes first, as every CheckpointError
    return message


def test_a_partly_matching_file_lists_the_first_unmatched_keys(model, tmp_path):
    keys = {"diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight": (4, 32),
            "diffusion_model.transformer_blocks.0.attn.to_q.lora_up.weight": (32, 4),
            "diffusion_model.transformer_blocks.7.attn.to_q.lora_down.weight": (4, 32),  # the model has 2 blocks
            "diffusion_model.transformer_blocks.7.attn.to_q.lora_up.weight": (32, 4),
            "diffusion_model.transformer_blocks.0.attn.to_gate.lora_down.weight": (4, 32)}
    message = _refused(write_keys(tmp_path / "partial.safetensors", keys), model)
    assert "3 of its 5 keys match no layer" in message and "(2 blocks)" in message
    assert "'diffusion_model.transformer_blocks.7.attn.to_q.lora_down.weight'" in message
    assert "'diffusion_model.transformer_blocks.0.attn.to_gate.lora_down.weight'" in message


def test_a_file_where_nothing_matches_says_so(model, tmp_path):
    keys = {f"encoder.layer{i}.lora_down.weight": (4, 8) for i in range(12)}
    message = _refused(write_keys(tmp_path / "other.safetensors", keys), model)
    assert "none of its keys match a layer" in message and "and 4 more" in message


@pytest.mark.parametrize("family, keys", [
    ("Qwen-Image 1.x", {"transformer_blocks.0.attn.to_q.lora_down.weight": (4, 32),
                        "transformer_blocks.0.attn.to_q.lora_up.weight": (32, 4),
                        "transformer_blocks.0.attn.add_q_proj.lora_down.weight": (4, 32),
                        "transformer_blocks.0.img_mod.1.lora_down.weight": (4, 32),
                        "transformer_blocks.0.txt_mlp.net.0.proj.lora_down.weight": (4, 32)}),
    ("Qwen-Image 1.x", {"lora_unet_transformer_blocks_0_txt_mod_1.lora_down.weight": (4, 32)}),
    ("FLUX", {"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": (4, 32),
              "transformer.transformer_blocks.0.ff_context.net.0.proj.lora_A.weight": (4, 32)}),
    ("FLUX", {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": (4, 32)}),
    ("Stable Diffusion 1.x / SDXL", {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": (4, 32),
                                     "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": (4, 32)}),
])
def test_a_lora_for_another_model_is_refused_as_such(model, tmp_path, family, keys):
    message = _refused(write_keys(tmp_path / "foreign.safetensors", keys), model)
    assert f"is a LoRA for {family}" in message and "not for Qwen-Image-2.1" in message


@pytest.mark.parametrize("keys, words", [
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": (4, 48),  # in_features 48, not 32
      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": (32, 4)}, "another size"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": (4, 32)}, "without its up matrix"),
    ({"transformer_blocks.0.attn.to_q.lora_A.weight": (4, 32), "transformer_blocks.0.attn.to_q.lora_B.weight": (32, 4),
      "transformer_blocks.0.attn.to_q.lora_magnitude_vector": (32,)}, "DoRA"),
    ({"lycoris_transformer_blocks_0_attn_to_q.lokr_w1": (4, 4)}, "LyCORIS LoKr"),
    ({"diffusion_model.transformer_blocks.0.attn.to_q.diff": (32, 32),
      "diffusion_model.transformer_blocks.0.attn.to_q.diff_b": (32,)}, "no biases"),
    ({"diffusion_model.transformer_blocks.0.img_mlp.gate_up.diff": (96, 32)}, "another size"),  # 2 x 96 rows
    ({"diffusion_model.transformer_blocks.0.attn.to_q.alpha": ()}, "no LoRA weights"),
])
def test_malformed_files_name_the_key_and_the_problem(model, tmp_path, keys, words):
    assert words in _refused(write_keys(tmp_path / "bad.safetensors", keys), model)


Q = "diffusion_model.transformer_blocks.0.attn.to_q"


def _kohya_pair(rank=4, alpha=torch.tensor(2.0), up=None, down=None, rows=32, cols=32):
    generator = torch.Generator().manual_seed(3)
    tensors = {f"{Q}.lora_up.weight": torch.randn(rows, rank, generator=generator) if up is None else up,
               f"{Q}.lora_down.weight": torch.randn(rank, cols, generator=generator) if down is None else down}
    if alpha is not None:
        tensors[f"{Q}.alpha"] = alpha
    return tensors


def _peft_pair(config):
    import json

    generator = torch.Generator().manual_seed(4)
    return ({"transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(32, 4, generator=generator),
             "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 32, generator=generator)},
            {"lora_adapter_metadata": json.dumps(config)})


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("case, words", [
    ("alpha of shape [2]", f"'{Q}.alpha' has shape [2], where an alpha is one number"),
    ("rank 0 with alpha", f"'{Q}.lora_down.weight' is a rank-0 factor"),
    ("rank 0 without alpha", f"'{Q}.lora_down.weight' is a rank-0 factor"),
    ("peft lora_alpha 'abc'", "lora_alpha='abc' in its lora_adapter_metadata metadata, which must be a finite number"),
    ("peft alpha_pattern list", "alpha_pattern=['attn.to_q'] in its lora_adapter_metadata metadata, which must be an "
                                "object"),
    ("peft alpha_pattern value", "alpha_pattern['attn.to_q']='2' in its lora_adapter_metadata metadata, which must "
                                 "be a finite number"),
    ("nan alpha", f"NaN or infinite values in '{Q}.alpha'"),
    ("inf up", f"NaN or infinite values in '{Q}.lora_up.weight'"),
    ("nan down", f"NaN or infinite values in '{Q}.lora_down.weight'"),
    ("nan diff", f"NaN or infinite values in '{Q}.diff'"),
])
def test_bad_alphas_ranks_and_non_finite_values_are_refused_when_read(model, tmp_path, case, words):
    """Before: RuntimeError (an alpha of two numbers), ZeroDivisionError (rank 0 with alpha), ValueError ('abc'),
    AttributeError (a pattern list) from inside the reader, and NaN/inf passed the node, so the sampler blamed the
    transformer's weights. Each is refused when the file is read, naming the file and the key."""
    from safetensors.torch import save_file

    metadata = None
    tensors = {
        "alpha of shape [2]": lambda: _kohya_pair(alpha=torch.tensor([2.0, 3.0])),
        "rank 0 with alpha": lambda: _kohya_pair(rank=0),
        "rank 0 without alpha": lambda: _kohya_pair(rank=0, alpha=None),
        "nan alpha": lambda: _kohya_pair(alpha=torch.tensor(NAN)),
        "inf up": lambda: _kohya_pair(up=torch.full((32, 4), INF)),
        "nan down": lambda: _kohya_pair(down=torch.full((4, 32), NAN).to(torch.bfloat16)),
        "nan diff": lambda: {f"{Q}.diff": torch.full((32, 32), NAN)},
    }.get(case)
    if tensors is not None:
        tensors = tensors()
    else:
        config = {"peft lora_alpha 'abc'": {"lora_alpha": "abc", "r": 4},
                  "peft alpha_pattern list": {"lora_alpha": 8, "alpha_pattern": ["attn.to_q"]},
                  "peft alpha_pattern value": {"lora_alpha": 8, "alpha_pattern": {"attn.to_q": "2"}}}[case]
        tensors, metadata = _peft_pair(config)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    assert words in _refused(path, model)


def test_files_other_than_safetensors_are_refused(model, tmp_path):
    pickled = tmp_path / "lora.ckpt"
    torch.save({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32)}, pickled)
    assert "not a safetensors file" in _refused(pickled, model)
    truncated = tmp_path / "cut.safetensors"
    write_layout(truncated, "kohya", model)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    assert "truncated" in _refused(truncated, model)


@pytest.mark.parametrize("raw", ["{not json", "[" * 100_000 + "]" * 100_000])
def test_unreadable_peft_metadata_is_refused(model, tmp_path, raw):
    from safetensors.torch import save_file

    path = tmp_path / "meta.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 4)}, str(path),
              metadata={"lora_adapter_metadata": raw})
    assert "lora_adapter_metadata metadata that is not valid JSON" in _refused(path, model)


def test_a_refused_file_leaves_the_model_and_the_next_lora_working(model, tmp_path):
    before = _snapshot(model)
    _refused(write_keys(tmp_path / "bad.safetensors", {"foo.lora_A.weight": (4, 4)}), model)
    _assert_weights(model, before, {})
    expected = write_layout(tmp_path / "good.safetensors", "peft", model, dtype=torch.bfloat16)
    reference = reference_weights(model, [(1.0, expected)])
    loaded_for(model).lora_state().apply([LoraChoice(read_lora(tmp_path / "good.safetensors", model), 1.0)])
    _assert_weights(model, before, reference)


def test_weights_loaded_under_inference_mode_merge_and_restore(tiny_models, tmp_path):
    """ComfyUI runs loaders under torch.inference_mode(), so the weights are inference tensors, which may only be
    written inside inference mode; the merge writes each weight in the mode it was made in."""
    with torch.inference_mode():
        model = copy.deepcopy(tiny_models.transformer).to(torch.bfloat16)
        model.load_state_dict(tiny_models.transformer.state_dict())
    assert model.transformer_blocks[0].attn.to_q.weight.is_inference()
    expected = write_layout(tmp_path / "k.safetensors", "kohya", model, dtype=torch.bfloat16)
    before = _snapshot(model)
    reference = reference_weights(model, [(1.0, expected)])
    state = loaded_for(model).lora_state()
    state.apply([LoraChoice(read_lora(tmp_path / "k.safetensors", model), 1.0)])
    _assert_weights(model, before, reference)
    state.apply([])
    _assert_weights(model, before, {})
