"""The parallel runtime with real worker processes (gloo on CPU): started by PyTorch's elastic launcher, weights
broadcast from this process, one request per command, failures, restarts and the one-device fallback.

Tolerance as in test_parallel_decode.py (fp32, ranks differ from one device only by GEMM blocking): 1e-5 absolute.
The collective timeout is set to 60 s here so a regression that hangs fails within minutes; a killed worker must
be reported well inside it.
"""

import copy
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from graph_runtime.decode import DecodeEngine
from graph_runtime.errors import InputError
from graph_runtime.parallel import ParallelFailure, sample_on_devices
from graph_runtime.parallel import runtime as runtime_module
from graph_runtime.sampling.sampler import Cancelled, SamplingRequest, sample
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer
from tests.owners import loaded_for

from .parallel_helpers import kill_at_step

ATOL = 1e-5
TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("KVGRAPH_PARALLEL_TIMEOUT", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def model(tiny_models):
    """A copy of the tiny transformer, so its workers stop with this module's tests."""
    transformer = copy.deepcopy(tiny_models.transformer).requires_grad_(False)  # as the loaders leave it
    yield transformer
    loaded_for(transformer).shutdown_parallel()


def _request(generator, **kw):
    kw.setdefault("steps", 3)
    return SamplingRequest(positive=generator.encoder.encode(kw.pop("prompt", "a red cube")), latent_height=8,
                           latent_width=8, **kw)


def _one_device(transformer, request):
    return sample(DecodeEngine(transformer), request).latents


def _max_diff(a, b):
    return (a - b).abs().max().item()


def test_two_processes_text_to_image_and_workers_kept(model, generator):
    """Two ranks (this process and one worker) give the one-device latents; the second prompt finds the same
    worker (no second start) and every rank reports its statistics."""
    request = _request(generator, seed=1)
    expected = _one_device(model, request)
    first = sample_on_devices(loaded_for(model), request, gpus=2)
    runtime = loaded_for(model).parallel_runtime(2)
    pids = runtime.status()["pids"]
    second = sample_on_devices(loaded_for(model), request, gpus=2)
    assert _max_diff(first.latents, expected) <= ATOL and _max_diff(second.latents, expected) <= ATOL
    assert runtime.status()["pids"] == pids and len(pids) == 1 and runtime.starts == 1
    assert [r["rank"] for r in second.stats["ranks"]] == [0, 1]
    assert second.stats["ranks"][1]["eager_steps"] == {"no CUDA": 3}  # the worker decoded every step too
    assert second.stats["parallel"] == {"world": 2, "cfg_groups": 1, "sp": 2, "backend": "gloo"}


def test_two_processes_edit_and_cfg(model, generator, tiny_models, reference_image):
    """An edit (reference latents in the prefix) and true CFG (cond on rank 0, uncond on rank 1) equal one device."""
    from graph_runtime.encoding.images import encode_pixels, prepare_references

    ref = prepare_references([reference_image], 128)[0]
    edit = SamplingRequest(positive=generator.encoder.encode("make it winter", [ref.vision_image]),
                           reference_latents=[encode_pixels(tiny_models.vae, ref.vae_pixels)], latent_height=8,
                           latent_width=8, steps=3, seed=5)
    assert _max_diff(sample_on_devices(loaded_for(model), edit, gpus=2).latents, _one_device(model, edit)) <= ATOL
    cfg = _request(generator, negative=generator.encoder.encode("blurry"), cfg=4.0, seed=2)
    result = sample_on_devices(loaded_for(model), cfg, gpus=2)
    assert result.stats["parallel"]["cfg_groups"] == 2
    assert _max_diff(result.latents, _one_device(model, cfg)) <= ATOL


def test_workers_receive_merged_lora_weights(model, generator, tmp_path):
    """A LoRA merged into rank 0's weights reaches the workers before the next prompt (they hold no files), and
    restoring the original weights reaches them too."""
    from graph_runtime.lora import LoraChoice, read_lora
    from graph_runtime.lora.tiny import write_tiny_lora

    lora = read_lora(write_tiny_lora(tmp_path / "style.safetensors"), model)
    request = _request(generator, seed=4)
    plain = _one_device(model, request)
    with loaded_for(model).loras_in_use([LoraChoice(lora, 1.0)]):
        merged_expected = _one_device(model, request)
        merged = sample_on_devices(loaded_for(model), request, gpus=2).latents
    assert _max_diff(merged, merged_expected) <= ATOL and _max_diff(merged, plain) > 1e-2
    with loaded_for(model).loras_in_use([]):
        assert _max_diff(sample_on_devices(loaded_for(model), request, gpus=2).latents, plain) <= ATOL


def test_cancel_and_failing_progress_callback_stop_every_rank_in_step(model, generator):
    """A stop asked on rank 0 stops every rank before the same step; a progress callback that raises is raised
    after the ranks stopped together. Either way the workers stay up for the next prompt."""
    runtime = loaded_for(model).parallel_runtime(2)
    request = _request(generator, seed=6, steps=4)
    steps = []
    with pytest.raises(Cancelled, match="before step 3 of 4"):
        sample_on_devices(loaded_for(model), request, gpus=2, on_step=lambda s, t, l: steps.append(s),
                          should_stop=lambda: len(steps) == 2)

    class Interrupted(Exception):
        pass

    def interrupt(step, total, latents):
        if step == 2:
            raise Interrupted("user pressed cancel")

    with pytest.raises(Interrupted):
        sample_on_devices(loaded_for(model), request, gpus=2, on_step=interrupt)
    pids = runtime.status()["pids"]
    assert _max_diff(sample_on_devices(loaded_for(model), request, gpus=2).latents, _one_device(model, request)) <= ATOL
    assert runtime.status()["pids"] == pids and runtime.failures == 0


def test_killed_worker_fails_the_prompt_clearly_and_the_next_prompt_restarts(model, generator):
    """A worker killed mid-prompt: the prompt fails within the collective timeout with a message naming the rank
    and the signal, and the next prompt starts a new worker and gives the one-device latents."""
    runtime = loaded_for(model).parallel_runtime(2)
    request = _request(generator, seed=8, steps=4)
    sample_on_devices(loaded_for(model), request, gpus=2)  # the ranks are up
    pid, = runtime.status()["pids"]
    started = time.monotonic()
    with pytest.raises(ParallelFailure, match=r"rank 1 \(cpu\) was killed by signal SIGKILL.*next prompt starts"):
        sample_on_devices(loaded_for(model), request, gpus=2, on_step=kill_at_step(pid, 2))
    assert time.monotonic() - started < TIMEOUT_S
    assert runtime.failures == 1 and not runtime.status()["running"]
    result = sample_on_devices(loaded_for(model), request, gpus=2)
    assert _max_diff(result.latents, _one_device(model, request)) <= ATOL
    assert runtime.starts == 2 and runtime.status()["pids"] != [pid]


def test_four_processes_sequence_and_cfg_parallel(generator):
    """Four ranks on a 4-head transformer: text-to-image splits the rows four ways; with CFG, two ranks per branch
    split the rows two ways. Both equal one device."""
    torch.manual_seed(7)
    transformer = random_tiny_transformer({**TINY_TRANSFORMER, "num_attention_heads": 4})
    try:
        t2i = _request(generator, seed=3)
        result = sample_on_devices(loaded_for(transformer), t2i, gpus=4)
        assert result.stats["parallel"]["sp"] == 4 and len(result.stats["ranks"]) == 4
        assert _max_diff(result.latents, _one_device(transformer, t2i)) <= ATOL
        cfg = _request(generator, negative=generator.encoder.encode("blurry"), cfg=3.0, seed=9)
        result = sample_on_devices(loaded_for(transformer), cfg, gpus=4)
        assert (result.stats["parallel"]["cfg_groups"], result.stats["parallel"]["sp"]) == (2, 2)
        assert _max_diff(result.latents, _one_device(transformer, cfg)) <= ATOL
    finally:
        loaded_for(transformer).shutdown_parallel()


def test_start_failure_falls_back_to_one_device_with_the_reason_logged(generator, tiny_models, monkeypatch, caplog):
    """When the ranks cannot be started, prompts run on this process's device alone (correct latents) and the
    reason is logged once and shown in the status; no worker is left behind."""
    transformer = copy.deepcopy(tiny_models.transformer)

    def no_launch(self):
        raise OSError("no python executable for the workers")

    monkeypatch.setattr(runtime_module.RankSet, "_launch", no_launch)
    request = _request(generator, seed=2, decode_mode="eager")
    with caplog.at_level(logging.WARNING, logger="kvgraph"):
        first = sample_on_devices(loaded_for(transformer), request, gpus=2)
        second = sample_on_devices(loaded_for(transformer), request, gpus=2)
    assert _max_diff(first.latents, _one_device(transformer, request)) <= ATOL and "ranks" not in second.stats
    status = loaded_for(transformer).parallel_runtime(2).status()
    assert "no python executable" in status["fallback_reason"] and not status["running"]
    assert sum("could not start 2 ranks" in r.message for r in caplog.records) == 1


def test_counts_the_model_cannot_split_are_refused_by_name(model, generator):
    """The heads (2 on the tiny model) must split evenly: 4 devices are refused naming `gpus`, before any start."""
    with pytest.raises(InputError, match=r"gpus=4 is invalid: expected a count that divides .* 2 attention heads"):
        sample_on_devices(loaded_for(model), _request(generator), gpus=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_started_elsewhere_joins_through_the_rendezvous_variables(generator, tiny_models, monkeypatch):
    """A rank this process does not start (KVGRAPH_LOCAL_RANKS=1 of 2: as on another host) joins with
    torch.distributed's env:// variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) and gets the weights by
    broadcast."""
    transformer = copy.deepcopy(tiny_models.transformer)
    port = _free_port()
    monkeypatch.setenv("KVGRAPH_LOCAL_RANKS", "1")
    monkeypatch.setenv("KVGRAPH_MASTER_PORT", str(port))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "1",
           "KVGRAPH_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    remote = subprocess.Popen([sys.executable, "-m", "graph_runtime.parallel.worker"], env=env)
    try:
        request = _request(generator, seed=12)
        result = sample_on_devices(loaded_for(transformer), request, gpus=2)
        assert result.stats["ranks"][1]["device"] == "another host"
        assert _max_diff(result.latents, _one_device(transformer, request)) <= ATOL
        loaded_for(transformer).shutdown_parallel()
        assert remote.wait(30) == 0  # told to stop, it exits cleanly
    finally:
        if remote.poll() is None:
            remote.kill()
