"""Several GPUs (run on a machine with 2 or more: `pytest -m gpu tests/gpu/test_gpu_parallel.py`): NCCL groups,
each rank capturing its own decode graph with the all-to-alls and the gather inside, replayed by the next prompt.

The tiny model runs in fp32 so the tolerances are about the parallel mechanics: ranks run the one-GPU kernels on a
share of the rows, where cuBLAS may pick another kernel for the smaller matrices (round-off, ~1e-6 on values ~1-5),
and the graph path reads the static K/V buffer where the one-GPU eager reference concatenates (SDPA may pick another
kernel): 1e-4 absolute. A wrong row, head or prefix moves the latents by 1e-1 or more.
"""

import copy
import time

import pytest
import torch

from graph_runtime.decode import DecodeEngine
from graph_runtime.parallel import ParallelFailure, sample_on_devices
from tests.owners import loaded_for
from graph_runtime.sampling.sampler import SamplingRequest, sample
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer

from ..parallel_helpers import kill_at_step

pytestmark = pytest.mark.gpu
ATOL = 1e-4


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (a several-GPU machine)")
needs_four = pytest.mark.skipif(_gpus() < 4, reason="needs 4 CUDA GPUs")


@pytest.fixture(autouse=True)
def timeout(monkeypatch):
    monkeypatch.setenv("KVGRAPH_PARALLEL_TIMEOUT", "120")


@pytest.fixture()
def model(cuda_models):
    transformer = copy.deepcopy(cuda_models.transformer).requires_grad_(False)
    yield transformer
    loaded_for(transformer).shutdown_parallel()


def _request(cuda_models, generator_text, **kw):
    kw.setdefault("steps", 4)
    return SamplingRequest(positive=generator_text("a red cube"), latent_height=kw.pop("height", 16),
                           latent_width=kw.pop("width", 16), decode_mode="graph", **kw)


@pytest.fixture(scope="module")
def encode(cuda_models):
    from graph_runtime.encoding.prompt import PromptEncoder

    encoder = PromptEncoder(cuda_models.text_encoder, cuda_models.processor)
    return lambda text: encoder.encode(text, device="cuda")


def _one_gpu(transformer, request):
    return sample(DecodeEngine(transformer), request)


@needs_two
def test_two_gpus_capture_per_rank_and_replay_on_the_next_prompt(model, cuda_models, encode):
    """Each rank captures its decode graph (and prefix pass) on the first prompt and the second prompt captures
    nothing on any rank; both equal one GPU's graph-replayed latents."""
    request = _request(cuda_models, encode, seed=3)
    expected = _one_gpu(model, request).latents
    first = sample_on_devices(loaded_for(model), request, gpus=2)
    second = sample_on_devices(loaded_for(model), request, gpus=2)
    assert [r["captures"] for r in first.stats["ranks"]] == [1, 1]
    assert [r["captures"] for r in second.stats["ranks"]] == [0, 0]
    assert [r["replays"] for r in second.stats["ranks"]] == [4, 4]
    assert all(not r["eager_steps"] for r in second.stats["ranks"])
    assert second.stats["parallel"]["backend"] == "nccl"
    assert (first.latents - expected).abs().max().item() <= ATOL
    assert torch.equal(first.latents, second.latents)
    entries = loaded_for(model).parallel_runtime(2).status()["rank0_graphs"][0]["entries"]
    assert entries[0]["key"]["parallel"]["world"] == 2 and entries[0]["key"]["parallel"]["rank"] == 0


@needs_two
def test_two_gpus_cfg_parallel(model, cuda_models, encode):
    """True CFG with one branch per GPU equals one GPU's CFG."""
    request = _request(cuda_models, encode, negative=encode("blurry"), cfg=4.0, seed=5)
    result = sample_on_devices(loaded_for(model), request, gpus=2)
    assert result.stats["parallel"]["cfg_groups"] == 2
    assert (result.latents - _one_gpu(model, request).latents).abs().max().item() <= ATOL


@needs_four
def test_four_gpus_sequence_parallel(cuda_models, encode):
    """Four ranks over a 4-head tiny transformer (rows split four ways), graphs on every rank."""
    torch.manual_seed(7)
    transformer = random_tiny_transformer({**TINY_TRANSFORMER, "num_attention_heads": 4}).cuda()
    try:
        request = _request(cuda_models, encode, seed=9)
        result = sample_on_devices(loaded_for(transformer), request, gpus=4)
        assert [r["captures"] for r in result.stats["ranks"]] == [1, 1, 1, 1]
        assert (result.latents - _one_gpu(transformer, request).latents).abs().max().item() <= ATOL
    finally:
        loaded_for(transformer).shutdown_parallel()


@needs_two
def test_killed_gpu_worker_fails_the_prompt_and_the_next_one_restarts(model, cuda_models, encode):
    """A worker killed between replays: rank 0's device wait sees it (its replay's collectives never finish) and
    the prompt fails within the timeout naming the rank; the next prompt starts the ranks again."""
    request = _request(cuda_models, encode, seed=6, steps=6)
    sample_on_devices(loaded_for(model), request, gpus=2)
    runtime = loaded_for(model).parallel_runtime(2)
    pid, = runtime.status()["pids"]
    started = time.monotonic()
    with pytest.raises(ParallelFailure, match=r"rank 1 \(cuda:\d\) was killed by signal SIGKILL"):
        sample_on_devices(loaded_for(model), request, gpus=2, on_step=kill_at_step(pid, 2))
    assert time.monotonic() - started < 120
    again = sample_on_devices(loaded_for(model), request, gpus=2)
    assert runtime.starts == 2 and (again.latents - _one_gpu(model, request).latents).abs().max().item() <= ATOL
