"""What a fresh process's first prompt sets up, on the GPU (run on the H200: `pytest -m gpu`).

- Our Triton kernels compile one variant each whatever the prompt length, and a restart with the same on-disk cache
  compiles none (counted as `.cubin` files in a private `TRITON_CACHE_DIR`, in fresh interpreters).
- A decode graph of uncompiled blocks is captured after one warm-up, not two.
- `warm_up` before the first prompt: uncaptured it keeps nothing; capturing, a prompt of that length replays from
  its first step and equals the eager decode. The tiny model runs in fp32: graph and eager differ by fp32
  round-off only (1e-5, as in test_gpu_decode.py).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from graph_runtime.decode import DecodeEngine, TokenLayout
from graph_runtime.sampling.sampler import initial_noise, pack

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
GRAPH_ATOL = 1e-5

KERNELS_AT_TWO_LENGTHS = textwrap.dedent("""
    import json, os, torch
    from graph_runtime.kernels.norm_modulate import _triton_norm_modulate
    from graph_runtime.kernels.qk_norm_rope import _triton_qk_norm_rope_write
    from graph_runtime.kernels.silu_mul import _triton_silu_mul

    def cubins():
        return sum(n.endswith(".cubin") for _, _, files in os.walk(os.environ["TRITON_CACHE_DIR"]) for n in files)

    counts = []
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for tokens, prefix in [(48, 128), (37, 137)]:  # multiples of 16 and not: what integer specialization splits
        x = torch.randn(1, tokens, 4096, **bf16)
        modulation = torch.randn(1, 4 * 4096, **bf16)
        scale, gate = modulation[:, :4096], modulation[:, 4096:8192]
        _triton_norm_modulate(x, None, None, scale, 1e-6)
        _triton_norm_modulate(x, torch.randn_like(x), gate, scale, 1e-6)
        _triton_silu_mul(torch.randn(1, tokens, 12288, **bf16), torch.randn(1, tokens, 12288, **bf16))
        q, k, v = (torch.randn(1, tokens, 32, 128, **bf16) for _ in range(3))
        caches = [torch.zeros(1, prefix + tokens, 32, 128, **bf16) for _ in range(2)]
        angles = torch.randn(tokens, 1, 64, device="cuda")
        w = torch.ones(128, **bf16)
        _triton_qk_norm_rope_write(q, k, v, w, w, angles.cos(), angles.sin(), *caches, prefix, 1e-6)
        torch.cuda.synchronize()
        counts.append(cubins())
    print(json.dumps(counts))
""")


def _fresh_process_counts(cache_dir) -> list[int]:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", KERNELS_AT_TWO_LENGTHS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_compile_once_for_every_length_and_a_restart_compiles_nothing(tmp_path):
    first_process = _fresh_process_counts(tmp_path)
    assert first_process[0] >= 4  # norm (with and without the residual), SwiGLU, q/k norm + RoPE
    assert first_process[1] == first_process[0], "a second prompt length compiled new kernel variants"
    restart = _fresh_process_counts(tmp_path)
    assert restart == [first_process[1]] * 2, "a restart with a filled cache compiled kernels again"


PRELOAD_THEN_LAUNCH = textwrap.dedent("""
    import json, torch
    from triton.runtime.cache import triton_key
    from graph_runtime.kernels.norm_modulate import _triton_norm_modulate, reference_norm_modulate
    from graph_runtime.kernels.preload import preload_result, start_preload, wait_for_preload

    assert start_preload() and start_preload()
    wait_for_preload()
    keyed = triton_key.cache_info().currsize
    x = torch.randn(2, 40, 4096, device="cuda", dtype=torch.bfloat16)
    scale = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    out = _triton_norm_modulate(x, None, None, scale, 1e-6)[1].float()
    ref = reference_norm_modulate(x, None, None, scale, 1e-6)[1].float()
    within = bool(((out - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all())
    print(json.dumps({"result": preload_result(), "keyed": keyed, "within": within}))
""")


def test_the_preload_sets_triton_up_in_a_fresh_process_and_kernels_then_run_as_before(tmp_path):
    """In a fresh interpreter the preload thread succeeds (Triton, then the CUDA libraries), leaves Triton's cache
    key computed (what the first launch would otherwise pay), and a kernel launched after it equals the reference
    within one bf16 step, as in test_gpu_kernels.py."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PRELOAD_THEN_LAUNCH], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["result"]["ok"] is True, report
    assert "libraries_error" not in report["result"] and report["result"]["libraries_seconds"] > 0, report
    assert report["keyed"] == 1
    assert report["within"] is True


@pytest.fixture(scope="module")
def cuda_transformer(tiny_parts):
    import copy

    return copy.deepcopy(tiny_parts["transformer"]).to("cuda")


def _request(generator, engine, prompt, mode="auto", steps=4):
    """One prompt's prefill and `steps` decode steps at a fixed timestep grid; returns outcomes and predictions."""
    embeds = generator.encoder.encode(prompt)
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 8)], "cuda")
    latents = pack(initial_noise(0, 1, 64, 8, 8, torch.float32)).cuda()
    outcomes = []
    with torch.no_grad():
        _, prefix = engine.prefill(layout, latents, embeds.embeds.cuda(), torch.ones(1, device="cuda"), mode=mode,
                                   with_target=False)
        for i in range(steps):
            t = torch.full((1,), 1.0 - i / steps, device="cuda")
            outcomes.append(engine.decode_step(prefix, latents, t, mode))
    prefix.release()
    return embeds.embeds.shape[1], outcomes


def test_decode_capture_of_plain_blocks_takes_one_warm_up(cuda_transformer, generator):
    engine = DecodeEngine(cuda_transformer)
    _, outcomes = _request(generator, engine, "a red cube")
    assert outcomes[0].path == "capture"
    (entry,) = engine.graphs.entries.values()
    assert entry.warmups == 1 and entry.warmup_seconds > 0


def test_uncaptured_warm_up_keeps_nothing(cuda_transformer, generator):
    engine = DecodeEngine(cuda_transformer)
    done = engine.warm_up([(8, 8)], prompt_tokens=20)
    assert done["sizes"][0]["path"] == "uncaptured" and not engine.graphs.entries
    assert engine.graphs.stats.captures == 0 and engine.graphs.stats.prefill_captures == 0
    _, outcomes = _request(generator, engine, "a red cube")
    assert outcomes[0].path == "capture"


def test_capturing_warm_up_lets_the_first_prompt_of_that_length_replay_and_match_eager(cuda_transformer,
                                                                                        generator):
    tokens, eager = _request(generator, DecodeEngine(cuda_transformer), "a red cube", mode="eager")
    engine = DecodeEngine(cuda_transformer)
    assert engine.warm_up([(8, 8)], prompt_tokens=tokens, capture=True)["sizes"][0]["path"] == "capture"
    # The warm-up's own prefix pass is captured and then replayed once to fill the entry; the prompt adds one replay.
    captures, prefill_replays = engine.graphs.stats.captures, engine.graphs.stats.prefill_replays
    _, outcomes = _request(generator, engine, "a red cube")
    assert [o.path for o in outcomes] == ["replay"] * 4
    assert engine.graphs.stats.captures == captures and engine.graphs.stats.prefill_captures == 1
    assert engine.graphs.stats.prefill_replays == prefill_replays + 1
    for graph, reference in zip(outcomes, eager):
        assert (graph.output - reference.output).abs().max().item() <= GRAPH_ATOL
