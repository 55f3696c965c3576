"""Start a real ComfyUI with the pack installed and tiny model files, and talk to it over HTTP.

Everything lives in a temporary `--base-directory` (custom_nodes/ with a link to this repository, models/, input/,
output/), so the ComfyUI checkout named by COMFYUI_DIR is never modified.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import requests
from make_workflows import REFERENCE_IMAGES
from make_workflows import ui_path as ui_workflow_path  # noqa: F401  (an example's UI file, named by its card's title)

REPO = Path(__file__).resolve().parents[2]
PACK_FOLDER = "kv_graph_e2e"  # any folder name works; ComfyUI imports the pack under its path
# width, height, mode of each REFERENCE_IMAGES file as the end-to-end tests write it (small, for the CPU)
REFERENCE_SIZES = ((200, 150, "RGB"), (120, 180, "RGBA"), (160, 160, "RGBA"), (144, 112, "RGB"), (96, 176, "RGBA"))
SMALL = 128  # output / reference resolution for end-to-end runs
# A frontend build to serve instead of the one the ComfyUI checkout pins (e.g. the newest comfyui-frontend-package from
# PyPI, unpacked: its comfyui_frontend_package/static folder); passed to ComfyUI as --front-end-root.
FRONTEND_ROOT_VARIABLE = "KVGRAPH_FRONTEND_ROOT"
LORA_FILE = "qwen_image_2.1_lora.safetensors"  # the LoRA example's file: a tiny random LoRA for the tiny model
# The device the server runs on: unset or "cpu" starts ComfyUI with --cpu (the default, for CI); "cuda" or "cuda:N"
# starts it on that GPU. KVGRAPH_E2E_ARGS adds ComfyUI arguments (split as a shell would), e.g. "--lowvram
# --reserve-vram 60". The server inherits this environment, so the pack's own settings (KVGRAPH_EMULATE_CARD_GB,
# graph_runtime/free_memory.py) reach it too.
DEVICE_VARIABLE = "KVGRAPH_E2E_DEVICE"
ARGS_VARIABLE = "KVGRAPH_E2E_ARGS"


def prepare_base(base: Path, pack_folder: str = PACK_FOLDER, reference_images: bool = True) -> Path:
    """Tiny model files in ComfyUI's layout as `make-tiny` writes them (the INT8 ConvRot files the examples load and
    the bf16 ones, under the released names, and the LoRA example's LoRA), a tiny diffusers folder, the pack linked in under custom_nodes/<pack_folder>, and (unless
    `reference_images` is false: a fresh install's empty input folder) random reference images in input/ under the
    names the edit examples load, which the pack then leaves alone."""
    import numpy as np
    from PIL import Image

    from graph_runtime.cli import main as command_line

    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / pack_folder).symlink_to(REPO, target_is_directory=True)
    # What a user's `make-tiny` writes: the examples must run as shipped on exactly these files.
    models = base / "models"
    assert command_line(["make-tiny", str(models / "diffusers" / "qwen-image-2.1-tiny"), "--comfyui-models",
                         str(models)]) == 0
    assert (models / "loras" / LORA_FILE).is_file(), "make-tiny wrote no LoRA under the LoRA example's file name"
    (models / "diffusion_models" / "kvgraph_broken.safetensors").write_bytes(b"\x00" * 128)
    (base / "input").mkdir(exist_ok=True)
    if not reference_images:
        return base
    rng = np.random.RandomState(0)
    for name, (width, height, mode) in zip(REFERENCE_IMAGES, REFERENCE_SIZES):
        channels = 4 if mode == "RGBA" else 3
        Image.fromarray((rng.rand(height, width, channels) * 255).astype("uint8"), mode=mode).save(base / "input" /
                                                                                                   name)
    return base


def frontend_args() -> list[str]:
    """`--front-end-root DIR` when KVGRAPH_FRONTEND_ROOT names a frontend build (a folder with index.html), else
    nothing: ComfyUI then serves the frontend its requirements pin."""
    root = os.environ.get(FRONTEND_ROOT_VARIABLE)
    if not root:
        return []
    if not (Path(root) / "index.html").is_file():
        raise FileNotFoundError(f"{FRONTEND_ROOT_VARIABLE}={root} has no index.html: expected a built ComfyUI frontend, "
                                "e.g. comfyui_frontend_package/static from an unpacked comfyui-frontend-package wheel")
    return ["--front-end-root", str(Path(root).resolve())]


def e2e_device() -> str:
    """The device KVGRAPH_E2E_DEVICE names: "cpu" (also when unset or empty), "cuda" or "cuda:N"."""
    device = os.environ.get(DEVICE_VARIABLE, "").strip() or "cpu"
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ValueError(f"{DEVICE_VARIABLE}={device!r} is invalid: expected cpu, cuda or cuda:N")
    return device


def device_args(device: str | None = None, args: str | None = None) -> list[str]:
    """ComfyUI's arguments for `device` (default `e2e_device()`) followed by `args` (default KVGRAPH_E2E_ARGS):
    --cpu on the CPU; on a GPU nothing, or --cuda-device N for cuda:N."""
    device = e2e_device() if device is None else device
    args = os.environ.get(ARGS_VARIABLE, "") if args is None else args
    if device == "cpu":
        chosen = ["--cpu"]
    else:
        index = device.partition(":")[2]
        chosen = ["--cuda-device", index] if index else []
    return chosen + shlex.split(args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, comfyui_dir: str, python: str, base: Path, extra_args=(), log_path: Path | None = None,
                 device_arguments: list[str] | None = None, env: dict | None = None):
        """`device_arguments`: ComfyUI's device and memory arguments (default `device_args()`: --cpu unless
        KVGRAPH_E2E_DEVICE says otherwise); `env`: variables set for the server on top of this environment."""
        self.dir, self.python, self.base = Path(comfyui_dir), python, base
        self.env = dict(env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client_id = f"kvgraph-e2e-{uuid.uuid4().hex[:8]}"
        self.log_path = log_path or base / f"comfyui-{self.port}.log"
        device_arguments = device_args() if device_arguments is None else list(device_arguments)
        self.args = [python, "main.py", *device_arguments, "--listen", "127.0.0.1", "--port", str(self.port),
                     "--base-directory", str(base), "--disable-auto-launch", "--database-url", "sqlite:///:memory:",
                     *frontend_args(), *extra_args]
        self.process = None

    def start(self, timeout: float = 120.0) -> "ComfyServer":
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", **self.env)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.args, cwd=self.dir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/object_info/KVGraphSampler", timeout=2).ok:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"ComfyUI did not answer on {self.url} within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the session we started, and only it
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    # -- HTTP ----------------------------------------------------------------------------------------------------

    def get(self, path: str):
        response = requests.get(f"{self.url}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body=None) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, timeout=30)

    def queue(self, prompt: dict, client_id: str | None = None) -> requests.Response:
        """POST /prompt for this test's websocket client, or for `client_id` (a browser page's, to hear its
        events there: the pack sends them to the prompt's client only)."""
        return self.post("/prompt", {"prompt": prompt, "client_id": client_id or self.client_id})

    def queue_ok(self, prompt: dict, client_id: str | None = None) -> str:
        response = self.queue(prompt, client_id)
        assert response.status_code == 200, f"prompt rejected: {response.text}\n{self.log_tail()}"
        return response.json()["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 120.0) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                entry = history[prompt_id]
                if entry["status"].get("status_str") in ("success", "error"):
                    return entry
            time.sleep(0.2)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout:.0f} s:\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 120.0) -> dict:
        entry = self.wait(self.queue_ok(prompt), timeout)
        assert entry["status"]["status_str"] == "success", f"{error_message(entry)}\n{self.log_tail()}"
        return entry

    def status(self) -> dict:
        return self.get("/kvgraph/status")

    def wait_for_step(self, step: int = 2, timeout: float = 60.0) -> dict:
        """The first running sampler's record (`/kvgraph/status`) once it has reached `step`."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            running = self.status()["running"]
            if running and running[0]["step"] >= step:
                return running[0]
            time.sleep(0.05)
        raise AssertionError(f"no sampler reported step {step} within {timeout:.0f} s:\n{self.log_tail()}")

    def output_images(self, entry: dict) -> list[Path]:
        paths = []
        for output in entry["outputs"].values():
            for item in output.get("images", []):
                paths.append(self.base / "output" / item.get("subfolder", "") / item["filename"])
        return paths

    def output_pixels(self, entry: dict) -> tuple[tuple[int, int], bytes]:
        """The size and RGB bytes of a prompt's one output image, to compare runs pixel for pixel."""
        from PIL import Image

        path, = self.output_images(entry)
        image = Image.open(path).convert("RGB")
        return image.size, image.tobytes()


def start_server(comfyui_install, base: Path, *extra_args) -> ComfyServer:
    comfyui_dir, python = comfyui_install
    return ComfyServer(comfyui_dir, python, base, extra_args).start()


def error_message(entry: dict) -> str:
    for kind, data in entry["status"].get("messages", []):
        if kind == "execution_error":
            return f"{data.get('exception_type')}: {data.get('exception_message')}"
    return json.dumps(entry["status"])


def load_api_workflow(name: str, seed: int | None = None, steps: int | None = None, **encode_overrides) -> dict:
    """An example API workflow shrunk for a CPU run: small sizes, and the KV-Graph Sampler's `steps` when given (else
    the steps stay as the example has them)."""
    prompt = json.loads((REPO / "example_workflows" / "api" / f"{name}.json").read_text())
    prompt = copy.deepcopy(prompt)
    for node in prompt.values():
        if node["class_type"] == "KVGraphTextEncode":
            node["inputs"].update(width=SMALL, height=SMALL * 3 // 4, reference_resolution=SMALL)
            node["inputs"].update(encode_overrides)
        if node["class_type"] in ("KVGraphSampler", "KSampler") and seed is not None:
            node["inputs"]["seed"] = seed
        if node["class_type"] == "RandomNoise" and seed is not None:
            node["inputs"]["noise_seed"] = seed
        if node["class_type"] == "KVGraphSampler" and steps is not None:
            node["inputs"]["steps"] = steps
    return prompt


def with_diffusers_loader(prompt: dict, folder, placement: str = "gpu while encoding, then offload") -> dict:
    """An example API workflow with its three single-file loaders (ids 1-3) replaced by the diffusers-folder
    loader (id 1), rewired in place."""
    prompt["1"] = {"class_type": "KVGraphLoadDiffusers",
                   "inputs": {"folder": folder, "dtype": "bf16", "text_encoder_placement": placement}}
    for node in prompt.values():
        for key, value in node["inputs"].items():
            if value == ["2", 0]:
                node["inputs"][key] = ["1", 1]
            elif value == ["3", 0]:
                node["inputs"][key] = ["1", 2]
    del prompt["2"], prompt["3"]
    return prompt


def node_of(prompt: dict, class_type: str) -> dict:
    return next(n for n in prompt.values() if n["class_type"] == class_type)

