"""The Fun ControlNet Union on the pack's prefill and decode step, against a reference written from the native model's
description: diffusers' full joint forward (no K/V cache, every row every step) with the control stream beside it as
block hooks (`_reference_forward`): the stream starts from the embedded joint sequence as
`before_proj(joint) + x` (`joint` = embedded control tokens in the target rows, zeros in the prefix rows), control
block j runs the joint stream with the base model's arguments, and `strength * after_proj(stream)` is added to every
row of the base sequence after base block `layers[j]`.

Tolerance: 1e-4 absolute in fp32 on outputs of magnitude ~1-5, as tests/test_cached_decode.py states for the plain
step: the two differ only in how attention is split into calls (float reassociation); a control stream missing on
the prefix rows, added after the wrong block or started from the wrong rows is off by far more (checked below).
"""

import pytest
import torch

from graph_runtime.controlnet import ControlSpec
from graph_runtime.controlnet.stream import ControlledPrefix
from graph_runtime.controlnet.tiny import random_tiny_controlnet
from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.sampling.sampler import initial_noise, pack
from graph_runtime.sampling.schedule import build_schedule, euler_step
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer

from tests.test_graph_manager import RecordingBackend

ATOL = 1e-4
CONFIG = {**TINY_TRANSFORMER, "num_layers": 4}  # 2 control blocks over 4 base blocks: added after blocks 0 and 2


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(3)
    transformer = random_tiny_transformer(CONFIG)
    net = random_tiny_controlnet(seed=5, num_blocks=2, config=CONFIG, scale=2.0).eval()
    return transformer, net


def _reference_forward(transformer, net, strength, tokens, embeds, image_mask, latents, timestep, img_shapes):
    """The native description, literally: the full joint forward with the control stream as block hooks."""
    layers = list(range(0, len(transformer.transformer_blocks), len(transformer.transformer_blocks) // len(net.blocks)))
    target = latents.shape[1]
    state, handles = {}, []

    def start(module, args, kwargs):
        x = kwargs["hidden_states"]
        joint = torch.zeros_like(x)
        joint[:, x.shape[1] - target:] = net.control_img_in(tokens)
        state["stream"] = net.before_proj(joint) + x

    def after(j):
        def hook(module, args, kwargs, out):
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            state["stream"] = net.blocks[j](hidden_states=state["stream"], **rest)
            return out + strength * net.after_proj[j](state["stream"])
        return hook

    handles.append(transformer.transformer_blocks[layers[0]].register_forward_pre_hook(start, with_kwargs=True))
    for j, layer in enumerate(layers):
        handles.append(transformer.transformer_blocks[layer].register_forward_hook(after(j), with_kwargs=True))
    try:
        slots = latents.shape[1] // 4
        img_mask = torch.cat([image_mask, image_mask.new_ones(image_mask.shape[0], slots)], dim=1)
        out = transformer(hidden_states=latents, encoder_hidden_states=embeds, timestep=timestep,
                          img_shapes=[img_shapes], img_mask=img_mask, return_dict=False)[0]
    finally:
        for handle in handles:
            handle.remove()
    return out[:, -target:]


def _tokens(h, w, seed=11):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, h * w, 129, generator=generator)


def _trajectory(models, generator, strength, mode, backend=None, steps=4):
    """(pack's predictions, reference predictions) along one Euler trajectory."""
    transformer, net = models
    engine = DecodeEngine(transformer, backend=backend or RecordingBackend())
    embeds = generator.encoder.encode("a red cube on a table")
    h, w = 8, 6
    img_shapes = [(1, h, w)]
    layout = TokenLayout.build(embeds.image_mask, img_shapes, "cpu")
    latents = pack(initial_noise(7, 1, 64, h, w, torch.float32))
    tokens = _tokens(h, w)
    timesteps, sigmas = build_schedule({}, steps, h * w)
    ours, ref, paths = [], [], []
    with torch.no_grad():
        prefix = None
        for i, t in enumerate(timesteps):
            timestep = t.expand(1) / 1000
            ref.append(_reference_forward(transformer, net, strength, tokens, embeds.embeds, embeds.image_mask,
                                          latents, timestep, img_shapes))
            if prefix is None:
                control = ControlledPrefix(net, (0, 2), tokens, strength)
                _, prefix = engine.prefill(layout, latents, embeds.embeds, timestep, with_target=False,
                                           control=control)
            outcome = engine.decode_step(prefix, latents, timestep, mode=mode)
            ours.append(outcome.output)
            paths.append(outcome.path)
            latents = euler_step(latents, ref[-1], sigmas[i], sigmas[i + 1])
        prefix.release()
    return ours, ref, paths, engine


@pytest.mark.parametrize("mode", ["eager", "auto"], ids=["eager", "graph"])
def test_controlled_steps_equal_the_native_reference(models, generator, mode):
    """Every step of a controlled trajectory equals the reference within ATOL, eagerly and from the (recorded) graph;
    the graph path captures once and replays every later step."""
    ours, ref, paths, engine = _trajectory(models, generator, 0.8, mode)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert (a - b).abs().max().item() <= ATOL, f"step {i + 1}"
    if mode == "auto":
        assert paths == ["capture"] + ["replay"] * (len(paths) - 1)
        assert engine.stats.eager_prefills  # the controlled prefix pass is counted as eager, with its reason


def test_the_control_changes_the_output_beyond_the_tolerance(models, generator):
    """The comparison is sensitive: the same steps without the ControlNet differ from the controlled reference by far
    more than ATOL, and so does a controlled step whose prefix rows did not get the control (the pack's plain
    prefix with the controlled step)."""
    transformer, net = models
    _, ref, _, _ = _trajectory(models, generator, 0.8, "eager", steps=2)
    engine = DecodeEngine(transformer)
    embeds = generator.encoder.encode("a red cube on a table")
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 6)], "cpu")
    latents = pack(initial_noise(7, 1, 64, 8, 6, torch.float32))
    timestep = build_schedule({}, 2, 48)[0][0].expand(1) / 1000
    with torch.no_grad():
        _, plain = engine.prefill(layout, latents, embeds.embeds, timestep, with_target=False)
        uncontrolled = engine.decode_step(plain, latents, timestep, mode="eager").output
        _, controlled = engine.prefill(layout, latents, embeds.embeds, timestep, with_target=False,
                                       control=ControlledPrefix(net, (0, 2), _tokens(8, 6), 0.8))
        plain.residuals = controlled.residuals  # control on the target rows only
        target_only = engine.decode_step(plain, latents, timestep, mode="eager").output
    assert (uncontrolled - ref[0]).abs().max().item() > 100 * ATOL
    assert (target_only - ref[0]).abs().max().item() > 10 * ATOL


def test_strength_zero_in_the_stream_equals_the_plain_step(models, generator):
    """At strength 0 the controlled prefix and step compute the plain model's numbers (within fp32 rounding of the
    residual's unfused add: 1e-5)."""
    transformer, net = models
    engine = DecodeEngine(transformer)
    embeds = generator.encoder.encode("a red cube on a table")
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 6)], "cpu")
    latents = pack(initial_noise(7, 1, 64, 8, 6, torch.float32))
    timestep = torch.full((1,), 0.7)
    with torch.no_grad():
        _, plain = engine.prefill(layout, latents, embeds.embeds, timestep, with_target=False)
        _, zero = engine.prefill(layout, latents, embeds.embeds, timestep, with_target=False,
                                 control=ControlledPrefix(net, (0, 2), _tokens(8, 6), 0.0))
        a = engine.decode_step(plain, latents, timestep, mode="eager").output
        b = engine.decode_step(zero, latents, timestep, mode="eager").output
    assert (a - b).abs().max().item() <= 1e-5


def test_spec_tokens_control_and_inpaint(models):
    """The 129 channels: control latents | keep mask | inpaint latents, as native prepares them (the encoder here is
    a stand-in that averages 16x16 pixel blocks into channel 0, so where each part lands is visible)."""
    _, net = models

    def encode(pixels):
        mean = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1).mean(1, keepdim=True), 16)
        return torch.cat([mean, torch.zeros(1, 63, *mean.shape[-2:])], dim=1)

    image = torch.full((1, 64, 32, 3), 0.25)
    mask = torch.zeros(1, 64, 32)
    mask[:, :32] = 1.0  # regenerate the top half
    control = ControlSpec(net, encode, 1.0, image=image).tokens(4, 2)
    assert control.shape == (1, 129, 4, 2)
    assert torch.allclose(control[:, 0], torch.full((1, 4, 2), 0.25))
    assert torch.all(control[:, 64] == 0) and torch.all(control[:, 65:] == 0)  # no mask: regenerate everywhere
    inpaint = ControlSpec(net, encode, 1.0, inpaint_image=torch.ones(1, 64, 32, 3), mask=mask).tokens(4, 2)
    assert torch.all(inpaint[:, :64] == 0)  # no control image: zeros
    assert torch.equal(inpaint[0, 64], torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
    assert torch.allclose(inpaint[0, 65, :2], torch.full((2, 2), 0.5))  # regenerated: mid-gray
    assert torch.allclose(inpaint[0, 65, 2:], torch.ones(2, 2))  # kept: the image


def _stand_in_encode(pixels):
    """A VAE stand-in: 16x16 pixel blocks averaged, spread over the 64 channels by a fixed random map."""
    mean = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1), 16)  # [1, 3, h, w]
    weights = torch.randn(64, 3, generator=torch.Generator().manual_seed(2))
    return torch.einsum("bchw,oc->bohw", mean, weights)


def _spec(net, strength=0.8, sigma_start=1.0, sigma_end=0.0):
    image = torch.rand(1, 8 * 16, 6 * 16, 3, generator=torch.Generator().manual_seed(4))
    return ControlSpec(net, _stand_in_encode, strength, sigma_start=sigma_start, sigma_end=sigma_end, image=image)


def _reference_sampling(transformer, spec, embeds, steps, seed):
    """The sampling loop the reference way: each step the full forward, controlled inside the spec's range."""
    from graph_runtime.sampling.sampler import SamplingRequest, _schedule
    from graph_runtime.sampling.schedule import model_timestep

    req = SamplingRequest(positive=embeds, latent_height=8, latent_width=6, steps=steps, seed=seed)
    timesteps, sigmas = _schedule(req)
    latents = pack(initial_noise(seed, 1, 64, 8, 6, torch.float32))
    tokens = spec.tokens(8, 6).flatten(2).transpose(1, 2)
    active = []
    with torch.no_grad():
        for i in range(len(timesteps)):
            timestep = model_timestep(timesteps[i].expand(1), torch.float32)
            on = spec.active(float(sigmas[i]))
            active.append(on)
            pred = _reference_forward(transformer, spec.net, spec.strength if on else 0.0, tokens, embeds.embeds,
                                      embeds.image_mask, latents, timestep, [(1, 8, 6)])
            latents = euler_step(latents, pred, sigmas[i], sigmas[i + 1])
    return latents, active


def test_the_kvgraph_sampler_with_a_start_end_range_equals_the_reference(models, generator):
    """The KV-Graph Sampler with a ControlNet acting on the middle of the schedule: controlled steps against the
    controlled prefix (graph entry of their own), the others against the plain prefix, both replaying; the latents
    equal the reference loop's within ATOL (fp32, 5 steps)."""
    from graph_runtime.sampling.sampler import SamplingRequest, sample

    transformer, net = models
    embeds = generator.encoder.encode("a red cube on a table")
    engine = DecodeEngine(transformer, backend=RecordingBackend())
    spec = _spec(net, sigma_start=0.9, sigma_end=0.3)
    expected, active = _reference_sampling(transformer, spec, embeds, 5, 3)
    assert any(active) and not all(active)
    req = SamplingRequest(positive=embeds, latent_height=8, latent_width=6, steps=5, seed=3, control=spec)
    result = sample(engine, req)
    assert (pack(result.latents) - expected).abs().max().item() <= ATOL
    # One captured entry for the plain steps and one for the controlled ones; every other step replays.
    assert engine.stats.captures == 2 and engine.stats.replays == 5
    plain = sample(engine, SamplingRequest(positive=embeds, latent_height=8, latent_width=6, steps=5, seed=3))
    assert (plain.latents - result.latents).abs().max().item() > 100 * ATOL


def test_core_samplers_with_the_control_equal_the_kvgraph_sampler(models, generator):
    """Core's Euler on the model function with the run's ControlNet gives the KV-Graph Sampler's latents (2e-5, as
    tests/test_core_model.py states for the plain model); inside the range the calls use the controlled prefix,
    outside it the plain one."""
    from graph_runtime.core_model import ModelFunction, SamplingRun
    from graph_runtime.sampling.sampler import SamplingRequest, _schedule, sample
    from tests.test_core_model import comfy_noise, core_euler, source

    transformer, net = models
    embeds = generator.encoder.encode("a red cube on a table")
    engine = DecodeEngine(transformer, backend=RecordingBackend())
    spec = _spec(net, sigma_start=0.9, sigma_end=0.3)
    req = SamplingRequest(positive=embeds, latent_height=8, latent_width=6, steps=4, seed=3, control=spec,
                          decode_mode="eager")
    expected = sample(engine, req).latents
    _, sigmas = _schedule(req)
    noise = comfy_noise(3, (1, 64, 8, 6))
    with SamplingRun(engine, "eager", control=spec) as run:
        ours, _ = core_euler(ModelFunction(engine), noise, sigmas, source(embeds), run=run)
        assert run.counts.prefills == 2  # the plain prefix and the controlled one
    assert (ours - expected).abs().max().item() <= 2e-5


def test_the_memory_a_controlnet_adds(models):
    """Its weights, the control blocks' K/V of the controlled entry, and a plain entry beside it when the range is
    only part of the schedule (what the sampler node's memory check adds as a weight named ControlNet)."""
    transformer, net = models
    weights = sum(p.numel() for p in net.parameters()) * 4
    rows = 1 * (20 + 48) * 32 * 4
    assert _spec(net).memory_bytes(transformer, 1, 20, 48) == weights + 2 * 2 * rows
    partial = _spec(net, sigma_start=0.9).memory_bytes(transformer, 1, 20, 48)
    assert partial == weights + 2 * 2 * rows + 2 * 4 * rows


def test_skipped_blocks_with_a_controlnet_are_refused(models, generator):
    """A prefix with skipped blocks (SkipLayerGuidance) and a ControlNet together is refused naming both: the control
    stream's prefix pass runs every base block, so the skip would silently not apply to the prefix rows."""
    from graph_runtime.errors import InputError

    transformer, net = models
    engine = DecodeEngine(transformer)
    embeds = generator.encoder.encode("a red cube on a table")
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 6)], "cpu")
    latents = pack(initial_noise(7, 1, 64, 8, 6, torch.float32))
    with torch.no_grad(), pytest.raises(InputError, match="SkipLayerGuidance together with a ControlNet"):
        engine.prefill(layout, latents, embeds.embeds, torch.full((1,), 0.7), with_target=False,
                       control=ControlledPrefix(net, (0, 2), _tokens(8, 6), 0.8), skip=frozenset({1}))


def test_python_block_patches_with_a_controlnet_are_refused_on_the_controlled_steps(models, generator):
    """A core sampler's call with Python block patches (an eager patched step over the blocks alone) inside the
    ControlNet's range is refused naming both, before any controlled prefix is made: the patched step has no control
    stream, so the net would silently not act. Outside the range the patched step runs (eager, counted), and the same
    run decodes the next unpatched controlled call."""
    from graph_runtime.core_model import ModelFunction, SamplingRun
    from graph_runtime.core_model.patches import ARBITRARY, CallPatches
    from graph_runtime.decode.block_patches import BlockPatches
    from graph_runtime.errors import InputError
    from tests.test_core_model import source

    transformer, net = models
    embeds = generator.encoder.encode("a red cube on a table")
    engine = DecodeEngine(transformer, backend=RecordingBackend())
    patches = CallPatches(python=BlockPatches(replace={1: lambda args, extra: extra["original_block"](args)}))
    x = torch.randn(1, 64, 8, 6, generator=torch.Generator().manual_seed(2))
    fn, src = ModelFunction(engine), source(embeds)
    with SamplingRun(engine, "eager", control=_spec(net, sigma_start=0.9, sigma_end=0.3)) as run:
        fn(x, torch.tensor([1.0]), src, run=run, patches=patches)  # outside the range: the patched eager step
        assert run.counts.eager[ARBITRARY] == 1
        with pytest.raises(InputError, match="Python block or attention patches together with a ControlNet"):
            fn(x, torch.tensor([0.6]), src, run=run, patches=patches)
        assert run.counts.calls == 1 and run.counts.prefills == 0
        fn(x, torch.tensor([0.6]), src, run=run)
        assert run.counts.calls == 2 and run.counts.prefills == 1


def test_the_control_stream_runs_the_attention_kernel_the_step_chose(models, generator, monkeypatch):
    """With the step on FlashAttention-3 (its semantics emulated on the CPU), the control blocks and the base blocks
    of the controlled prefix pass run it too, as every block of the plain step and prefix pass does: per decode step
    4 base + 2 control blocks, and in the prefix pass (text only: one segment) 3 base blocks (the last only writes
    K/V) + 2 control blocks. The result is the reference's within ATOL."""
    from graph_runtime.decode import attention
    from tests.test_attention_choice import _fa3_on_cpu

    calls = []

    def recording_fa3(q, k, v, causal=False):
        calls.append(causal)
        return _fa3_on_cpu(q, k, v, causal)

    monkeypatch.setattr(attention, "choose",
                        lambda device, dtype, requested, loader: (attention.Fa3Attention(recording_fa3), None))
    ours, ref, _, engine = _trajectory(models, generator, 0.8, "eager", steps=2)
    assert engine.step.variant().startswith("fa3")
    assert len(calls) == (3 + 2) + 2 * (4 + 2)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert (a - b).abs().max().item() <= ATOL, f"step {i + 1}"
