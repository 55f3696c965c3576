"""Other nodes' block and attention patches on the pack's model (graph_runtime/core_model/patches.py and
graph_runtime/decode/block_patches.py), driven as ComfyUI's samplers drive the model, with no ComfyUI needed.

Tolerance: the tiny model runs in fp32. The patched step runs the whole joint sequence through the blocks in plain
PyTorch; the decode step runs the target rows against the cached prefix with the pack's kernels (CPU fallbacks) and
a differently ordered residual add, so the two agree to float32 round-off of predictions of magnitude ~1: 1e-4
absolute. Changes the tiny model feels (its gates are small) move them by 1e-2 (`test_patched_step_is_sensitive`).
"""

import logging

import pytest
import torch

from graph_runtime.core_model import ModelFunction, SamplingRun
from graph_runtime.core_model.patches import (ARBITRARY, CallPatches, UnsupportedPatch, check_supported, is_skip,
                                              read_patches)
from graph_runtime.decode import DecodeEngine
from graph_runtime.decode.block_patches import BlockPatches, PatchFailed, origin
from tests.test_core_model import H, W, comfy_noise, encoded, source  # noqa: F401 - fixture
from tests.test_graph_manager import RecordingBackend

ATOL = 1e-4


def skip(args, extra_args):  # what core's SkipLayerGuidance nodes put in for each skipped layer
    return args


def slg_options(*layers):
    return {"patches_replace": {"dit": {("single_block", i): skip for i in layers}}}


class SelfAttentionGuidance:  # the shape of a node's patch: a function defined inside the node's class
    @classmethod
    def execute(cls):
        def attn_and_record(q, k, v, extra_options):
            return q

        return attn_and_record


def attention_pytorch(q, k, v, heads):  # an attention function of ComfyUI's, module-level as there
    return q


def set_model_optimized_attention(optimized_attention):  # what ComfyUI's ModelPatcher method stores
    def optimized_attention_override(_, *args, **kwargs):
        return optimized_attention(*args, **kwargs)

    return optimized_attention_override


def diff(a, b):
    return float((a - b).abs().max())


@pytest.fixture()
def engine(tiny_models):
    return DecodeEngine(tiny_models.transformer, backend=RecordingBackend())


def predict(engine, positive, options=None, seed=1, sigma=0.7, run=None):
    fn = ModelFunction(engine)
    patches = read_patches(options, len(engine.transformer.transformer_blocks))
    x, s = comfy_noise(seed, (1, 64, H, W)), torch.full((1,), sigma)
    if run is not None:
        return fn(x, s, positive, run=run, roles=[0], patches=patches)
    with SamplingRun(engine) as own:
        return fn(x, s, positive, run=own, roles=[0], patches=patches)


def test_skip_detection_is_by_code_not_by_name():
    """A two-argument function returning its first argument is a skip, whatever its names; anything else (another
    body, a closure, defaults, a callable object) is arbitrary Python."""
    assert is_skip(skip) and is_skip(lambda a, b: a)
    outer = 1
    assert not is_skip(lambda a, b: b)
    assert not is_skip(lambda a, b: {"img": a["img"]})
    assert not is_skip(lambda a, b, c=None: a)
    assert not is_skip(lambda a, b: (a, outer)[0])

    class Call:
        def __call__(self, args, extra):
            return args

    assert not is_skip(Call())


def test_static_skip_replays_a_graph_of_its_own_and_changes_the_output(engine, encoded):
    """Skipping blocks is a static choice: its steps replay a captured graph keyed on the skipped blocks (a second
    entry next to the normal one); the normal steps keep replaying theirs; the prediction changes."""
    positive = source(encoded["positive"])
    with SamplingRun(engine) as run:
        normal = predict(engine, positive, run=run)
        skipped = predict(engine, positive, slg_options(1), run=run)
        predict(engine, positive, slg_options(1), sigma=0.5, run=run)
        predict(engine, positive, sigma=0.5, run=run)
        assert run.counts.paths == {"capture": 2, "replay": 2} and not run.counts.eager
        assert run.counts.prefills == 2
    keys = list(engine.graphs.entries)
    assert sorted(k.skip for k in keys) == [(), (1,)]
    assert diff(normal, skipped) > 1e-2
    with SamplingRun(engine) as second:
        predict(engine, positive, slg_options(1), run=second)
        assert second.counts.paths == {"replay": 1}
    assert engine.stats.captures == 2


def test_static_skip_equals_the_native_rule_on_every_row(engine, encoded):
    """The skipped-block graph computes what ComfyUI's own Qwen-Image-2.1 model does with the same replace: the
    block left out for every row, prefix rows included. The reference is the eager joint step with a replace that is
    Python (so not recognised as a skip) and does the same."""
    positive = source(encoded["positive"])
    static = predict(engine, positive, slg_options(0))
    python = predict(engine, positive, {"patches_replace": {"dit": {("single_block", 0): lambda a, b: dict(a)}}})
    assert diff(static, python) <= ATOL


def test_patched_step_without_effect_equals_the_decode_step(engine, encoded):
    """The eager joint step with patches that change nothing (a replace calling the original block, an attn1 patch
    returning nothing, post_input and single_block patches returning their input) equals the decode step over the
    cached prefix."""
    positive = source(encoded["positive"])
    reference = predict(engine, positive)
    seen = {}

    def attn1(q, k, v, pe=None, attn_mask=None, extra_options=None):
        seen["shape"], seen["slice"], seen["pe"] = tuple(q.shape), extra_options["img_slice"], tuple(pe.shape)
        return {}

    options = {"patches_replace": {"dit": {("single_block", 1): lambda a, b: b["original_block"](a)}},
               "patches": {"attn1_patch": [attn1], "post_input": [lambda a: {"img": a["img"]}],
                           "single_block": [lambda a: {"img": a["img"]}]}}
    out = predict(engine, positive, options)
    assert diff(out, reference) <= ATOL
    prefix_len = seen["slice"][0]
    tokens = prefix_len + H * W
    heads, head_dim = engine.transformer.config.num_attention_heads, engine.transformer.config.attention_head_dim
    assert seen["shape"] == (1, heads, tokens, head_dim) and seen["slice"] == [prefix_len, tokens]
    assert seen["pe"][:3] == (1, 1, tokens) and prefix_len > 0


def test_patched_step_is_sensitive(engine, encoded):
    """An attn1 patch that changes the target rows' values changes the prediction (the tolerance above is tight)."""
    positive = source(encoded["positive"])

    def scale_v(q, k, v, pe=None, attn_mask=None, extra_options=None):
        start, end = extra_options["img_slice"]
        v = v.clone()
        v[:, :, start:end] *= 4.0
        return {"v": v}

    assert diff(predict(engine, positive, {"patches": {"attn1_patch": [scale_v]}}), predict(engine, positive)) > 1e-2


def test_python_patches_run_eagerly_counted_and_logged_once(engine, encoded, caplog):
    """Steps with Python patches run eagerly: counted per step in the run and in the engine's statistics under one
    reason, logged once."""
    positive = source(encoded["positive"])
    options = {"patches": {"single_block": [lambda a: {"img": a["img"]}]}}
    with caplog.at_level(logging.INFO, logger="kvgraph"), SamplingRun(engine) as run:
        predict(engine, positive, options, run=run)
        predict(engine, positive, options, sigma=0.4, run=run)
        assert run.counts.eager == {ARBITRARY: 2}
    assert engine.stats.eager_steps[ARBITRARY] == 2 and engine.stats.captures == 0
    assert sum(ARBITRARY in r.getMessage() for r in caplog.records) == 1


def test_patches_no_qwen_image_model_runs_are_refused_naming_the_node():
    """UNet attention replaces (SelfAttentionGuidance), cross-attention and UNet block patches, double-stream
    replaces alone and blocks out of range would do nothing: refused with the node's name."""
    record = SelfAttentionGuidance.execute()
    with pytest.raises(UnsupportedPatch, match=r"SelfAttentionGuidance \(.*\) sets a 'attn1' replace"):
        check_supported({"patches_replace": {"attn1": {("middle", 0, 0): record}}})
    with pytest.raises(UnsupportedPatch, match="'attn2_patch' patch"):
        check_supported({"patches": {"attn2_patch": [record]}})
    with pytest.raises(UnsupportedPatch, match="single-stream blocks only"):
        read_patches({"patches_replace": {"dit": {("double_block", 7): skip}}}, 2)
    with pytest.raises(UnsupportedPatch, match="none of which the model has .blocks 0 to 1."):
        read_patches(slg_options(7, 8), 2)
    assert origin(record).startswith("SelfAttentionGuidance (")
    with pytest.raises(UnsupportedPatch, match="attention override .*attention_pytorch.*ModelAttentionBackend"):
        check_supported({"optimized_attention_override": set_model_optimized_attention(attention_pytorch)})


def test_double_stream_replaces_next_to_single_ones_are_left_out():
    """SkipLayerGuidance sets double- and single-stream layers; the double ones are left out (no such block), as
    ComfyUI's own Qwen-Image-2.1 model does."""
    options = {"patches_replace": {"dit": {("double_block", 1): skip, ("single_block", 1): skip}}}
    patches = read_patches(options, 2)
    assert patches.skip == {1} and not patches.eager and patches.ignored
    assert read_patches(slg_options(1, 7), 2).skip == {1}  # block 7: none in a two-block model, left out
    assert read_patches({}, 2) == CallPatches() or not read_patches({}, 2).eager
    assert not BlockPatches()


def test_a_patch_that_fails_on_this_model_names_its_node(engine, encoded):
    """A patch written for another architecture (HyperTile's UNet attention patch takes no `pe`) fails with a
    message naming the node and the convention, not a bare TypeError."""
    class HyperTile:
        @classmethod
        def execute(cls):
            def hypertile_in(q, k, v, extra_options):
                return q, k, v

            return hypertile_in

    with pytest.raises(PatchFailed, match=r"attn1_patch of HyperTile \(.*TypeError"):
        predict(engine, source(encoded["positive"]), {"patches": {"attn1_patch": [HyperTile.execute()]}})
