"""Sequence-parallel (Ulysses) and CFG-parallel decoding against one device, ranks as threads over gloo.

Tolerance: fp32 on CPU. Every rank runs the one-device math on its share of the rows (norms, projections, MLP) or
of the heads (attention over the whole sequence), so the only difference is how the CPU's GEMM blocks a matrix of
fewer rows: a few ulps (1e-6 here). 1e-5 absolute on latents of magnitude ~5 leaves room for another blocking, while
a wrong row split, head order, RoPE row or prefix K/V moves them by 1e-1 or more.
"""

import pytest
import torch

from graph_runtime.decode import DecodeEngine
from graph_runtime.parallel.engine import REMOTE, ParallelEngine
from graph_runtime.parallel.plan import ParallelPlan, plan_for
from graph_runtime.sampling.sampler import SamplingRequest, sample
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer

from .parallel_helpers import run_ranks
from .test_graph_manager import RecordingBackend

ATOL = 1e-5


@pytest.fixture(scope="module")
def four_heads():
    """The tiny transformer with 4 heads of 16, so that 4 ranks can each take one."""
    torch.manual_seed(7)
    return random_tiny_transformer({**TINY_TRANSFORMER, "num_attention_heads": 4})


def _request(generator, height=8, width=8, **kw):
    kw.setdefault("steps", 3)
    kw.setdefault("decode_mode", "eager")
    return SamplingRequest(positive=generator.encoder.encode(kw.pop("prompt", "a red cube")), latent_height=height,
                           latent_width=width, **kw)


def _parallel(transformer, world, request, backend_factory=None, requests=1):
    plan = plan_for(world, request.do_cfg)

    def rank_fn(rank, groups):
        engine = ParallelEngine(transformer, plan, rank, groups.sp(plan), groups.cfg(plan),
                                backend=backend_factory() if backend_factory else None)
        return [sample(engine, request) for _ in range(requests)], engine

    return run_ranks(world, rank_fn)


def _max_diff(a, b):
    return (a - b).abs().max().item()


def test_two_ranks_text_to_image_equal_one_device(tiny_models, generator):
    """Two sequence-parallel ranks (each half the image's rows, each one of the two heads in attention) give the
    one-device latents, on both ranks."""
    request = _request(generator, seed=3)
    single = sample(DecodeEngine(tiny_models.transformer), request).latents
    ranks = _parallel(tiny_models.transformer, 2, request)
    for results, _ in ranks:
        assert _max_diff(results[0].latents, single) <= ATOL
    assert ranks[0][0][0].paths == ["eager"] * 3  # no CUDA here: every step eager, each once per rank


def test_four_ranks_uneven_rows_and_batch_equal_one_device(four_heads, generator):
    """Four ranks over 7x9 = 63 image tokens (16, 16, 16, 15 rows) and a batch of two: rows split unevenly and
    gathered back in order."""
    request = _request(generator, height=7, width=9, batch_size=2, seed=11)
    single = sample(DecodeEngine(four_heads), request).latents
    for results, engine in _parallel(four_heads, 4, request):
        assert engine.exchange.size == 4
        assert _max_diff(results[0].latents, single) <= ATOL


def test_two_ranks_edit_equal_one_device(tiny_models, generator, reference_image):
    """An edit: the reference's latent tokens are prefix rows, split over the ranks in the prefix pass like the
    text's, and its K/V (each rank's heads) read by every decode step."""
    from graph_runtime.encoding.images import encode_pixels, prepare_references

    ref = prepare_references([reference_image], 128)[0]
    request = SamplingRequest(positive=generator.encoder.encode("make it winter", [ref.vision_image]),
                              reference_latents=[encode_pixels(tiny_models.vae, ref.vae_pixels)], latent_height=8,
                              latent_width=8, steps=3, seed=5, decode_mode="eager")
    single = sample(DecodeEngine(tiny_models.transformer), request).latents
    for results, _ in _parallel(tiny_models.transformer, 2, request):
        assert _max_diff(results[0].latents, single) <= ATOL


@pytest.mark.parametrize("world", [2, 4])
def test_cfg_parallel_equal_one_device(tiny_models, generator, world):
    """True CFG: cond on the first half of the ranks, uncond on the second (2 ranks: one branch each; 4 ranks: two
    sequence-parallel ranks per branch), the predictions exchanged once per step and combined on every rank."""
    request = _request(generator, negative=generator.encoder.encode("blurry"), cfg=4.0, seed=2)
    single = sample(DecodeEngine(tiny_models.transformer), request).latents
    ranks = _parallel(tiny_models.transformer, world, request)
    assert ranks[0][1].plan == ParallelPlan(world, 2)
    for rank, (results, _) in enumerate(ranks):
        assert _max_diff(results[0].latents, single) <= ATOL
        mine = "eager"
        # Each step lists cond then uncond; the branch the other group computed shows as remote.
        expected = [mine, REMOTE] if rank < world // 2 else [REMOTE, mine]
        assert results[0].paths == expected * 3


def test_graph_path_per_rank_keys_buffers_and_reuse(tiny_models, generator):
    """Through the graph path (a recording backend that 'captures' and 'replays' the body on CPU): each rank
    captures its own entry once, keyed by world size and rank, whose K/V buffers hold its heads only; the
    captures' warm-ups rehearse the collectives (no rank waits on another), the latents equal one device's, and a
    second request on the same engines captures nothing."""
    request = _request(generator, decode_mode="graph", seed=4)
    single = sample(DecodeEngine(tiny_models.transformer), _request(generator, seed=4)).latents
    ranks = _parallel(tiny_models.transformer, 2, request, backend_factory=RecordingBackend, requests=2)
    heads = tiny_models.transformer.config.num_attention_heads
    for rank, (results, engine) in enumerate(ranks):
        first, second = results
        assert first.stats["captures"] == 1 and first.stats["replays"] == 3 and not first.stats["eager_steps"]
        assert second.stats["captures"] == 0 and second.stats["replays"] == 3
        assert _max_diff(first.latents, single) <= ATOL and torch.equal(first.latents, second.latents)
        (key, entry), = engine.local.graphs.entries.items()
        assert dict(key.parallel) == {"world": 2, "rank": rank, "cfg_groups": 1, "sp": 2, "sp_rank": rank}
        assert entry.inputs.k[0].shape[2] == heads // 2


def test_prefix_kv_kept_by_head(tiny_models, generator):
    """Each rank's prefix K/V are the one-device K/V of its heads (rank i: heads i*H/n..), for every prefix row."""
    from graph_runtime.decode import TokenLayout
    from graph_runtime.sampling.sampler import initial_noise, pack

    embeds = generator.encoder.encode("a red cube on a blue sphere")
    layout = TokenLayout.build(embeds.image_mask, [(1, 8, 8)], "cpu")
    latents = pack(initial_noise(0, 1, 64, 8, 8, torch.float32))
    t = torch.full((1,), 0.7)
    _, whole = DecodeEngine(tiny_models.transformer).prefill(layout, latents, embeds.embeds, t, with_target=False)
    plan = ParallelPlan(2)

    def rank_fn(rank, groups):
        engine = ParallelEngine(tiny_models.transformer, plan, rank, groups.sp(plan), None)
        return engine.prefill(layout, latents, embeds.embeds, t, mode="eager")[1]

    for rank, prefix in enumerate(run_ranks(2, rank_fn)):
        for block in range(len(whole.k)):
            assert _max_diff(prefix.k[block], whole.k[block][:, :, rank:rank + 1]) <= ATOL
            assert _max_diff(prefix.v[block], whole.v[block][:, :, rank:rank + 1]) <= ATOL
