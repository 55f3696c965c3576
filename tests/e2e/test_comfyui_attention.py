"""The transformer loader's `attention` input in a real ComfyUI (CPU, tiny models, ComfyUI's default classic cache).

A prompt saved before the input existed (no `attention` key) runs `auto`; `fp8` runs on the CPU by falling back to
what `auto` picks there (SDPA), with the reason logged and shown by `GET /kvgraph/status` next to the attention asked
for, and gives the `auto` image pixel for pixel (the same kernel on the same weights); the KSampler example on the
loader's MODEL decodes with the attention too; switching back and forth loads the file once; a value outside the
choices is refused at queue time and leaves the server working.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import load_api_workflow, node_of, start_server  # noqa: E402

pytestmark = pytest.mark.comfyui

T2I, KSAMPLER = "qwen_image_2.1_text_to_image", "qwen_image_2.1_ksampler"
T_FILE = node_of(load_api_workflow(T2I), "KVGraphLoadTransformer")["inputs"]["transformer_name"]
FP8_FALLBACK = "FP8 attention runs in bf16"
STEPS = 3


@pytest.fixture(scope="module")
def server(comfyui_install, comfy_base):
    srv = start_server(comfyui_install, comfy_base)
    yield srv
    srv.stop()


def prompt(name: str = T2I, attention: str | None = None, seed: int = 11) -> dict:
    """The example with `attention` on its loader, or without the input at all (a workflow from before it)."""
    workflow = load_api_workflow(name, seed=seed, steps=STEPS if name == T2I else None)
    inputs = node_of(workflow, "KVGraphLoadTransformer")["inputs"]
    inputs.pop("attention", None)
    if attention is not None:
        inputs["attention"] = attention
    if name == KSAMPLER:
        node_of(workflow, "KSampler")["inputs"]["steps"] = STEPS
    return workflow


def engine_record(server, attention: str) -> dict:
    """The status record of the transformer's engine for `attention` (one engine per kernel asked for)."""
    records = [m for m in server.status()["models"]
               if (m.get("source") or "").endswith(T_FILE) and m.get("attention_requested") == attention]
    assert len(records) == 1, server.status()["models"]
    return records[0]


def loaded_transformer(server) -> dict:
    items = [m for m in server.status()["loaded"] if m["kind"] == "transformer" and m["source"].endswith(T_FILE)]
    assert len(items) == 1, server.status()["loaded"]
    return items[0]


def test_a_prompt_without_the_input_runs_auto(server):
    """An API prompt whose loader has no `attention` (saved before the input existed) is accepted and runs, and the
    status says its engine was asked for `auto` and ran SDPA on the CPU."""
    assert "attention" not in node_of(prompt(), "KVGraphLoadTransformer")["inputs"]
    server.run(prompt(), timeout=300)
    record = engine_record(server, "auto")
    assert set(record["attention"].values()) == {"sdpa"}, record
    assert loaded_transformer(server)["attention"] == "auto"


def test_fp8_on_the_cpu_falls_back_logged_and_reported(server):
    """`fp8` on a CPU ComfyUI runs (no FlashAttention-3 there): the step runs SDPA, the reason is logged as a
    warning and counted in the status next to the attention asked for, the image equals the `auto` one pixel for
    pixel, and the model was loaded once for both."""
    auto = server.output_pixels(server.run(prompt(attention="auto"), timeout=300))
    fp8 = server.output_pixels(server.run(prompt(attention="fp8"), timeout=300))
    assert fp8 == auto
    record = engine_record(server, "fp8")
    assert set(record["attention"].values()) == {"sdpa"}, record
    reasons = [r for r in record["attention_fallbacks"] if r.startswith(FP8_FALLBACK)]
    assert reasons and all(record["attention_fallbacks"][r] >= 1 for r in reasons), record
    assert record["loads"] == 1 and loaded_transformer(server)["attention"] == "fp8"
    log = server.log_path.read_text()
    assert f"attention runs on SDPA on cpu: {FP8_FALLBACK}" in log, server.log_tail()


def test_core_ksampler_on_the_fp8_model(server):
    """The KSampler example with `fp8` on the loader: core's sampling on the MODEL decodes on the fp8 engine (its
    steps counted there), and the next `auto` prompt goes back to auto's engine, with the file still loaded once."""
    before = engine_record(server, "fp8")["eager_total"]
    server.run(prompt(KSAMPLER, attention="fp8"), timeout=300)
    record = engine_record(server, "fp8")
    assert record["eager_total"] >= before + STEPS and set(record["attention"].values()) == {"sdpa"}, record
    server.run(prompt(KSAMPLER), timeout=300)
    assert loaded_transformer(server)["attention"] == "auto" and engine_record(server, "auto")["loads"] == 1


def test_an_attention_outside_the_choices_is_refused_at_queue_time(server):
    """ComfyUI's own validation refuses a value outside the combo, naming the input; the next prompt runs."""
    response = server.queue(prompt(attention="fp4"))
    assert response.status_code == 400 and "attention" in response.text, response.text
    server.run(prompt(attention="auto"), timeout=300)
