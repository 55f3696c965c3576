"""GGUF transformers on a real GPU (run on the H200: `pytest -m gpu`): `precision: auto` quantizes the file's
dequantized weights to INT8 ConvRot at load, so the blocks run on the int8 path.

The model is the tiny architecture at widths comfy-kitchen's CUDA kernels take (hidden 256 = 2 heads x 128), written as
Q8_0 and Q4_0 GGUF files. Tolerance: the int8 layers must equal comfy-kitchen's ConvRot quantization of the file's own
dequantized weights cast to bf16, bit for bit (the same quantizer on the same device and the same inputs).
"""

import pytest
import torch

from graph_runtime.fp8 import apply_precision, resolve_precision
from graph_runtime.fp8.convert import int8_group
from graph_runtime.loading import load_transformer, transformer_from_comfy_state_dict
from graph_runtime.loading.gguf_files import GGUFFile
from graph_runtime.loading.transformer import transformer_is_quantized
from graph_runtime.quantized import ConvRotInt8Linear, quantize_weight
from graph_runtime.tiny_gguf import write_gguf_transformer

pytestmark = pytest.mark.gpu
WIDE = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=128,
            num_attention_heads=2, context_in_dim=256, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
            causal_condition=True)


@pytest.mark.parametrize("while_read", [True, False])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_auto_runs_a_gguf_file_int8(tmp_path, qtype, while_read):
    """auto resolves to int8 for a GGUF file on a GPU with our INT8 GEMM; every block Linear becomes int8 (block by
    block while the file is read, as the loader node does, or after the load), holding exactly the ConvRot
    quantization of the file's weights (as bf16)."""
    from graph_runtime.tiny import random_tiny_transformer

    torch.manual_seed(0)
    path = write_gguf_transformer(random_tiny_transformer(WIDE).state_dict(), tmp_path / f"wide-{qtype}.gguf", qtype)
    device = torch.device("cuda")
    resolved = resolve_precision("auto", device, dtype=torch.bfloat16, int8_file=transformer_is_quantized(path))
    assert resolved.precision == "int8" and resolved.converts, resolved
    model = load_transformer(path, dtype=torch.bfloat16, device=device, gguf_int8_on=device if while_read else None)
    if not while_read:
        apply_precision(model, resolved.precision, device=device)
    file = GGUFFile(path, "")
    expected = transformer_from_comfy_state_dict({k: file.read(k, torch.bfloat16) for k in file.tensors})
    layers = {n: m for n, m in model.named_modules() if isinstance(m, ConvRotInt8Linear)}
    assert len(layers) == 2 * 7  # q, k, v, out, gate, up, down per block
    for name, layer in layers.items():
        weight = expected[name + ".weight"].to(device)
        q, scale = quantize_weight(weight, int8_group(weight.shape[-1]))
        assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale.to(layer.weight_scale.dtype)), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_the_torch_port_on_the_gpu_equals_ggufs_dequantizer(qtype):
    """On CUDA the torch port gives exactly gguf's numpy float32 values (the same elementwise operations; eager
    kernels do not fuse a multiply and an add into an FMA), so a GGUF load dequantized on the GPU holds the same
    weights as one dequantized on the CPU."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from graph_runtime.loading import gguf_torch
    from graph_runtime.tiny_gguf import random_blocks

    qt = gguf.GGMLQuantizationType[qtype]
    if qtype.endswith("_K"):
        blocks = random_blocks(qtype, 512, seed=3)
    else:
        blocks = gguf.quants.quantize(np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32), qt)
    expected = dequantize(blocks.reshape(1, -1), qt)
    ours = gguf_torch.dequantize(torch.from_numpy(np.ascontiguousarray(blocks)).cuda(), qtype, expected.shape)
    assert np.array_equal(ours.cpu().numpy(), expected)


def test_a_k_quant_file_dequantized_on_the_gpu_loads_the_cpus_weights(tmp_path):
    """A Q4_K_M file loaded with dequantization on the GPU holds, bit for bit, the weights of the same load
    dequantized on the CPU (fp32, no int8: the dequantization alone)."""
    from graph_runtime.tiny_gguf import q4_k_m, write_k_quant_transformer

    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(0)
    original = QwenImage21Transformer2DModel(**WIDE)
    path = write_k_quant_transformer(original.state_dict(), tmp_path / "wide-Q4_K_M.gguf", q4_k_m)
    on_gpu = load_transformer(path, dtype=torch.float32, device="cpu", dequantize_device="cuda").state_dict()
    on_cpu = load_transformer(path, dtype=torch.float32, device="cpu").state_dict()
    assert on_gpu.keys() == on_cpu.keys() and all(torch.equal(on_gpu[k], on_cpu[k]) for k in on_cpu)


@pytest.mark.parametrize("fmt", ["awq_w4a16", "nvfp4", "mxfp8"])
def test_a_block_format_file_dequantized_on_the_gpu_matches_the_cpu(tmp_path, fmt):
    """A W4A16 / NVFP4 / MXFP8 file dequantized on the GPU (comfy-kitchen's CUDA or eager code there) holds the
    weights of the same load dequantized on the CPU, within 2^-20 relative of each weight's layer amax (each value is
    a product of the stored codes and scales rounded once in fp32; the order of the products may differ)."""
    from graph_runtime.tiny import build_tiny_components
    from graph_runtime.tiny_kitchen import write_kitchen_transformer

    original = build_tiny_components(0)["transformer"].state_dict()
    path = write_kitchen_transformer(original, tmp_path / f"{fmt}.safetensors", fmt)
    on_gpu = load_transformer(path, dtype=torch.float32, device="cpu", dequantize_device="cuda").state_dict()
    on_cpu = load_transformer(path, dtype=torch.float32, device="cpu").state_dict()
    for key, value in on_cpu.items():
        assert bool(((on_gpu[key] - value).abs() <= 2.0 ** -20 * value.abs().max()).all()), key
