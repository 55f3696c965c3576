"""`precision: int8`: a float model's block Linears quantized at load to INT8 ConvRot (group 256, per-channel
scales, as ComfyUI's files are made) and run W8A8 on our kernels, the int8 rows made by the norm and SwiGLU kernels.

The step checks run our Triton kernels through Triton's interpreter in a fresh Python (see test_int8_kernels.py) on
a tiny model wide enough for 256-groups (hidden 256 = 2 heads x 128, MLP 768).
"""

import sys
from pathlib import Path

import torch

from graph_runtime.fp8 import apply_precision, precision_of
from graph_runtime.fp8.convert import int8_group
from graph_runtime.quantized import ConvRotInt8Linear, quantize_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interpreted import interpreted  # noqa: E402

WIDE = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=128,
            num_attention_heads=2, context_in_dim=256, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
            causal_condition=True)


def _wide_model(seed=0):
    from graph_runtime.tiny import random_tiny_transformer

    torch.manual_seed(seed)
    return random_tiny_transformer(WIDE).requires_grad_(False)


def test_int8_precision_quantizes_every_block_linear_like_comfyuis_files():
    """Every block Linear becomes a ConvRotInt8Linear holding comfy-kitchen's own quantization of its float weight
    (group 256), the float weights are freed (the block Linears take a quarter of their fp32 bytes plus the
    scales), and the model reports int8."""
    model = _wide_model()
    expected = {}
    for i, block in enumerate(model.transformer_blocks):
        expected[i] = quantize_weight(block.attn.to_q.weight.detach(), 256)
    done = apply_precision(model, "int8")
    assert done["linears"] == 2 * 7
    for i, block in enumerate(model.transformer_blocks):
        layer = block.attn.to_q
        assert isinstance(layer, ConvRotInt8Linear) and layer.group_size == 256 and layer.convrot
        assert torch.equal(layer.weight, expected[i][0]) and torch.equal(layer.weight_scale, expected[i][1])
        assert isinstance(block.img_mlp.out, ConvRotInt8Linear) and block.img_mlp.out.in_features == 768
    assert done["block_linear_bytes_after"] < done["block_linear_bytes_before"] / 3
    assert precision_of(model) == "int8"


def test_narrow_layers_take_the_largest_power_of_four_group():
    """The tiny test model's 32- and 96-wide inputs cannot take ComfyUI's 256-groups."""
    assert [int8_group(n) for n in (4096, 12288, 768, 96, 32)] == [256, 256, 256, 16, 16]


def check_step_plumbing():
    import copy

    from graph_runtime.decode.step import DecodeInputs, DecodeStep
    from graph_runtime.fp8 import apply_precision
    from graph_runtime.quantized import ConvRotInt8Linear
    from graph_runtime.tiny import random_tiny_transformer

    wide = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=128,
                num_attention_heads=2, context_in_dim=256, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
                causal_condition=True)
    torch.manual_seed(0)
    model = random_tiny_transformer(wide).requires_grad_(False)
    float_model = copy.deepcopy(model)
    apply_precision(model, "int8")
    g = torch.Generator().manual_seed(1)
    tokens, prefix = 16, 8

    def inputs():
        g.manual_seed(1)
        angles = torch.randn(tokens, 1, 64, generator=g)
        return DecodeInputs(hidden=torch.randn(1, tokens, 64, generator=g), timestep=torch.full((1,), 0.5),
                            k=[torch.randn(1, prefix + tokens, 2, 128, generator=g) for _ in range(2)],
                            v=[torch.randn(1, prefix + tokens, 2, 128, generator=g) for _ in range(2)],
                            cos=angles.cos(), sin=angles.sin(), prefix_len=prefix, static_kv=True)

    seen = []
    real = ConvRotInt8Linear.forward

    def recording(self, x):
        seen.append(type(x).__name__ + ("+rotated" if getattr(x, "rotated", False) else ""))
        return real(self, x)

    ConvRotInt8Linear.forward = recording
    with torch.no_grad():
        fused = DecodeStep(model)(inputs())
        assert seen == (["Int8Rows+rotated"] * 3 + ["Tensor"] + ["Int8Rows+rotated"] * 3) * 2, seen
        seen.clear()
        unfused = DecodeStep(model, kernels=False)(inputs())
        assert seen == ["Tensor"] * 14
        reference = DecodeStep(float_model, kernels=False)(inputs())
    ConvRotInt8Linear.forward = real
    # Both int8 paths quantize the same fp32 values; a value at a rounding boundary may round the other way after
    # a different summation order in the LayerNorm (one int8 step of one element), so: close, not equal.
    assert ((fused - unfused).norm() / unfused.norm()).item() < 1e-3
    # W8A8 against the float model: a few percent on random weights through two blocks.
    assert ((fused - reference).norm() / reference.norm()).item() < 0.05
    assert DecodeStep(model).variant().endswith("+kernels+int8")


def test_decode_step_hands_int8_rows_from_our_kernels_to_the_linears():
    """With our kernels, q/k/v and gate/up get their input as rotated int8 rows from the norm kernels and the down
    projection from the SwiGLU kernel; to_out quantizes the attention output itself. The result equals the step
    without our kernels (every int8 Linear quantizing its own float input) to a rounding flip, stays within W8A8's
    error of the float model, and the graph key says int8."""
    interpreted(check_step_plumbing)


def test_lora_merge_requantizes_int8_precision_layers_in_place():
    """A LoRA merged into a float file loaded as int8 rewrites the int8 weight and scale storages (same addresses,
    so captured graphs stay valid) with the merged weight's quantization."""
    model = _wide_model()
    apply_precision(model, "int8")
    layer = model.transformer_blocks[0].attn.to_q
    pointers = layer.weight.data_ptr(), layer.weight_scale.data_ptr()
    merged = layer.dequantized_weight() + 0.01 * torch.randn(layer.out_features, layer.in_features)
    layer.requantize_(merged)
    assert (layer.weight.data_ptr(), layer.weight_scale.data_ptr()) == pointers
    q, s = quantize_weight(merged, 256)
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, s)
