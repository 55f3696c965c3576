"""The runtime's pure pieces the ComfyUI nodes call instead of keeping their own copies (CPU, no ComfyUI):

- graph_runtime/report.py words a run's summary line and the status / release reports from plain dicts;
- budget.Available adds up what a request may use and says what it is made of, for either caller's refusal;
- vae_decode.plan_decode decides whole or tiled and the room one image's decode needs;
- encoding/images.encode_each / decode_each run the VAE one image at a time, handing each result on as it is made;
- comfy_interop.conditioning_to moves a CONDITIONING's tensors without touching the one given.
"""

import types

import pytest
import torch

from graph_runtime import memory, report
from graph_runtime.memory import Available, MemoryBudgetError, RequestPlan
from graph_runtime.comfy_interop import conditioning_to
from graph_runtime.encoding.images import decode_each, encode_each, vae_decode, vae_encode
from graph_runtime.vae_decode import plan_decode

MiB, GiB = 2**20, 2**30


def run_result(**stats):
    return types.SimpleNamespace(stats={"captures": 1, "replays": 7, "eager_steps": {}, **stats},
                                 timings={"steps": 8, "prefill_ms": 18.04, "decode_ms_per_step": 107.123})


def test_run_summary_names_size_schedule_times_and_paths():
    line = report.run_summary(1024, 768, 2, run_result(prefill_captures=1), "turbo (auto)", 1.5)
    assert line == ("KV-Graph: 2x 1024x768, 8 steps (turbo (auto), cfg 1.5): prefill 18.0 ms (captured), decode "
                    "107.12 ms/step, captures 1, replays 7, eager steps 0")


def test_run_summary_counts_eager_steps_by_reason():
    line = report.run_summary(64, 64, 1, run_result(eager_steps={"no CUDA": 3, "hooks": 2},
                                                    eager_prefills={"no CUDA": 1}), "dynamic", 1.0)
    assert line.endswith("eager steps 5 (no CUDA: 3, hooks: 2)") and "(eager: no CUDA)" in line


def engine_state(**extra):
    return {"model": "Tiny", "entries": [], "captures": 2, "replays": 9, "capture_seconds": 0.5,
            "eager_steps": {"no CUDA": 4}, "eager_total": 4, "evictions": 0, "prefill_replays": 1,
            "prefill_captures": 1, "eager_prefills": {}, "skipped_steps": 0, "bytes_held": 3 * MiB, "max_entries": 8,
            "compiles": 0, **extra}


def test_graph_cache_fields_are_the_reported_subset_in_order():
    fields = report.graph_cache_fields(engine_state(compiled=True))
    assert list(fields) == [*report.GRAPH_CACHE_FIELDS, "compiled", "attention_requested", "attention",
                            "attention_fallbacks", "prefix_placements", "host_bytes_held"]
    assert fields["compiled"] is True and fields["prefix_placements"] == {} and fields["host_bytes_held"] == 0
    assert "capture_seconds" not in fields and "compiles" not in fields
    quiet = report.graph_cache_fields(engine_state())  # an engine that does not say
    assert quiet["compiled"] is False and quiet["attention_requested"] is None and quiet["attention"] == {}


def test_status_text_names_the_attention_asked_for_what_runs_and_why():
    """One line per engine: the attention asked for, the kernel per device, and the fallbacks with their counts; none
    for an engine that does not report its attention."""
    state = engine_state(attention_requested="fp8", attention={"cpu float32": "sdpa"},
                         attention_fallbacks={"FP8 attention runs in bf16: no CUDA": 1})
    model = {"engine_id": "ab", "model": "Tiny", "source": None, "entries": [], "lora": {"loras": []},
             **report.graph_cache_fields(state)}
    assert report.graph_cache_lines(model)[1] == ("  attention: fp8, runs sdpa on cpu float32; fallbacks: FP8 "
                                                  "attention runs in bf16: no CUDA: 1")
    model.update(report.graph_cache_fields(engine_state()))
    assert not any("attention" in line for line in report.graph_cache_lines(model))


def test_status_text_names_steps_a_step_cache_skipped():
    model = {"engine_id": "ab", "model": "Tiny", "source": None, "entries": [], "lora": {"loras": []},
             **report.graph_cache_fields(engine_state(skipped_steps=7))}
    assert "eager steps: no CUDA: 4, skipped steps: 7 (step cache); prefills:" in report.graph_cache_lines(model)[0]


def status_payload():
    entry = {"key": {"branch": "positive", "batch": 1, "prefix_tokens": 40, "target_tokens": 48},
             "state": "captured", "captures": 1, "replays": 9, "bytes": 2 * MiB, "owner_alive": False}
    failed = {"key": {**entry["key"], "batch": 2}, "state": "failed", "reason": "graph capture failed"}
    model = {"engine_id": "ab", "model": "Tiny", "source": None, **report.graph_cache_fields(engine_state()),
             "entries": [entry, failed],
             "lora": {"loras": [{"name": "style.safetensors", "strength": 0.5}], "weights": 12,
                      "originals_bytes": MiB},
             "budget": {"total_bytes": 3 * GiB, "available_bytes": 10 * GiB, "vae_tiled": True}}
    loaded = {"kind": "vae", "source": "/m/vae.safetensors", "dtype": "bf16", "device": "cpu", "bytes": 5 * MiB,
              "loads": 1}
    return {"loaded": [loaded], "models": [model, {"engine_id": "cd", "error": "KeyError: 'x'"}],
            "running": [{"prompt_id": "p1", "node": "3", "step": 2, "total": 8}]}


def test_status_text_reports_models_caches_budget_entries_and_runs():
    assert report.status_text(status_payload()).splitlines() == [
        "vae: /m/vae.safetensors (bf16, on cpu, 5.0 MiB, loaded 1x)",
        "graph cache of Tiny (not loaded by a KV-Graph loader): 2 entries, 3.0 MiB held, 2 captures, 9 replays, "
        "eager steps: no CUDA: 4; prefills: 1 captured, 1 replayed, eager: none",
        "  LoRAs merged: style.safetensors (0.5); 12 weights, originals 1.0 MiB on the host",
        "  last request's memory budget: 3.0 GiB of 10.0 GiB available (VAE decode tiled)",
        "  - positive batch 1, 40+48 tokens: captured, 1 captures, 9 replays, 2.0 MiB, owner alive: False",
        "  - positive batch 2, 40+48 tokens: failed (graph capture failed)",
        "graph cache cd: unreadable (KeyError: 'x')",
        "running: prompt p1 node 3 step 2/8",
    ]


def test_status_text_with_nothing_loaded():
    assert report.status_text({"loaded": [], "models": [], "running": []}) == "No models loaded by KV-Graph."


def test_release_text():
    result = {"graphs": [{"model": "Tiny", "result": "deferred", "bytes": 3 * MiB}],
              "models": [{"kind": "transformer", "source": "t.safetensors", "unloaded": False},
                         {"kind": "vae", "source": "v.safetensors", "unloaded": True}]}
    assert report.release_text(result).splitlines() == [
        "graphs of Tiny: deferred (3.0 MiB)", "model transformer t.safetensors: dropped (in use: unloads when done)",
        "model vae v.safetensors: dropped"]
    assert report.release_text({"graphs": [], "models": []}) == "Nothing to release."


def test_budget_record_carries_device_and_available():
    budget = memory.MemoryBudget(parts=[("transformer weights", GiB)], margin=MiB)
    record = report.budget_record(budget, torch.device("cuda", 1), None)
    assert record["device"] == "cuda:1" and record["available_bytes"] is None
    assert record["total_bytes"] == GiB + MiB and record["parts"] == {"transformer weights": GiB}


# -- the memory budget's seam --------------------------------------------------------------------------------------


def test_available_adds_up_and_says_what_it_is_made_of():
    available = Available(2 * GiB, (("of its models", GiB), ("of graphs", GiB // 2)))
    assert available.total == 3 * GiB + GiB // 2
    assert available.describe() == "2.0 GiB free + 1.0 GiB of its models + 0.5 GiB of graphs"
    assert Available(GiB).describe() == "1.0 GiB free" and Available(GiB).total == GiB


def test_check_available_refuses_with_what_is_available(tiny_models):
    request = types.SimpleNamespace(
        positive=types.SimpleNamespace(image_mask=torch.zeros(1, 40, dtype=torch.bool), num_image_slots=0),
        negative=None, do_cfg=False, decode_mode="auto", latent_width=64, latent_height=64, batch_size=1,
        placement=lambda: "gpu")
    plan = RequestPlan.for_request(tiny_models.transformer, request, memory.VaeDims.of(tiny_models.vae), graphs=True)
    need = plan.budget().total
    assert plan.check_available(Available(need), "cuda").total == need
    with pytest.raises(MemoryBudgetError) as refused:
        plan.check_available(Available(need // 4, (("of decode graphs", need // 4),)), "cuda")
    assert f"{memory.gib(need // 2)} is available there ({memory.gib(need // 4)} free + " in str(refused.value)
    assert "of decode graphs" in str(refused.value)


def test_graph_bytes_held_sums_every_engine():
    engines = [types.SimpleNamespace(bytes_held=lambda n=n: n) for n in (3, 4)]
    assert memory.graph_bytes_held(engines) == 7 and memory.graph_bytes_held([]) == 0


def test_vae_encode_bytes_per_pixel():
    assert memory.vae_encode_bytes(1024, 512) == 1024 * 512 * memory.VAE_ENCODE_BYTES_PER_PIXEL


# -- the VAE, one image at a time ----------------------------------------------------------------------------------


def test_plan_decode_tiles_only_when_only_tiled_fits_and_counts_weights_to_load(tiny_models):
    vae = tiny_models.vae
    dims = memory.VaeDims.of(vae)
    whole = memory.vae_decode_bytes(dims, 512, 512) + memory.MARGIN_BYTES
    tiled = memory.vae_decode_bytes(dims, 512, 512, tiled=True) + memory.MARGIN_BYTES
    assert tiled < whole
    plan = plan_decode(vae, 32, 32, whole)
    assert (plan.width, plan.height, plan.tiled, plan.bytes) == (512, 512, False, whole - memory.MARGIN_BYTES)
    assert plan_decode(vae, 32, 32, None) == plan  # free memory unknown: whole
    squeezed = plan_decode(vae, 32, 32, (whole + tiled) // 2)
    assert squeezed.tiled and squeezed.bytes == tiled - memory.MARGIN_BYTES
    # The VAE's own weights, still to be loaded, come out of the free memory first.
    assert plan_decode(vae, 32, 32, whole + dims.weight_bytes, weights_to_load=True) == plan
    assert plan_decode(vae, 32, 32, whole + dims.weight_bytes - 1, weights_to_load=True).tiled


def test_encode_and_decode_each_equal_one_call_per_image(tiny_models):
    vae = tiny_models.vae
    pixels = torch.rand(3, 4, 1, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    seen = []
    raw = encode_each(vae, pixels, finish=lambda latent: seen.append(latent.shape) or latent.double())
    assert seen == [torch.Size([1, 64, 2, 3])] * 3 and raw.dtype == torch.float64  # finish saw each image
    for i in range(3):
        assert torch.equal(raw[i:i + 1], vae_encode(vae, pixels[i:i + 1]).double())
    images = decode_each(vae, raw.float())
    assert images.shape == (3, 4, 32, 48)
    assert torch.equal(images[1:2], vae_decode(vae, raw[1:2].float()))


def test_conditioning_to_moves_tensors_and_leaves_the_input():
    cond = torch.zeros(1, 5, 8, dtype=torch.float64)
    mask, ref = torch.ones(1, 5, dtype=torch.long), torch.zeros(1, 64, 2, 2, dtype=torch.float64)
    given = [[cond, {"attention_mask": mask, "reference_latents": [ref], "image_slots": [2]}]]
    moved = conditioning_to(given, "meta")
    assert moved[0][0].device.type == "meta" and moved[0][1]["attention_mask"].device.type == "meta"
    assert moved[0][1]["reference_latents"][0].device.type == "meta" and moved[0][1]["image_slots"] == [2]
    assert given[0][0] is cond and given[0][1]["attention_mask"] is mask and given[0][1]["reference_latents"][0] is ref


def test_the_status_text_names_a_placed_prefix():
    """The prefix placements used (and a non-gpu entry's placement) are in the status text; gpu entries stay as they
    were written."""
    key = {"branch": "cond", "batch": 1, "prefix_tokens": 8320, "target_tokens": 4096}
    entry = {"key": key, "state": "captured", "captures": 1, "replays": 3, "bytes": MiB, "owner_alive": True}
    assert report.entry_line({**entry, "key": {**key, "prefix_placement": "int8"}}).startswith(
        "cond batch 1, 8320+4096 tokens, prefix int8: captured")
    assert "prefix" not in report.entry_line({**entry, "key": {**key, "prefix_placement": "gpu"}}).split(":")[0][-8:]
    model = {"engine_id": "e", "model": "Tiny", "source": None, "lora": {"loras": []},
             **report.graph_cache_fields(engine_state(prefix_placements={"gpu": 2, "recompute": 1}))}
    assert report.graph_cache_lines(model)[0].endswith("; prefix K/V: gpu: 2, recompute: 1")
