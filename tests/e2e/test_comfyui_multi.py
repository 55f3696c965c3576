"""More than one process: a CPU ComfyUI decoding each image on two gloo processes (the loader's gpus input), and two
ComfyUI servers sharing one install behind one queue, each keeping its own state.

Images from two processes are compared with those of one: the ranks run the one-device math on a share of the
rows, where the CPU's bf16 GEMMs may round a value differently, so a decoded pixel may move by a few levels of 255
(here the tiny random model's noise-like image; identical in the runs so far); a wrong split would change the image
wholesale.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from comfy_server import REPO, load_api_workflow, node_of, prepare_base, start_server  # noqa: E402

pytestmark = pytest.mark.comfyui

T2I = "qwen_image_2.1_text_to_image"
PIXEL_LEVELS = 8  # of 255, see the module docstring
T_FILE = "qwen_image_2.1_int8_convrot.safetensors"


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def _with_gpus(prompt: dict, gpus: int) -> dict:
    node_of(prompt, "KVGraphLoadTransformer")["inputs"]["gpus"] = gpus
    return prompt


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_gpus_two_on_a_cpu_comfyui(comfyui_install, tmp_path):
    """In ComfyUI's own process (rank 0 on its prompt thread, the pack imported under its folder's name), gpus=2
    starts one worker on the first prompt, gives the image one process gives, keeps the worker for the next
    prompt, and the worker exits with ComfyUI."""
    server = start_server(comfyui_install, prepare_base(tmp_path / "base"))
    try:
        one = _pixels(server.output_images(server.run(load_api_workflow(T2I, seed=5)))[0])
        first = server.run(_with_gpus(load_api_workflow(T2I, seed=5), 2), timeout=300)
        two = _pixels(server.output_images(first)[0])
        assert np.abs(two - one).max() <= PIXEL_LEVELS
        server.run(_with_gpus(load_api_workflow(T2I, seed=6), 2), timeout=300)
        log = server.log_path.read_text()
        starts = re.findall(r"KV-Graph: 2 ranks ready on cpu, cpu in [\d.]+ s \(gloo; worker pids (\d+)\)", log)
        assert len(starts) == 1, server.log_tail()
        worker = int(starts[0])
        assert _alive(worker)
    finally:
        server.stop()
    deadline = time.time() + 30
    while _alive(worker) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), "the worker outlived ComfyUI"


def test_two_servers_behind_one_queue_keep_their_own_state(comfyui_install, tmp_path):
    """Two servers on one install (shared models/, input/ and output/) started together, fed prompts in turn as a
    queue in front of them would: each loads the model once and keeps it, both give the same image for the same
    seed, and their start-ups each put the edit examples' images into the shared input folder without clashing."""
    base = prepare_base(tmp_path / "base", reference_images=False)
    servers = [None, None]

    def start(i):
        servers[i] = start_server(comfyui_install, base)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(servers), "a server did not start"
        images = []
        for round_ in range(2):
            for server in servers:
                entry = server.run(load_api_workflow(T2I, seed=40 + round_))
                images.append(_pixels(server.output_images(entry)[0]))
        assert np.array_equal(images[0], images[1]) and np.array_equal(images[2], images[3])
        for server in servers:
            loaded = {m["kind"]: m["loads"] for m in server.status()["loaded"]}
            assert loaded == {"transformer": 1, "text_encoder": 1, "vae": 1}
        shipped = sorted((REPO / "example_workflows" / "inputs").iterdir())
        for path in shipped:
            assert (base / "input" / path.name).read_bytes() == path.read_bytes()
    finally:
        for server in servers:
            if server is not None:
                server.stop()
