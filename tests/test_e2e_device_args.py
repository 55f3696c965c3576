"""The end-to-end harness's device choice (tests/e2e/comfy_server.py): with KVGRAPH_E2E_DEVICE unset the servers
start with --cpu as they always did; `cuda` starts them on the GPU, `cuda:N` on that card; KVGRAPH_E2E_ARGS adds
arguments split as a shell would; anything else is refused naming the variable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "e2e"))

from comfy_server import ARGS_VARIABLE, DEVICE_VARIABLE, ComfyServer, device_args  # noqa: E402


def test_unset_means_the_cpu_and_the_servers_command_line_is_unchanged(monkeypatch, tmp_path):
    monkeypatch.delenv(DEVICE_VARIABLE, raising=False)
    monkeypatch.delenv(ARGS_VARIABLE, raising=False)
    monkeypatch.delenv("KVGRAPH_FRONTEND_ROOT", raising=False)
    assert device_args() == ["--cpu"]
    server = ComfyServer("/comfy", "py", tmp_path)
    assert server.args[:3] == ["py", "main.py", "--cpu"] and server.args[3:5] == ["--listen", "127.0.0.1"]
    assert server.args.count("--cpu") == 1


@pytest.mark.parametrize("device, expected", [("cpu", ["--cpu"]), ("", ["--cpu"]), ("cuda", []),
                                              ("cuda:1", ["--cuda-device", "1"])])
def test_the_device_variable_chooses_the_servers_device(monkeypatch, device, expected):
    monkeypatch.setenv(DEVICE_VARIABLE, device)
    monkeypatch.setenv(ARGS_VARIABLE, "--lowvram --reserve-vram '60'")
    assert device_args() == expected + ["--lowvram", "--reserve-vram", "60"]


def test_the_server_gets_its_own_variables_on_top_of_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(DEVICE_VARIABLE, "cuda")
    server = ComfyServer("/comfy", "py", tmp_path, device_arguments=["--novram"],
                         env={"KVGRAPH_EMULATE_CARD_GB": "8"})
    assert "--cpu" not in server.args and server.args[2] == "--novram"
    assert server.env == {"KVGRAPH_EMULATE_CARD_GB": "8"}


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:0", "CUDA"])
def test_an_unknown_device_is_refused_naming_the_variable(monkeypatch, device):
    monkeypatch.setenv(DEVICE_VARIABLE, device)
    with pytest.raises(ValueError, match=f"{DEVICE_VARIABLE}=.*expected cpu, cuda or cuda:N"):
        device_args()
