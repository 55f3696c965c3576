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

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfyui

REPO = Path(__file__).resolve().parents[1]
STEPS = 4  # the driver's
# Model calls of each sampler for STEPS steps at cfg 1: one per step, except Heun, which evaluates twice per step
# but takes an Euler step into sigma 0 (2 * STEPS - 1).
EXPECTED_CALLS = {"euler": STEPS, "euler_ancestral": STEPS, "heun": 2 * STEPS - 1, "dpmpp_2m": STEPS,
                  "res_multistep": STEPS, "er_sde": STEPS, "uni_pc": STEPS}


@pytest.fixture(scope="module")
def measured():
    comfyui, python = os.environ.get("COMFYUI_DIR"), os.environ.get("COMFYUI_PYTHON")
    if not comfyui or not python:
        pytest.skip("needs a real ComfyUI: set COMFYUI_DIR to its checkout and COMFYUI_PYTHON to its Python (with "
                    "diffusers installed)")
    env = dict(os.environ, COMFYUI_DIR=comfyui, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([python, str(REPO / "tests" / "core_sampling_driver.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("KVGRAPH-RESULT ")]
    assert done.returncode == 0 and lines, f"the driver failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


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


def test_kvgraph_lora_on_the_model_and_core_lora_refused(measured):
    """KV-Graph Load LoRA on the MODEL merges the LoRA for the run (the KV-Graph Sampler's latents with the same
    LoRA); core's LoRA loader is refused at once, naming KV-Graph Load LoRA."""
    lora = measured["lora"]
    assert lora["max_diff_vs_kv_sampler"] <= 5e-5 and lora["changed_by_lora"] > 1e-2
    refusal = measured["core_lora"]
    assert refusal["type"] == "KVGraphError" and "KV-Graph Load LoRA" in refusal["message"]


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
    call the MODEL streams one block, ComfyUI's bookkeeping says what is loaded (within the figure, `model_lowvram`
    set), the latents equal the whole load's (the same fp32 math; 5e-5 as above), an unload ends the streaming, and a
    later whole load runs the same."""
    partial = measured["partial_load"]
    during = partial["during"]
    assert during["streamed_blocks"] == 1 and during["hooked"] and during["lowvram"]
    assert 0 < during["loaded"] <= partial["budget"] < partial["size"]
    assert partial["max_diff"] <= 5e-5
    assert partial["after_unload"] == {"streaming": False, "loaded": 0, "hooked": False}
    assert partial["whole_again_max_diff"] <= 5e-5 and partial["whole_again_loaded"] == partial["size"]
