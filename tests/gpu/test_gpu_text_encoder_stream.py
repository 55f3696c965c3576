"""The text encoder streamed by layer on a real GPU (`pytest -m gpu tests/gpu/test_gpu_text_encoder_stream.py -s`).

Where CUDA and a pinned host copy are there, layer i+1's upload runs on a copy stream while layer i computes; the
result must be the whole encoder's, and the GPU must hold at most the outside part (embeddings, vision tower, norm),
two layers and the encode's activations. The full-size check builds Qwen3-VL-8B with random weights on the GPU
(bench/placement.py, no download; 16 GB bf16 + the same in pinned host memory) and caps the allocator below the whole
encoder with `torch.cuda.set_per_process_memory_fraction`, as a small card would.
"""

import gc

import pytest
import torch

from bench.placement import build_text_encoder
from graph_runtime.text_encoder_layers import decoder_layers
from graph_runtime.encoding.prompt import PromptEncoder
from graph_runtime.encoding.streamed import streamed_by_layer
from graph_runtime.memory import plan as plans
from graph_runtime.placement import PinnedWeights
from graph_runtime.tiny import build_processor, tiny_text_encoder_config

pytestmark = pytest.mark.gpu
PROMPT = "A capybara wearing a wizard hat, reading a book by candlelight, oil painting " * 8


def test_tiny_streamed_encode_is_bit_equal_and_overlapped():
    """fp32 tiny encoder with four layers: the streamed encode (copy stream, pinned) equals the whole GPU encode bit
    for bit (tolerance 0: the same kernels read the same values, only their addresses differ); no hook is left."""
    from transformers import Qwen3VLForConditionalGeneration

    config = tiny_text_encoder_config()
    config.text_config.num_hidden_layers = 4
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval().to("cuda")
    encoder = PromptEncoder(model, build_processor())
    whole = encoder.encode(PROMPT, device=torch.device("cuda"))
    weights = PinnedWeights(model, "cuda")
    assert weights.pinned
    with streamed_by_layer(model, "cuda", weights) as stream:
        assert stream.overlap_reason is None
        streamed = encoder.encode(PROMPT, device=torch.device("cuda"))
    assert torch.equal(whole.embeds, streamed.embeds)
    assert all(not layer._forward_pre_hooks for layer in decoder_layers(model))  # noqa: SLF001
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_full_size_streamed_encode_fits_a_small_card_and_equals_the_whole():
    """Qwen3-VL-8B bf16 (16 GB): the streamed encode's peak stays within outside + 2 layers + the activations the
    plan counts (TextEncoderSize.gpu_bytes), under an allocator cap that the whole encoder exceeds, and its result
    is bit-equal to the whole encode's (same kernels, same values: tolerance 0)."""
    model = build_text_encoder("cuda", torch.bfloat16)
    encoder = PromptEncoder(model, build_processor())
    device = torch.device("cuda")
    whole = encoder.encode(PROMPT, device=device).embeds.cpu()
    weights = PinnedWeights(model, device)  # every weight now in one pinned host copy; the GPU copy is gone
    assert weights.pinned
    gc.collect()
    torch.cuda.empty_cache()
    size = plans.TextEncoderSize.of(model)
    tokens = encoder.token_bound(PROMPT)
    budget = size.gpu_bytes(plans.TE_STREAMED, tokens)
    assert budget < size.bytes / 2
    total = torch.cuda.get_device_properties(device).total_memory
    base = torch.cuda.memory_allocated(device)
    torch.cuda.set_per_process_memory_fraction((base + budget) / total, torch.cuda.current_device())
    try:
        torch.cuda.reset_peak_memory_stats(device)
        with streamed_by_layer(model, device, weights) as stream:
            assert stream.overlap_reason is None
            streamed = encoder.encode(PROMPT, device=device).embeds.cpu()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    print(f"streamed encode: peak {peak / 2**30:.2f} GiB, plan {budget / 2**30:.2f} GiB, outside "
          f"{size.outside_bytes / 2**30:.2f} GiB, layer {size.layer_bytes / 2**20:.0f} MiB, "
          f"whole {size.bytes / 2**30:.1f} GiB")
    assert peak <= budget
    assert peak <= size.outside_bytes + 2 * size.layer_bytes + size.encode_bytes(tokens)
    assert torch.equal(whole, streamed)


def test_the_handle_streams_from_its_pinned_copy_and_leaves_it_as_it_was(tiny_parts):
    """The text encoder handle of the nodes (fake ComfyUI on the GPU), placement 'streamed by layer': the encode
    streams from the handle's own pinned copy (no second host copy), the embeddings are on the GPU and the decoder
    layers past the first (uploaded as the stream starts) on the host between layer runs, the conditioning equals
    the whole encode's bit for bit, and afterwards every weight is back at its host address with no hook left."""
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from comfy_fake.fixtures import close_env, make_env

    env = make_env(device="cuda")
    try:
        handles = sys.modules[env.pack.__name__ + ".nodes.comfyui.model_handles"]
        module = copy.deepcopy(tiny_parts["text_encoder"]).float()
        encoder = PromptEncoder(module, tiny_parts["processor"])
        module.to("cuda")
        whole = encoder.encode(PROMPT, device=torch.device("cuda"))
        handle = handles.TextEncoderHandle.create("text_encoder", module, "test", "fp32", "cuda", "cpu",
                                                  processor=tiny_parts["processor"], placement="streamed by layer")
        assert handle.patcher.placement is not None and handle.patcher.placement.pinned
        host_ptrs = [p.data_ptr() for p in module.parameters()]
        handle.before_encode("streamed by layer", 0)
        try:
            assert module.model.language_model.embed_tokens.weight.is_cuda
            # The first layer is uploaded as the stream starts (behind the embeddings); every later one waits
            layers = decoder_layers(module)
            assert len(layers) > 1 and all(not p.is_cuda for layer in layers[1:] for p in layer.parameters())
            streamed = handle.encoder.encode(PROMPT, device=handle.encode_device)
        finally:
            handle.after_encode()
        assert torch.equal(whole.embeds, streamed.embeds)
        assert [p.data_ptr() for p in module.parameters()] == host_ptrs
        assert all(not layer._forward_pre_hooks for layer in decoder_layers(module))  # noqa: SLF001
    finally:
        close_env(env)
