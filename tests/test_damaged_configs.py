"""A damaged config.json or checkpoint costs a refusal, not the machine: a config whose layer count or widths do not
match the weights beside it, and a small single file naming a tensor of block 20000, are refused before any model is
built, naming the file, the field and what the weights say.

Each load runs in a child process, which reports the seconds it took and how much its peak resident memory grew
(ru_maxrss, which sees torch's allocations too); before these checks the same loads built for minutes and took 6 to
12+ GB. The bounds: 5 s, five times the one second a refusal should cost, for a loaded 2-core CI machine; 256 MiB of
peak growth, far above a header read and a config, far below any model of those sizes. The child also has a 60 s
timeout and an 8 GiB address-space limit, so the old behaviour fails the test instead of taking the machine down.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
SECONDS, GREW = 5.0, 256 * 2**20


def load_in_children(cases: list[tuple[str, Path]]) -> list[dict]:
    """Each (loader kind, path) loaded in one child process, in turn: its report per case."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))

    args = [str(part) for case in cases for part in case]
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "damaged_loads.py"), *args],
                            capture_output=True, text=True, timeout=60 + 10 * len(cases), preexec_fn=limit,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.strip().splitlines()[-len(cases):]]
    assert len(reports) == len(cases)
    return reports


def assert_quick_refusal(report: dict, *phrases: str) -> None:
    assert report["error"] is not None, "the damaged checkpoint loaded"
    assert report["error"].startswith("CheckpointError: "), report["error"]
    for phrase in phrases:
        assert phrase in report["error"], report["error"]
    assert report["seconds"] < SECONDS, report
    assert report["grew"] < GREW, report


@pytest.fixture(scope="module")
def comfy_files(tmp_path_factory):
    from graph_runtime.tiny import write_comfyui_files

    return write_comfyui_files(tmp_path_factory.mktemp("models"))


def damaged_copy(tiny_folder, folder: Path, component: str, change) -> Path:
    shutil.copytree(tiny_folder, folder)
    config_path = folder / component / "config.json"
    config = json.loads(config_path.read_text())
    change(config)
    config_path.write_text(json.dumps(config))
    return folder


def file_naming_block_20000(path: Path, folder: Path, start: str = "") -> Path:
    """A copy of the single file at `path` with one tensor of a numbered block copied under block 20000 (the file
    stays as small as the tiny one: 0.1 to 20 MB); `start`: the copied tensor's name starts so."""
    import re

    tensors = load_file(path)
    numbered = re.compile(r"^(.*?\.(?:transformer_blocks|layers|blocks|downsamples|upsamples))\.0\.(.*)$")
    key = min((k for k in tensors if numbered.match(k) and k.startswith(start)), key=lambda k: tensors[k].numel())
    m = numbered.match(key)
    tensors[f"{m.group(1)}.20000.{m.group(2)}"] = tensors[key].clone()
    folder.mkdir()
    save_file(tensors, str(folder / path.name))
    return folder / path.name


CONFIG_CASES = {
    "text_encoder layers": ("text_encoder", lambda c: c["text_config"].update(num_hidden_layers=1_000_000),
                            ["text_config.num_hidden_layers=1000000", "text_config.num_hidden_layers=2"]),
    "vision width": ("text_encoder", lambda c: c["vision_config"].update(hidden_size=1_000_000),
                     ["vision_config.hidden_size=1000000"]),
    "vae z_dim": ("vae", lambda c: c.update(z_dim=30_000_000), ["z_dim=30000000", "z_dim=64"]),
    "vae blocks": ("vae", lambda c: c.update(dim_mult=[1, 2, 4, 8, 8, 8, 8, 8]), ["dim_mult="]),
    "transformer layers": ("transformer", lambda c: c.update(num_layers=1_000_000),
                           ["num_layers=1000000", "num_layers=2"]),
}


@pytest.fixture(scope="module")
def reports(tiny_folder, tmp_path_factory):
    """Every damaged input, and its child's report: {case: (path shown in the message, report)}."""
    from graph_runtime.tiny import write_comfyui_files

    root = tmp_path_factory.mktemp("damaged")
    cases, shown = [], {}
    for index, (name, (component, change, _)) in enumerate(CONFIG_CASES.items()):
        folder = damaged_copy(tiny_folder, root / f"config{index}", component, change)
        cases.append((component, folder))
        shown[name] = folder / component / "config.json"
    folder = damaged_copy(tiny_folder, root / "stats", "vae", lambda c: c.update(latents_mean=[0.0] * 3))
    cases.append(("vae", folder))
    shown["latents"] = folder / "vae" / "config.json"
    files = write_comfyui_files(root / "models")
    for name, component, start in (("transformer", "transformer", ""), ("vae", "vae", "decoder."),
                                   ("vae encoder", "vae", "encoder."), ("text_encoder", "text_encoder", "")):
        path = file_naming_block_20000(Path(files[component]), root / f"block_{name.replace(' ', '_')}", start)
        cases.append((component, path))
        shown[f"block {name}"] = path
    return dict(zip(shown, zip(shown.values(), load_in_children(cases))))


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_config_that_does_not_match_its_weights_is_refused_quickly(reports, case):
    path, report = reports[case]
    assert_quick_refusal(report, str(path), "does not belong to them", *CONFIG_CASES[case][2])


def test_latent_statistics_of_the_wrong_length_are_refused(reports):
    path, report = reports["latents"]
    assert_quick_refusal(report, str(path), "latents_mean=", "a list of 64 numbers")


@pytest.mark.parametrize("component", ["transformer", "vae", "vae encoder", "text_encoder"])
def test_a_small_file_naming_block_20000_is_refused_quickly(reports, component):
    path, report = reports[f"block {component}"]
    assert_quick_refusal(report, str(path), "20000")


def test_weights_larger_than_all_host_memory_are_refused_before_they_are_read(tiny_folder, monkeypatch):
    """A checkpoint whose weights alone exceed the host's memory (here: a host of 64 KiB) is refused before any weight
    is read, naming the file, the size and the memory."""
    from graph_runtime import free_memory
    from graph_runtime.errors import CheckpointError
    from graph_runtime.loading.transformer import load_transformer

    monkeypatch.setattr(free_memory, "host_total_bytes", lambda: 2**16)
    with pytest.raises(CheckpointError, match=r"holds .* GiB of weights in float32, more than all of the host's "
                                              r"memory") as info:
        load_transformer(tiny_folder, dtype=torch.float32)
    assert "transformer" in str(info.value).split(":")[0]
