"""Faults while a prompt runs, in a real ComfyUI: a model file rewritten under the running sampler, an interrupt in
the middle of a long batch decode, and a second browser connected while a prompt runs.

One server (CPU, tiny models, `--cache-none` so every node of every prompt runs). After each fault the same good
prompt runs again and its image equals, pixel for pixel, the one it gave first: the fault left nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import load_api_workflow, node_of, prepare_base, start_server  # noqa: E402

pytestmark = pytest.mark.comfyui

T2I = "qwen_image_2.1_text_to_image"
DECODE = "6"  # the VAE decode's node id in the example API workflows
BF16_FILE = "qwen_image_2.1_bf16.safetensors"
REWRITTEN = "kvgraph_e2e_rewritten_bf16.safetensors"  # a copy of the tiny bf16 DiT this module truncates


@pytest.fixture(scope="module")
def base(comfyui_install, tmp_path_factory):
    base = prepare_base(tmp_path_factory.mktemp("comfyui-faults"))
    shutil.copy(base / "models" / "diffusion_models" / BF16_FILE, base / "models" / "diffusion_models" / REWRITTEN)
    return base


@pytest.fixture(scope="module")
def server(comfyui_install, base):
    srv = start_server(comfyui_install, base, "--cache-none")
    yield srv
    srv.stop()


def good_prompt() -> dict:
    return load_api_workflow(T2I, seed=77, steps=3)


@pytest.fixture(scope="module")
def reference(server):
    """The good prompt's image from its first run on this server."""
    return server.output_pixels(server.run(good_prompt()))


def assert_next_good_prompt_matches(server, reference) -> None:
    assert server.output_pixels(server.run(good_prompt())) == reference


def wait_until(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- a model file rewritten in place under the running sampler ------------------------------------------------------


def test_a_model_file_truncated_while_it_samples_leaves_the_server_running(server, base, reference):
    """The bf16 DiT loaded as bf16 (before: its weights stayed the file's memory map) is truncated in place while
    the sampler is at work: the run finishes with its own copy of the weights, and the server lives on (before, it
    died of SIGBUS with no log line). The next load of the changed file says what is wrong with it; once the file is
    whole again the good prompt matches."""
    path = base / "models" / "diffusion_models" / REWRITTEN
    whole = path.read_bytes()
    prompt = load_api_workflow(T2I, seed=5, width=512, height=512)
    node_of(prompt, "KVGraphLoadTransformer")["inputs"].update(transformer_name=REWRITTEN, dtype="bf16")
    node_of(prompt, "KVGraphSampler")["inputs"]["steps"] = 1000
    prompt_id = server.queue_ok(prompt)
    wait_until(lambda: any(run["step"] >= 2 for run in server.status()["running"]), 120, "the sampler's step 2")
    with open(path, "r+b") as f:  # what a download or copy over the old file does
        f.truncate(0)
    entry = server.wait(prompt_id, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert server.process.poll() is None and server.status()["running"] == []

    entry = server.wait(server.queue_ok(prompt))
    assert entry["status"]["status_str"] == "error"
    error = next(data for kind, data in entry["status"]["messages"] if kind == "execution_error")
    assert error["node_type"] == "KVGraphLoadTransformer" and REWRITTEN in error["exception_message"]
    path.write_bytes(whole)
    assert_next_good_prompt_matches(server, reference)


# -- an interrupt during a long batch decode ------------------------------------------------------------------------


def test_an_interrupt_stops_a_batch_decode_between_images(server, reference, websocket_log):
    """A batch of 64 latents decodes one image at a time with a progress update per image; POST /interrupt after the
    second stops it before the next image instead of after the whole batch."""
    prompt = good_prompt()
    prompt["90"] = {"class_type": "RepeatLatentBatch", "inputs": {"samples": ["5", 0], "amount": 64}}
    prompt[DECODE]["inputs"]["latent"] = ["90", 0]
    prompt_id = server.queue_ok(prompt)

    def decode_progress():
        return [m["data"]["value"] for m in websocket_log() if m.get("type") == "progress"
                and m["data"].get("node") == DECODE and m["data"].get("prompt_id") == prompt_id]

    wait_until(lambda: max(decode_progress(), default=0) >= 2, 300, "two decoded images")
    interrupted_at = time.time()
    assert server.post("/interrupt").ok
    entry = server.wait(prompt_id, timeout=120)
    assert time.time() - interrupted_at < 60  # one image at most after the interrupt, not the other 60
    kinds = [kind for kind, _ in entry["status"]["messages"]]
    assert "execution_interrupted" in kinds and "execution_success" not in kinds
    assert max(decode_progress()) < 64
    assert_next_good_prompt_matches(server, reference)


# -- websocket events -----------------------------------------------------------------------------------------------


def test_status_events_reach_only_the_prompts_own_client(server, comfyui_install, reference, websocket_log,
                                                          tmp_path):
    """A second browser connected to the server hears ComfyUI's broadcasts (queue status) but none of the pack's
    `kvgraph.status` events of another client's prompt; the prompt's own client hears every phase."""
    other_log = tmp_path / "other.jsonl"
    url = f"ws://127.0.0.1:{server.port}/ws?clientId=someone-else"
    listener = subprocess.Popen([comfyui_install[1], str(Path(__file__).parent / "ws_listen.py"), url,
                                 str(other_log)], start_new_session=True)
    try:
        wait_until(lambda: other_log.exists() and other_log.read_text(), 30, "the second listener")
        entry = server.run(good_prompt())
        prompt_id = next(data["prompt_id"] for kind, data in entry["status"]["messages"]
                         if kind == "execution_start")
        ours = [m["data"] for m in websocket_log() if m.get("type") == "kvgraph.status"
                and m["data"]["prompt_id"] == prompt_id]
        assert [m["phase"] for m in ours][0] == "prefill" and ours[-1]["phase"] == "done"
        time.sleep(1.0)  # anything still in flight reaches the second listener too
        theirs = [json.loads(line) for line in other_log.read_text().splitlines() if line.strip()]
        assert any(m.get("type") == "status" for m in theirs)  # it was connected and hearing broadcasts
        assert not [m for m in theirs if m.get("type") == "kvgraph.status"]
        assert server.output_pixels(entry) == reference
    finally:
        os.killpg(listener.pid, 15)
        listener.wait(timeout=10)
