"""Block weights stored input-major on a real GPU (run on the H200: `pytest -m gpu`).

At the full model's width cuBLAS runs the same GEMM kernel on either weight layout (its NN instead of its TN
variant), so the step's output must be bit-equal; the request start re-homes a bf16 model once, and moving the model
off the GPU and back (as ComfyUI's model management does) keeps the layout and gives the same image.
"""

import copy

import pytest
import torch

from graph_runtime.bench.model import build_transformer
from graph_runtime.decode import weight_layout
from graph_runtime.decode.engine import DecodeEngine
from graph_runtime.decode.layout import TokenLayout
from graph_runtime.decode.step import DecodeInputs, DecodeStep, rope_tables
from graph_runtime.generate import QwenImageGenerator
from graph_runtime.sampling.sampler import initial_noise, pack
from graph_runtime.sampling.schedule import build_schedule, euler_step

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def generator(tiny_parts):
    import types

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    parts = {k: (copy.deepcopy(v).to("cuda") if isinstance(v, torch.nn.Module) else v) for k, v in tiny_parts.items()}
    return QwenImageGenerator(types.SimpleNamespace(
        transformer=parts["transformer"], vae=parts["vae"], text_encoder=parts["text_encoder"],
        processor=parts["processor"], scheduler_config=dict(parts["scheduler"].config)))


def test_full_width_step_is_bit_equal_on_either_layout():
    """Two full-width blocks (hidden 4096) at 512x512 (1024 target rows, a 128-row prefix): the step's output on
    input-major weights equals the usual layout's bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = build_transformer(layers=2)
    heads, dim = model.config.num_attention_heads, model.config.attention_head_dim
    layout = TokenLayout.build(torch.zeros(1, 128, dtype=torch.bool), ((1, 32, 32),), "cuda")
    cos, sin = rope_tables(layout.rotary(model.pos_embed)[128:])
    g = torch.Generator("cuda").manual_seed(0)
    kv = [torch.randn(1, 128, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    inputs = DecodeInputs(
        hidden=torch.randn(1, 1024, model.config.in_channels, device="cuda", dtype=torch.bfloat16, generator=g),
        timestep=torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16), k=kv, v=[t * 0.5 for t in kv],
        cos=cos, sin=sin, prefix_len=128, static_kv=False)
    step = DecodeStep(model)
    with torch.no_grad():
        usual = step(inputs)
        assert weight_layout.store_input_major(model) == 14
        rehomed = step(inputs)
    assert torch.equal(rehomed, usual)


def _sample(engine, generator, seed, steps=5):
    embeds = generator.encoder.encode("a red cube")
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 8)], "cuda")
    latents = pack(initial_noise(seed, 1, 64, 8, 8, torch.float32)).cuda().to(torch.bfloat16)
    timesteps, sigmas = build_schedule(None, steps, 64, device="cuda")
    paths = []
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            timestep = (t.expand(1) / 1000).to(torch.bfloat16)
            if i == 0:
                pred, prefix = engine.prefill(layout, latents, embeds.embeds.cuda().to(torch.bfloat16), timestep)
            else:
                outcome = engine.decode(prefix, latents, timestep)
                paths.append(outcome.path)
                pred = outcome.output
            latents = euler_step(latents, pred, sigmas[i], sigmas[i + 1])
    prefix.release()
    return latents, paths


def test_request_start_rehomes_and_offloading_keeps_the_layout(generator, tiny_parts):
    """A bf16 model's first request stores its block weights input-major and replays; moved to the CPU and back
    (ComfyUI's unload and load), the weights keep that layout and values, the next request captures afresh (the
    addresses changed) and the image is the same bit for bit."""
    model = copy.deepcopy(tiny_parts["transformer"]).to("cuda", torch.bfloat16).requires_grad_(False)
    linears = weight_layout.block_linears(model)
    assert not any(weight_layout.is_input_major(m.weight) for m in linears)
    engine = DecodeEngine(model)
    first, paths = _sample(engine, generator, seed=3)
    assert paths == ["capture", "replay", "replay", "replay"]
    assert all(weight_layout.is_input_major(m.weight) for m in linears)
    values = [m.weight.detach().clone() for m in linears]

    engine.release()  # what the pack's ComfyUI handle does before ComfyUI moves the weights
    model.to("cpu")
    assert all(weight_layout.is_input_major(m.weight) and not m.weight.is_cuda for m in linears)
    model.to("cuda")
    assert all(weight_layout.is_input_major(m.weight) and torch.equal(m.weight, v) for m, v in zip(linears, values))
    again, paths = _sample(engine, generator, seed=3)
    assert paths == ["capture", "replay", "replay", "replay"] and engine.manager.stats.captures == 2
    assert torch.equal(again, first)
