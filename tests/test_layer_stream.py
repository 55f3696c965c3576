"""The text encoder streamed by layer (graph_runtime/layer_stream.py, encoding/streamed.py), on the CPU.

Without CUDA the CPU stands in for the device and the host copy is pageable: each layer still gets a fresh buffer of
its own for its run (so a weight read from the wrong place would show), and layers upload synchronously, one at a
time. tests/gpu/test_gpu_text_encoder_stream.py runs the overlapped way on a GPU.
"""

import dataclasses
import logging

import pytest
import torch

from graph_runtime.text_encoder_layers import decoder_layer_bytes, decoder_layers
from graph_runtime.encoding.prompt import PromptEncoder
from graph_runtime.encoding.streamed import layer_stream, streamed_by_layer
from graph_runtime.memory import plan as plans
from graph_runtime.memory.sizes import GiB, MiB
from graph_runtime.placement import PinnedWeights
from graph_runtime.tiny import build_processor, tiny_text_encoder_config

CPU = torch.device("cpu")
PROMPT = "a red cube on a blue sphere, image 1 kept"


@pytest.fixture(scope="module")
def tiny():
    """A tiny Qwen3-VL with four decoder layers (so more than the two in flight), fp32."""
    from transformers import Qwen3VLForConditionalGeneration

    config = tiny_text_encoder_config()
    config.text_config.num_hidden_layers = 4
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    return model, PromptEncoder(model, build_processor())


def _in(tensor, buffer) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel()


def test_streamed_encode_equals_the_whole_encode_bit_for_bit(tiny):
    """Streaming moves bytes, never values: the encode's embeddings are bit-equal in fp32 (tolerance 0), with and
    without a reference image (the vision tower stays with the outside part)."""
    from PIL import Image

    model, encoder = tiny
    picture = Image.new("RGB", (64, 64), (200, 30, 30))
    whole = [encoder.encode(PROMPT, device=CPU), encoder.encode("Picture 1: <image> kept", [picture], device=CPU)]
    with streamed_by_layer(model, CPU):
        streamed = [encoder.encode(PROMPT, device=CPU),
                    encoder.encode("Picture 1: <image> kept", [picture], device=CPU)]
    for a, b in zip(whole, streamed):
        assert torch.equal(a.embeds, b.embeds)
        assert torch.equal(a.image_mask, b.image_mask)


def test_each_layer_runs_from_its_own_upload_and_leaves_after(tiny):
    """While a layer runs, its weights are in a device buffer of their own (not the host copy) and every other layer's
    are in the host copy: on this synchronous path one layer at a time; the outside part (embeddings, norm, vision
    tower) is off the host copy for the whole encode."""
    model, encoder = tiny
    layers = decoder_layers(model)
    stream = layer_stream(model, CPU)
    host = stream.weights._host  # noqa: SLF001 - the host copy the tensors point into between runs
    seen = []

    def record(index):
        def hook(module, args):
            off_host = [i for i, layer in enumerate(layers) if not _in(next(layer.parameters()), host)]
            embed_off = not _in(model.model.language_model.embed_tokens.weight, host)
            seen.append((index, off_host, embed_off))
        return hook

    handles = []
    stream.start()
    try:
        # Registered after the stream's own pre-hooks, so they see the layer as it runs.
        handles = [layer.register_forward_pre_hook(record(i)) for i, layer in enumerate(layers)]
        encoder.encode(PROMPT, device=CPU)
    finally:
        for h in handles:
            h.remove()
        stream.stop()
    assert [s[0] for s in seen] == [0, 1, 2, 3]
    for index, off_host, embed_off in seen:
        assert off_host == [index] and embed_off
    assert stream.overlap_reason is not None and "CUDA" in stream.overlap_reason


def test_the_hooks_and_device_copies_go_afterwards_even_after_an_error(tiny):
    """After the stream stops, normally or from an error in the encode, no layer keeps a hook and every weight points
    at the host copy again (so the next whole load or offload finds the module as it left it)."""
    model, encoder = tiny
    layers = decoder_layers(model)
    before = [(len(l._forward_pre_hooks), len(l._forward_hooks)) for l in layers]  # noqa: SLF001
    weights = PinnedWeights(model, CPU, pin=False, log=False)

    def boom(module, args):
        raise RuntimeError("fault in layer 2")

    with pytest.raises(RuntimeError, match="fault in layer 2"):
        with streamed_by_layer(model, CPU, weights):
            handle = layers[2].register_forward_pre_hook(boom)
            try:
                encoder.encode(PROMPT, device=CPU)
            finally:
                handle.remove()
    assert [(len(l._forward_pre_hooks), len(l._forward_hooks)) for l in layers] == before  # noqa: SLF001
    assert all(_in(t, weights._host) for t in (*model.parameters(), *model.buffers()) if t.numel())  # noqa: SLF001
    # and the module still encodes as before, whole
    with streamed_by_layer(model, CPU, weights):
        again = encoder.encode(PROMPT, device=CPU)
    assert torch.equal(again.embeds, encoder.encode(PROMPT, device=CPU).embeds)


def test_a_module_without_decoder_layers_is_refused():
    """Streaming by layer names what it expected instead of running a module whole by surprise."""
    with pytest.raises(TypeError, match="no decoder layers"):
        layer_stream(torch.nn.Linear(4, 4), CPU)


def test_the_stream_reports_its_device_bytes(tiny):
    """The stream's own figures are the measured ones: outside part = the encoder's bytes less its layers', and at
    most outside + layers in flight on the device (one here, where uploads cannot overlap)."""
    model, _ = tiny
    total, layer_bytes = decoder_layer_bytes(model)
    stream = layer_stream(model, CPU)
    # The parts are packed at ALIGNMENT, so each is at least its tensors' bytes and at most 512 bytes more per tensor.
    assert total - sum(layer_bytes) <= stream.outside_bytes <= total - sum(layer_bytes) + 512 * 64
    assert max(layer_bytes) <= stream.layer_bytes <= max(layer_bytes) + 512 * 16
    assert stream.device_bytes == stream.outside_bytes + stream.layer_bytes


# -- the memory plan -------------------------------------------------------------------------------------------------


def test_the_plan_measures_the_outside_part_and_the_layers(tiny):
    """TextEncoderSize.of measures the largest layer and everything outside the layers; a streamed encode needs the
    outside part + TE_SLOTS layers + the activations, far less than the whole encoder."""
    model, _ = tiny
    total, layer_bytes = decoder_layer_bytes(model)
    size = plans.TextEncoderSize.of(model)
    assert (size.layers, size.layer_bytes, size.outside_bytes) == (4, max(layer_bytes), total - sum(layer_bytes))
    tokens = 300
    assert size.gpu_bytes(plans.TE_STREAMED, tokens) == (
        total - sum(layer_bytes) + plans.TE_SLOTS * max(layer_bytes) + size.encode_bytes(tokens))
    assert size.gpu_bytes(plans.TE_OFFLOAD, tokens) == total + size.encode_bytes(tokens)
    assert size.gpu_bytes(plans.TE_CPU, tokens) == 0


def test_the_standard_encoder_streams_where_the_whole_does_not_fit():
    """The published 8B encoder (15.2 GiB bf16): alone on a card with room for it, streamed by layer on a card with
    room for its outside part and two layers (about 3 GiB), on the CPU below that; its outside part is counted, so a
    card with room for two layers alone does not stream."""
    size = plans.TextEncoderSize.standard()
    tokens = 1000
    assert 2 * GiB < size.outside_bytes < 3 * GiB and 300 * MiB < size.layer_bytes < 400 * MiB
    streamed = size.gpu_bytes(plans.TE_STREAMED, tokens)
    assert plans.text_encoder_placement(size, tokens, 24 * GiB) == plans.TE_OFFLOAD
    assert plans.text_encoder_placement(size, tokens, 8 * GiB) == plans.TE_STREAMED
    assert plans.text_encoder_placement(size, tokens, streamed) == plans.TE_STREAMED
    assert plans.text_encoder_placement(size, tokens, streamed - 1) == plans.TE_CPU
    assert streamed - size.outside_bytes < 2 * GiB  # two layers alone would have fitted: the outside part decides


def test_the_plan_shows_the_streamed_encoders_gpu_bytes():
    """A plan that streams the encoder says so with what the encode needs on the GPU, in its log line and its status
    record."""
    sizes = dataclasses.replace(plans.ModelSizes.standard("int8"), text_encoder=plans.TextEncoderSize.standard())
    shape = plans.request_shape(1024, 1024)
    plan = plans.plan_memory(sizes, shape, 10 * GiB, streamed_graphs=True)
    assert plan.text_encoder == plans.TE_STREAMED
    expected = sizes.text_encoder.gpu_bytes(plans.TE_STREAMED, max(shape.prefix_tokens))
    assert plan.text_encoder_gpu_bytes == expected == plan.as_dict()["text_encoder_gpu_bytes"]
    assert "text encoder streamed by layer" in plan.describe() and "while encoding" in plan.describe()


def test_overlap_reason_logged_once(tiny, caplog):
    """The synchronous way is said once, with its reason, not once per encode."""
    model, encoder = tiny
    from graph_runtime import layer_stream as module

    module._logged.clear()  # noqa: SLF001
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        for _ in range(2):
            with streamed_by_layer(model, CPU):
                encoder.encode(PROMPT, device=CPU)
    said = [r for r in caplog.records if "uploaded one at a time" in r.getMessage()]
    assert len(said) == 1 and "not CUDA" in said[0].getMessage()
