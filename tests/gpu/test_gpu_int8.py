"""INT8 ConvRot inside the captured decode step and prefix pass, on a real GPU (run on the H200: `pytest -m gpu`).

The model is the tiny architecture at widths comfy-kitchen's CUDA kernels take (hidden 256 = 2 heads x 128, MLP 768,
text context 256), bf16, its blocks' Linear layers quantized on the GPU with comfy-kitchen: group 256 runs the fused
rotate+quantize kernel, group 64 the generic path that rotates with a Hadamard matrix comfy-kitchen builds on first
use (cached per size, device and dtype: the warm-up runs before a capture build it, so the capture records no
host-to-device copy). The dequantized twin holds each int8 layer's dequantized weight in an ordinary bf16 Linear.

Tolerances: a replay runs the very kernels its body ran at capture, on the same static buffers, so replay vs the body
run eagerly under the capture's settings is bit-equal (a captured comfy-kitchen int8_linear replays bit-equal on the
H200). A second generation with the same shapes captures nothing.
"""

import copy

import pytest
import torch

from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.encoding.prompt import PromptEmbeds
from graph_runtime.quantized import dequantize_linears_, int8_modules, quantize_linears_
from graph_runtime.sampling.sampler import SamplingRequest, initial_noise, pack, sample
from graph_runtime.sampling.schedule import build_schedule

pytestmark = pytest.mark.gpu
WIDE = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=128,
            num_attention_heads=2, context_in_dim=256, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
            causal_condition=True)
LATENT = (8, 8)  # 64 target tokens
PROMPT_TOKENS = 24


def _wide_transformer(seed=0):
    from graph_runtime.tiny import random_tiny_transformer

    torch.manual_seed(seed)
    return random_tiny_transformer(WIDE).to("cuda", torch.bfloat16).requires_grad_(False)


def _dequantized_twin(int8_model):
    twin = copy.deepcopy(int8_model)
    assert dequantize_linears_(twin, torch.bfloat16) == 14
    return twin


@pytest.fixture(scope="module", params=[256, 64], ids=["group256", "group64"])
def models(request):
    int8 = _wide_transformer()
    replaced = quantize_linears_(int8, request.param, lambda name, _: name.startswith("transformer_blocks."))
    assert replaced == 14 and int8.transformer_blocks[0].attn.to_q.weight.device.type == "cuda"
    return {"int8": int8, "dequantized": _dequantized_twin(int8)}


@pytest.fixture(scope="module")
def embeds():
    g = torch.Generator("cuda").manual_seed(1)
    return PromptEmbeds(embeds=torch.randn(1, PROMPT_TOKENS, 256, device="cuda", generator=g, dtype=torch.bfloat16),
                        image_mask=torch.zeros(1, PROMPT_TOKENS, dtype=torch.bool, device="cuda"))


def _request(embeds, seed, steps=6):
    return SamplingRequest(positive=embeds, latent_height=LATENT[0], latent_width=LATENT[1], seed=seed, steps=steps,
                           decode_mode="graph")


@pytest.mark.parametrize("kind", ["int8", "dequantized"])
def test_two_generations_replay_and_the_second_captures_nothing(models, embeds, kind):
    engine = DecodeEngine(models[kind])
    first = sample(engine, _request(embeds, 1))
    assert first.paths[0] == "capture" and set(first.paths[1:]) == {"replay"}, first.paths
    assert first.stats["captures"] == 1 and not first.stats.get("eager_steps")
    assert first.stats.get("prefill_captures") == 1  # the short prefix pass is captured over int8 layers too
    second = sample(engine, _request(embeds, 2))
    assert second.stats["captures"] == 0 and second.stats.get("prefill_captures", 0) == 0
    assert set(second.paths) == {"replay"} and not second.stats.get("eager_steps")
    assert bool(torch.isfinite(second.latents).all())
    engine.release()


@pytest.mark.parametrize("kind", ["int8", "dequantized"])
def test_replay_equals_its_eager_body_bit_for_bit(models, embeds, kind):
    model = models[kind]
    engine = DecodeEngine(model)
    layout = TokenLayout.build(embeds.image_mask, [(1, *LATENT)], "cuda")
    latents = pack(initial_noise(3, 1, 64, *LATENT, torch.bfloat16)).cuda()
    timesteps, _ = build_schedule(None, 4, LATENT[0] * LATENT[1], device="cuda")
    with torch.no_grad():
        t0 = (timesteps[0].expand(1) / 1000).to(torch.bfloat16)
        _, prefix = engine.prefill(layout, latents, embeds.embeds, t0, mode="graph", with_target=False)
        assert engine.decode_step(prefix, latents, t0, "graph").path == "capture"
        t1 = (timesteps[1].expand(1) / 1000).to(torch.bfloat16)
        replayed = engine.decode_step(prefix, latents, t1, "graph")
        assert replayed.path == "replay"
        entry = engine.graphs.entries[prefix.graph_key]
        with engine.graphs.backend.capture_settings():
            body = engine.step(entry.inputs)
    assert torch.equal(body, replayed.output)
    if kind == "int8":
        assert len(int8_modules(model)) == 14
    prefix.release()
    engine.release()


def test_int8_layer_requantized_in_place_keeps_a_captured_graph_valid(models, embeds):
    """`requantize_` writes into the captured storages: the next replay computes with the new weights, equal to
    the body run eagerly with them (how a LoRA merge reaches captured graphs)."""
    model = copy.deepcopy(models["int8"])
    engine = DecodeEngine(model)
    layout = TokenLayout.build(embeds.image_mask, [(1, *LATENT)], "cuda")
    latents = pack(initial_noise(4, 1, 64, *LATENT, torch.bfloat16)).cuda()
    t = torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds.embeds, t, mode="graph", with_target=False)
        before = engine.decode_step(prefix, latents, t, "graph")
        layer = model.transformer_blocks[1].img_mlp.out
        pointer = layer.weight.data_ptr()
        layer.requantize_(layer.dequantized_weight() * 1.5)
        assert layer.weight.data_ptr() == pointer
        after = engine.decode_step(prefix, latents, t, "graph")
        assert after.path == "replay" and not torch.equal(after.output, before.output)
        entry = engine.graphs.entries[prefix.graph_key]
        with engine.graphs.backend.capture_settings():
            assert torch.equal(engine.step(entry.inputs), after.output)
    prefix.release()
    engine.release()


def test_tiny_int8_files_generate_on_the_gpu_and_a_second_prompt_captures_nothing(tiny_parts, tmp_path):
    """The tiny INT8 ConvRot files (group 16: comfy-kitchen's generic rotation path) loaded on CUDA in int8 mode, text
    encoder included, through the generator: graphs replay, a second prompt with the same shapes captures nothing,
    and the conditioning has the bf16 file's shape and mask."""
    import types

    from tests.owners import generator_for
    from graph_runtime.loading import load_text_encoder, load_transformer
    from graph_runtime.tiny import write_comfyui_files, write_comfyui_int8_files

    files = write_comfyui_int8_files(tmp_path / "models", parts=tiny_parts)
    bf16 = write_comfyui_files(tmp_path / "models")
    tiny_parts["processor"].save_pretrained(tmp_path / "tokenizer")
    transformer = load_transformer(files["transformer"], dtype=torch.bfloat16, device="cuda")
    text_encoder, processor = load_text_encoder(files["text_encoder"], dtype=torch.bfloat16, device="cuda",
                                                tokenizer_dir=tmp_path / "tokenizer")
    assert len(int8_modules(transformer)) == 14 and int8_modules(text_encoder)
    models = types.SimpleNamespace(transformer=transformer, text_encoder=text_encoder, processor=processor,
                                   vae=copy.deepcopy(tiny_parts["vae"]).to("cuda", torch.bfloat16),
                                   scheduler_config=dict(tiny_parts["scheduler"].config))
    generator = generator_for(models)
    first = generator.generate("a red cube", width=128, height=128, steps=4, seed=1, decode_mode="graph")
    assert first.stats["captures"] == 1 and not first.stats.get("eager_steps")
    second = generator.generate("a red cube", width=128, height=128, steps=4, seed=2, decode_mode="graph")
    assert second.stats["captures"] == 0 and set(second.paths) == {"replay"}
    reference, _ = load_text_encoder(bf16["text_encoder"], dtype=torch.bfloat16, device="cuda",
                                     tokenizer_dir=tmp_path / "tokenizer")
    from graph_runtime.encoding.prompt import PromptEncoder

    ours, theirs = generator.encoder.encode("a red cube"), PromptEncoder(reference, processor).encode("a red cube")
    assert ours.embeds.shape == theirs.embeds.shape and torch.equal(ours.image_mask.cpu(), theirs.image_mask.cpu())
    generator.engine.release()
