"""Other nodes' patches on the loaders' ComfyUI MODEL, through its glue (the run wrapper, `apply_model`) over the fake
of core's sampling stack, on CPU. A real ComfyUI's nodes run on it in tests/test_core_patch_nodes_comfyui.py.

Tolerance: the same fp32 run twice gives the same latents (0); skipping a block of the two-block tiny model moves raw
latents of magnitude ~5 by far more than 1e-3.
"""

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_fake.fixtures import comfy_env  # noqa: E402,F401
from test_nodes_core_model import core_sample, pack_module, setup, sigmas_node  # noqa: E402,F401


def skip(args, extra_args):  # what core's SkipLayerGuidance nodes put in
    return args


class SelfAttentionGuidance:  # the shape of the node's patch: a function defined inside its class
    @classmethod
    def execute(cls):
        def attn_and_record(q, k, v, extra_options):
            return q

        return attn_and_record


def patched(model, **options):
    clone = model.clone()
    clone.model_options = copy.deepcopy(model.model_options)
    clone.model_options.setdefault("transformer_options", {}).update(options)
    return clone


def test_a_skipped_block_changes_the_result_and_the_run_ends(comfy_env, setup):
    """SkipLayerGuidance's replace on the MODEL's options: the steps skip the block (another result than without it)
    through a prefix of their own, not as Python patches (on the CPU they decode eagerly for want of CUDA), and the
    run is released afterwards."""
    handle, model, positive, _, latent = setup
    sigmas = sigmas_node(comfy_env, model, latent)
    plain = core_sample(comfy_env, model, positive, latent, sigmas, seed=3)
    seen = []
    slg = patched(model, patches_replace={"dit": {("single_block", 1): skip}})
    skipped = core_sample(comfy_env, slg, positive, latent, sigmas, seed=3,
                          during=lambda options: seen.append(options[pack_module(comfy_env, "nodes.comfyui.core_model")
                                                                     .RUN]))
    assert float((skipped - plain).abs().max()) > 1e-3
    arbitrary = pack_module(comfy_env, "graph_runtime.core_model.patches").ARBITRARY
    assert seen[0].released and seen[0].counts.prefills == 1 and arbitrary not in seen[0].counts.eager
    again = core_sample(comfy_env, model, positive, latent, sigmas, seed=3)
    assert float((again - plain).abs().max()) == 0.0


def test_a_unet_attention_replace_is_refused_before_the_first_step(comfy_env, setup):
    """SelfAttentionGuidance's UNet attention replace stops the sampling call before any model call, naming the node;
    nothing of the run is left."""
    handle, model, positive, _, latent = setup
    patches = pack_module(comfy_env, "graph_runtime.core_model.patches")
    sag = patched(model, patches_replace={"attn1": {("middle", 0, 0): SelfAttentionGuidance.execute()}})
    calls = []
    with pytest.raises(patches.UnsupportedPatch, match="SelfAttentionGuidance"):
        core_sample(comfy_env, sag, positive, latent, sigmas_node(comfy_env, model, latent), 1, calls.append)
    assert calls == []
    assert pack_module(comfy_env, "graph_runtime.in_flight").runs() == [] and not handle.loaded.busy


def test_a_step_cache_wrapper_and_skipped_blocks_together(comfy_env, setup):
    """EasyCache (a DIFFUSION_MODEL wrapper) with SkipLayerGuidance's replace on the same MODEL: the wrapper gets the
    options holding the replace, the steps it answers make no transformer call (counted as skipped), and the steps it
    passes on skip the block through the skipped-block prefix (one prefill, no Python-patched step): the result
    differs from the same cache without the replace."""
    import comfy.patcher_extension as ext

    handle, model, positive, _, latent = setup
    sigmas = sigmas_node(comfy_env, model, latent, steps=4)
    seen = []

    def with_cache(patcher):
        last = {}

        def cache(executor, *args, **kwargs):  # what a step cache does: every second call answered from the last one
            seen.append(("single_block", 1) in args[-1].get("patches_replace", {}).get("dit", {}))
            if len(seen) % 2 == 0:
                return args[0] + last["diff"]
            out = executor(*args, **kwargs)
            last["diff"] = out - args[0]
            return out

        clone = patcher.clone()
        clone.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, "test", cache)
        return clone

    both = with_cache(patched(model, patches_replace={"dit": {("single_block", 1): skip}}))
    engine = handle.engine
    runs, before = [], engine.stats.snapshot()
    cached = core_sample(comfy_env, both, positive, latent, sigmas, seed=3,
                         during=lambda options: runs.append(options[pack_module(comfy_env, "nodes.comfyui.core_model")
                                                                    .RUN]))
    assert seen == [True] * 4 and engine.stats.delta(before)["skipped_steps"] == 2
    counts = runs[0].counts
    arbitrary = pack_module(comfy_env, "graph_runtime.core_model.patches").ARBITRARY
    assert counts.calls == 2 and counts.prefills == 1 and arbitrary not in counts.eager
    seen.clear()
    cache_only = core_sample(comfy_env, with_cache(model), positive, latent, sigmas, seed=3)
    assert seen == [False] * 4 and float((cached - cache_only).abs().max()) > 1e-3
