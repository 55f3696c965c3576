"""LoRA on INT8 ConvRot weights: merged by dequantize -> add -> re-quantize into the layer's own storage.

Why re-quantize rather than dequantize the model: the int8 mode is for cards where bf16 weights do not fit, so a
merge must keep the weights int8. The merged layer carries one int8 rounding of the merged weight (the same rounding
the file's own quantization applied to the original); restoring copies the file's int8 tensors back, so no LoRA
leaves the weights exactly as loaded. Equality below is exact: the merge and the reference run the same fp32
dequantization, the same fp32 sum and comfy-kitchen's same quantizer on the same values.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from lora_layouts import write_layout  # noqa: E402

from graph_runtime.loading import load_transformer  # noqa: E402
from graph_runtime.lora import LoraChoice, read_lora  # noqa: E402
from tests.owners import loaded_for  # noqa: E402
from graph_runtime.quantized.int8_convrot import ConvRotInt8Linear, dequantize_weight, quantize_weight  # noqa: E402
from graph_runtime.tiny import write_comfyui_int8_files  # noqa: E402


@pytest.fixture(scope="module")
def int8_file(tmp_path_factory, tiny_parts):
    return write_comfyui_int8_files(tmp_path_factory.mktemp("int8-models"), parts=tiny_parts)["transformer"]


@pytest.fixture()
def int8_model(int8_file):
    model = load_transformer(int8_file, dtype=torch.float32, quantized="int8")
    assert any(isinstance(m, ConvRotInt8Linear) for m in model.modules())
    return model


def _int8_tensors(model):
    return {name: (m.weight.detach().clone(), m.weight_scale.detach().clone(), m.weight.data_ptr(),
                   m.weight_scale.data_ptr())
            for name, m in model.named_modules() if isinstance(m, ConvRotInt8Linear)}


def _reference(module_before, patches, strength):
    """The merged layer by the test's own math: dequantize the file's int8 weight, add each low-rank delta, quantize
    again with comfy-kitchen."""
    q, scale, group = module_before
    weight = dequantize_weight(q, scale, group)
    for _, up, down, lora_scale in patches:
        weight = weight + torch.mm(up.float(), down.float()).mul_(strength * lora_scale)
    return quantize_weight(weight, group)


def test_int8_layers_merge_in_their_own_storage_and_restore_exactly(int8_model, tmp_path):
    expected = write_layout(tmp_path / "k.safetensors", "kohya", int8_model)
    lora = read_lora(tmp_path / "k.safetensors", int8_model)
    before = _int8_tensors(int8_model)
    groups = {name: m.group_size for name, m in int8_model.named_modules() if isinstance(m, ConvRotInt8Linear)}
    state = loaded_for(int8_model).lora_state()
    assert state.apply([LoraChoice(lora, 0.8)]) is True
    touched = 0
    for name, module in int8_model.named_modules():
        if not isinstance(module, ConvRotInt8Linear):
            continue
        q0, s0, weight_ptr, scale_ptr = before[name]
        assert (module.weight.data_ptr(), module.weight_scale.data_ptr()) == (weight_ptr, scale_ptr), name
        patches = expected.get(f"{name}.weight")
        if patches is None:
            assert torch.equal(module.weight, q0) and torch.equal(module.weight_scale, s0), name
            continue
        q_ref, s_ref = _reference((q0, s0, groups[name]), patches, 0.8)
        assert torch.equal(module.weight, q_ref) and torch.equal(module.weight_scale, s_ref), name
        touched += 1
    assert touched == len([n for n in before if f"{n}.weight" in expected]) > 0
    # Another strength starts from the file's int8 weights, not from the last re-quantization.
    assert state.apply([LoraChoice(lora, -0.3)]) is True
    name = next(n for n in before if f"{n}.weight" in expected)
    q_ref, s_ref = _reference((before[name][0], before[name][1], groups[name]), expected[f"{name}.weight"], -0.3)
    assert torch.equal(int8_model.get_submodule(name).weight, q_ref)
    assert state.apply([]) is True  # no LoRA: the file's int8 tensors, bit for bit, at the same addresses
    for name, (q0, s0, weight_ptr, scale_ptr) in before.items():
        module = int8_model.get_submodule(name)
        assert torch.equal(module.weight, q0) and torch.equal(module.weight_scale, s0), name
        assert (module.weight.data_ptr(), module.weight_scale.data_ptr()) == (weight_ptr, scale_ptr), name


def test_a_merged_int8_model_samples_like_one_quantized_from_the_merged_weights(int8_file, int8_model, tmp_path,
                                                                                tiny_models):
    """The sampler over the merged int8 model equals the sampler over an int8 model whose layers were set, by the
    reference math, to the re-quantized merged weights (same int8 GEMMs on the same tensors: exact)."""
    from tests.owners import generator_for

    expected = write_layout(tmp_path / "p.safetensors", "peft", int8_model, seed=3)
    reference = load_transformer(int8_file, dtype=torch.float32, quantized="int8")
    for name, module in reference.named_modules():
        patches = expected.get(f"{name}.weight")
        if isinstance(module, ConvRotInt8Linear) and patches:
            q, s = _reference((module.weight, module.weight_scale, module.group_size), patches, 1.0)
            module.weight.data.copy_(q)
            module.weight_scale.copy_(s)
    loaded_for(int8_model).lora_state().apply([LoraChoice(read_lora(tmp_path / "p.safetensors", int8_model), 1.0)])

    def run(transformer):
        models = type(tiny_models)(**{**vars(tiny_models), "transformer": transformer})
        return generator_for(models).generate("a lighthouse", width=64, height=64, steps=2, seed=4,
                                                   decode_mode="eager").latents

    merged, want = run(int8_model), run(reference)
    assert torch.equal(merged, want)
    loaded_for(int8_model).lora_state().apply([])
    assert not torch.equal(run(int8_model), merged)  # the LoRA changed the output; restoring undid it
