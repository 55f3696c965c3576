"""Block weights stored input-major ([in, out] in memory) for the decode step's GEMMs.

The re-homing is only worth doing where it was measured (16-bit weights on CUDA); these CPU tests widen
`DEVICE_TYPES` to "cpu" to check what it must never change: values, parameter objects, shapes, memory, outputs.
"""

import copy
import gc

import pytest
import torch

from graph_runtime.decode import weight_layout
from graph_runtime.decode.engine import DecodeEngine
from graph_runtime.decode.layout import TokenLayout
from graph_runtime.decode.step import DecodeInputs, rope_tables
from graph_runtime.sampling.sampler import initial_noise, pack

from test_graph_manager import RecordingBackend


@pytest.fixture()
def bf16_model(tiny_models):
    return copy.deepcopy(tiny_models.transformer).to(torch.bfloat16)


@pytest.fixture()
def on_cpu(monkeypatch):
    monkeypatch.setattr(weight_layout, "DEVICE_TYPES", ("cpu",))


def test_rehoming_keeps_values_parameters_shapes_and_memory(bf16_model, on_cpu):
    """Every block Linear's weight becomes a transposed view of [in, out] storage holding the same values, under the
    same Parameter object and shape, in no more memory; other weights are left alone and a second call moves
    nothing."""
    linears = weight_layout.block_linears(bf16_model)
    before = {id(m.weight): (m.weight, m.weight.detach().clone()) for m in linears}
    outside = bf16_model.proj_out.weight
    assert weight_layout.store_input_major(bf16_model) == len(linears) == 7 * len(bf16_model.transformer_blocks)
    for m in linears:
        param, values = before[id(m.weight)]
        assert m.weight is param and m.weight.shape == values.shape
        assert weight_layout.is_input_major(m.weight) and torch.equal(m.weight, values)
        assert m.weight.untyped_storage().nbytes() == values.numel() * values.element_size()
    assert bf16_model.proj_out.weight is outside and outside.is_contiguous()
    assert weight_layout.store_input_major(bf16_model) == 0


def test_only_16_bit_weights_on_the_measured_devices_are_rehomed(tiny_models, bf16_model):
    """The default leaves CPU weights alone (the layout was measured on CUDA), and fp32 weights are never moved."""
    assert weight_layout.store_input_major(bf16_model) == 0
    fp32 = copy.deepcopy(tiny_models.transformer)
    weight_layout.DEVICE_TYPES, saved = ("cpu",), weight_layout.DEVICE_TYPES
    try:
        assert weight_layout.store_input_major(fp32) == 0
    finally:
        weight_layout.DEVICE_TYPES = saved
    assert all(m.weight.is_contiguous() for m in weight_layout.block_linears(fp32))


def test_decode_step_gives_the_same_output_on_either_layout(bf16_model, on_cpu):
    """The step reads the weights through `F.linear`, which takes either layout: the same products. CPU bf16 GEMMs
    may accumulate in another order per layout, so the bound is a few bf16 ulps of the output's scale (2**-6);
    the GPU test asserts bit-equality at full size, where cuBLAS runs the same kernel either way."""
    engine = DecodeEngine(bf16_model, backend=RecordingBackend())
    torch.manual_seed(0)
    tokens, prefix_len, heads, dim = 16, 8, bf16_model.config.num_attention_heads, bf16_model.config.attention_head_dim
    layout = TokenLayout.build(torch.zeros(1, prefix_len, dtype=torch.bool), ((1, 4, 4),), "cpu")
    cos, sin = rope_tables(layout.rotary(bf16_model.pos_embed)[prefix_len:])
    kv = [torch.randn(1, prefix_len, heads, dim, dtype=torch.bfloat16) for _ in bf16_model.transformer_blocks]
    inputs = DecodeInputs(hidden=torch.randn(1, tokens, bf16_model.config.in_channels, dtype=torch.bfloat16),
                          timestep=torch.full((1,), 0.5, dtype=torch.bfloat16), k=kv, v=[t * 0.5 for t in kv],
                          cos=cos, sin=sin, prefix_len=prefix_len, static_kv=False)
    with torch.no_grad():
        usual = engine.step(inputs)
        weight_layout.store_input_major(bf16_model)
        rehomed = engine.step(inputs)
    assert torch.allclose(rehomed.float(), usual.float(), rtol=0, atol=usual.abs().max().item() * 2 ** -6)


def _bf16_request(generator, engine, prompt):
    embeds = generator.encoder.encode(prompt)
    layout = TokenLayout.build(embeds.image_mask, ((1, 8, 8),), "cpu")
    latents = pack(initial_noise(0, 1, 64, 8, 8, torch.float32)).to(torch.bfloat16)
    t = torch.full((1,), 0.8, dtype=torch.bfloat16)
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds.embeds.to(torch.bfloat16), t)
    return prefix, latents


def test_a_request_start_rehomes_a_new_or_patched_model_once(bf16_model, generator, on_cpu, monkeypatch):
    """The first request start on a model stores its block weights input-major; the next prompt on the unchanged
    model does not look again; a weight replaced between prompts (as a patch or reload does) is re-homed at the
    next request start, and no graph captured on the old weight is replayed."""
    calls = []
    real = weight_layout.store_input_major
    monkeypatch.setattr(weight_layout, "store_input_major", lambda m: calls.append(real(m)) or calls[-1])
    engine = DecodeEngine(bf16_model, backend=RecordingBackend())
    t = torch.full((1,), 0.6, dtype=torch.bfloat16)
    for prompt in ("a red cube", "a blue cube"):
        prefix, latents = _bf16_request(generator, engine, prompt)
        assert engine.decode(prefix, latents, t).reason is None
        prefix.release()
        gc.collect()
    assert calls == [7 * len(bf16_model.transformer_blocks)]
    assert all(weight_layout.is_input_major(m.weight) for m in weight_layout.block_linears(bf16_model))

    to_q = bf16_model.transformer_blocks[0].attn.to_q
    to_q.weight = torch.nn.Parameter(to_q.weight.detach().contiguous() * 0.5, requires_grad=False)
    prefix, latents = _bf16_request(generator, engine, "a green cube")
    assert calls[1:] == [1] and weight_layout.is_input_major(to_q.weight)
    outcome = engine.decode(prefix, latents, t)
    assert outcome.path == "capture" and engine.manager.stats.captures == 2
