"""ComfyUI's own samplers on the pack's MODEL, with a real ComfyUI's `comfy` package (CPU, tiny models).

tests/core_sampling_driver.py runs in ComfyUI's Python (COMFYUI_PYTHON, COMFYUI_DIR: the same variables as the
end-to-end tests; skipped without them) and measures; the assertions are here. The same acceptance checks run without
ComfyUI in tests/test_core_model.py, driving the model function the way core's sampling code does.

Tolerances: the tiny model runs in fp32; core's Euler and the KV-Graph Sampler agree to float32 round-off of latents
of magnitude ~20 (they differ only in how the update is written), so 5e-5 absolute; CFG multiplies the difference of
two predictions by 4, so 1e-4. The inpainted region kept from the input latent follows the input's own noising path
to sigma 0 and goes through core's raw <-> normalized conversion: 1e-5.
"""

from __future__ import annotations

import pytest

from tests.comfyui_driver import run_driver

pytestmark = pytest.mark.comfyui

STEPS = 4  # the driver's
# Model calls of each sampler for STEPS steps at cfg 1: one per step, except Heun, which evaluates twice per step
# but takes an Euler step into sigma 0 (2 * STEPS - 1).
EXPECTED_CALLS = {"euler": STEPS, "euler_ancestral": STEPS, "heun": 2 * STEPS - 1, "dpmpp_2m": STEPS,
                  "res_multistep": STEPS, "er_sde": STEPS, "uni_pc": STEPS}


@pytest.fixture(scope="module")
def measured():
    return run_driver("core_sampling_driver.py")


def test_sampler_custom_advanced_euler_equals_the_kvgraph_sampler(measured):
    """SamplerCustomAdvanced (RandomNoise, CFGGuider, core's euler) over KV-Graph Sigmas on the MODEL gives the
    KV-Graph Sampler's latents from the same seed, one model call per step."""
    parity = measured["euler_parity"]
    assert parity["max_diff"] <= 5e-5 and parity["magnitude"] > 1.0
    assert parity["calls"] == [1] * STEPS


def test_a_negative_with_other_references_equals_the_kvgraph_sampler(measured):
    """CFGGuider with a negative that carries other reference latents than the positive: core gives each branch its
    own references, and the KV-Graph Sampler's true CFG equals it (the references change the result by far more than
    the tolerance)."""
    result = measured["cfg_other_references"]
    assert result["max_diff"] <= 1e-4
    assert result["changed_by_references"] > 1e-3


def test_cfg_with_a_negative_equals_the_kvgraph_sampler(measured):
    """The same with cfg 4 and a negative prompt: two prefixes, so cond and uncond are separate calls of batch 1
    (one graph entry each), and the result is the KV-Graph Sampler's true CFG."""
    assert measured["cfg_parity"]["max_diff"] <= 1e-4
    assert measured["cfg_parity"]["calls"] == [1] * (2 * STEPS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CALLS))
def test_every_core_sampler_runs_with_the_expected_model_calls(measured, name):
    result = measured["samplers"][name]
    assert result["finite"] and result["std"] > 0.1
    assert len(result["calls"]) == EXPECTED_CALLS[name]


def test_ksampler_runs_on_the_model(measured):
    """KSampler (scheduler simple: the model's shift at 1024x1024) calls the model once per step."""
    assert measured["ksampler"]["finite"] and len(measured["ksampler"]["calls"]) == STEPS


def test_inpainting_keeps_the_unmasked_region(measured):
    """SetLatentNoiseMask's mask through KSampler and SamplerCustomAdvanced: where it is 0 the result is the input
    latent, where it is 1 it is sampled anew; the KV-Graph Sampler inpaints to the same latents."""
    inpaint = measured["inpaint"]
    assert inpaint["kept_max_diff"] <= 1e-5 and inpaint["custom_kept_max_diff"] <= 1e-5
    assert inpaint["sampled_max_diff"] > 1e-1
    assert inpaint["kv_sampler_max_diff"] <= 5e-5


def test_kvgraph_lora_on_the_model(measured):
    """KV-Graph Load LoRA on the MODEL merges the LoRA for the run (the KV-Graph Sampler's latents with the same
    LoRA)."""
    lora = measured["lora"]
    assert lora["max_diff_vs_kv_sampler"] <= 5e-5 and lora["changed_by_lora"] > 1e-2


def test_core_lora_loader_equals_kvgraph_load_lora(measured):
    """Core's LoraLoaderModelOnly on the MODEL (ComfyUI's own file reading, key mapping and `load_lora`) samples what
    KV-Graph Load LoRA at the same strength samples: one LoRA becomes the same fp32 deltas merged by the same code, so
    equal bit for bit (tolerance 0); a stack of core and KV-Graph loaders equals the KV-Graph chain to float32
    round-off of the summed deltas (5e-5, as above). KSampler runs on it; a run without LoRA afterwards gives the
    plain model's latents and every weight is its original bit for bit."""
    core = measured["core_lora"]
    assert core["max_diff_vs_kvgraph"] == 0.0 and core["changed_by_lora"] > 1e-2
    assert core["stack_max_diff_vs_kvgraph"] <= 5e-5 and core["stack_changed"] > 1e-2
    assert core["ksampler_finite"] and core["plain_after_equal"] and core["weights_changed"] == []


def test_core_lora_files_it_cannot_map_whole_and_hook_loras_are_refused(measured):
    """A PEFT file (`transformer.` keys: core maps none onto this MODEL), a file on ComfyUI's fused MLP (core maps it
    in part), a hook LoRA on the conditioning, ModelMergeSimple and (0.33.0) Load LoRA (Bypass) are refused with a
    message naming what to use; the next run works."""
    core = measured["core_lora"]
    cases = [("peft", "matched none"), ("fused", "fused `img_mlp.gate_up`"), ("hook", "Create Hook LoRA"),
             ("merge", "model merging")]
    if core["bypass"] is not None:  # ComfyUI 0.33.0 has the bypass loader, 0.8.0 not
        cases.append(("bypass", "Load LoRA (Bypass)"))
    for case, words in cases:
        assert core[case]["type"] == "KVGraphError" and words in core[case]["message"], core[case]
        assert "Load LoRA" in core[case]["message"]
    assert core["after_refusals_equal"]


def test_bad_combinations_are_refused_by_name_and_the_next_run_works(measured):
    """Another model's MODEL into KV-Graph Sigmas or KV-Graph Load LoRA, another text encoder's conditioning into
    KSampler on the MODEL: each fails with an error saying what was expected (and nothing else breaks: the LoRA runs
    after it work, and nothing of the failed run stays)."""
    refused = measured["refused"]
    for node in ("sigmas", "lora"):
        assert refused[node]["type"] == "InputError" and "KV-Graph MODEL" in refused[node]["message"], refused[node]
    conditioning = refused["conditioning"]
    assert conditioning["type"] == "InputError" and "width 768" in conditioning["message"]
    assert "Qwen-Image-2.1 conditioning of width" in conditioning["message"]


def test_nothing_of_a_run_outlives_it(measured):
    """After the runs: none in progress, the engine not busy, no prefix still owning a graph entry."""
    after = measured["after"]
    assert after["runs"] == [] and not after["busy"] and after["owned_entries"] == 0


def test_a_partial_load_from_comfyuis_model_management_streams_and_ends(measured):
    """ComfyUI's own `LoadedModel.model_load` handing the patcher a figure of one of two blocks: during the sampling
    call the MODEL streams both blocks through two device slots (one resident block and a slot for the other would be
    the whole model), ComfyUI's bookkeeping says what is loaded (within the figure, `model_lowvram`
    set), the latents equal the whole load's (the same fp32 math; 5e-5 as above), an unload ends the streaming, and a
    later whole load runs the same."""
    partial = measured["partial_load"]
    during = partial["during"]
    assert during["streamed_blocks"] == 2 and during["hooked"] and during["lowvram"]
    assert 0 < during["loaded"] <= partial["budget"] < partial["size"]
    assert partial["max_diff"] <= 5e-5
    assert partial["after_unload"] == {"streaming": False, "loaded": 0, "hooked": False}
    assert partial["whole_again_max_diff"] <= 5e-5 and partial["whole_again_loaded"] == partial["size"]


def test_without_a_step_cache_no_step_counts_as_skipped(measured):
    """Every sampler of the list (Heun's two calls a step, uni_pc's multistep, SDE samplers) calls the model in every
    step it reports, so with no step cache the engine counts no skipped step."""
    assert measured["after"]["stats"]["skipped_steps"] == 0
