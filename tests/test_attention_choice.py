"""The decode step's attention kernel: FlashAttention-3 where it runs (Hopper, bf16, installed), SDPA elsewhere; each
fallback logged once and counted; the prefix pass's block-causal mask run segment by segment."""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from graph_runtime.decode import attention
from graph_runtime.decode.attention import AttentionChoice, Fa3Attention, PrefixMask, choose
from graph_runtime.decode.engine import DecodeEngine
from graph_runtime.decode.layout import TokenLayout
from graph_runtime.tiny import random_tiny_transformer


def _fa3_on_cpu(q, k, v, causal=False):
    """FlashAttention-3's forward semantics in plain torch: `[B, S, H, D]` in and out, the causal mask aligned to the
    bottom-right corner (query i sees keys up to i + L - S)."""
    s, n = q.shape[1], k.shape[1]
    mask = None
    if causal:
        mask = torch.ones(s, n, dtype=torch.bool).tril(n - s)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2), None


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device that reports compute capability 9.0 (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention, "_logged", set())


def test_cpu_and_other_gpus_run_sdpa_with_their_reason(monkeypatch):
    """A CPU device, a non-Hopper GPU and a non-bf16 dtype each get SDPA and the reason; asking for SDPA gives it
    with no reason; an unknown request is refused naming the choices."""
    backend, reason = choose(torch.device("cpu"), torch.bfloat16)
    assert backend.name == "sdpa" and reason == attention.NOT_CUDA
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert choose(torch.device("cuda"), torch.bfloat16)[1] == attention.NOT_HOPPER
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose(torch.device("cuda"), torch.float16)[1] == attention.NOT_BF16
    assert choose(torch.device("cuda"), torch.bfloat16, "sdpa") == (attention.SDPA_ATTENTION, None)
    with pytest.raises(ValueError, match="expected one of auto, sdpa, fa3"):
        choose(torch.device("cuda"), torch.bfloat16, "flash")


def test_hopper_without_fa3_installed_runs_sdpa_logged_once_and_counted(hopper, caplog):
    """On Hopper with no FlashAttention-3 package (this machine has none), the real loader's failure becomes SDPA;
    the reason is logged once per process however many models choose, and each choice is counted."""
    assert attention._load_fa3() == (None, attention.NOT_INSTALLED)
    first, second = AttentionChoice(), AttentionChoice()
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        for choice in (first, second):
            assert choice.pick(torch.device("cuda:0"), torch.bfloat16).name == "sdpa"
            assert choice.pick(torch.device("cuda:0"), torch.bfloat16).name == "sdpa"  # kept, not chosen again
    lines = [r.getMessage() for r in caplog.records if attention.NOT_INSTALLED in r.getMessage()]
    assert len(lines) == 1, lines
    assert first.fallbacks == {attention.NOT_INSTALLED: 1} and second.fallbacks == {attention.NOT_INSTALLED: 1}
    assert first.chosen() == {"cuda:0 bfloat16": "sdpa"}


def test_hopper_with_fa3_takes_it_and_names_it_in_graph_keys(hopper):
    """With FlashAttention-3 loadable on a Hopper device, the step's variant (a graph key's backend part) names it,
    nothing is counted as a fallback, and the engine's statistics show the choice; on the CPU the same step runs
    SDPA and counts why."""
    model = random_tiny_transformer().to(torch.bfloat16)
    engine = DecodeEngine(model)
    engine.step.attention = AttentionChoice(loader=lambda: (_fa3_on_cpu, None))
    engine.stats.attention_choice = engine.step.attention
    assert engine.step.variant(torch.device("cuda:0")).startswith("fa3+")
    assert engine.step.variant(torch.device("cpu")).startswith("sdpa+")
    snapshot = engine.stats.snapshot()
    assert snapshot["attention"] == {"cuda:0 bfloat16": "fa3", "cpu bfloat16": "sdpa"}
    assert snapshot["attention_fallbacks"] == {attention.NOT_CUDA: 1}


def test_asking_for_sdpa_keeps_sdpa_on_hopper(hopper):
    """`attention="sdpa"` (the benchmark's SDPA paths) keeps SDPA on a device where FA3 would run, no fallback
    counted."""
    choice = AttentionChoice("sdpa", loader=lambda: (_fa3_on_cpu, None))
    assert choice.pick(torch.device("cuda:0"), torch.bfloat16).name == "sdpa" and not choice.fallbacks


def test_prefix_segments_run_by_fa3_equal_the_dense_block_causal_mask():
    """The prefix pass's mask run one segment at a time through FA3's (bottom-right causal) kernel gives SDPA's
    result under the dense block-causal mask: text segments causal, image segments over every key up to their end.
    fp32 on the CPU: the two compute the same sums in a different grouping, so they agree to 1e-5."""
    segments = ((0, 5, True), (5, 9, False), (9, 14, True), (14, 20, False))
    dense = TokenLayout.prefix_attention_mask(SimpleNamespace(prefix_len=20, segments=segments), "cpu")[None, None]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 20, 3, 8, generator=g) for _ in range(3))
    mask = PrefixMask(dense, segments)
    want = attention.sdpa(q, k, v, mask)
    got = Fa3Attention(_fa3_on_cpu)(q, k, v, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Without segments (key padding), and for any plain tensor mask, the FA3 backend runs SDPA on the dense mask.
    padded = PrefixMask(dense & (torch.arange(20) < 18), None)
    torch.testing.assert_close(Fa3Attention(_fa3_on_cpu)(q, k, v, padded), attention.sdpa(q, k, v, padded.dense))
    # No mask: the whole of it in one call.
    torch.testing.assert_close(Fa3Attention(_fa3_on_cpu)(q, k, v, None), attention.sdpa(q, k, v, None))


def test_an_engine_on_fa3_gives_the_sdpa_engines_prefix_and_steps(tiny_models, generator, reference_image,
                                                                   monkeypatch):
    """Through the whole engine (prefix pass with a reference image, then a decode step), an engine whose attention
    is FA3 (its semantics emulated on the CPU) computes the SDPA engine's prefix K/V and prediction: the prefix pass
    hands FA3 the layout's segments, text segments causal and image segments not, and every block runs the kernel the
    step chose. fp32 on the CPU; the two split attention into different calls, so 1e-4 as in test_cached_decode."""
    from tests.test_cached_decode import lamp_request

    calls = []

    def recording_fa3(q, k, v, causal=False):
        calls.append(causal)
        return _fa3_on_cpu(q, k, v, causal)

    transformer = tiny_models.transformer
    layout, hidden, embeds, latents = lamp_request(tiny_models, generator, [reference_image])
    t = torch.full((1,), 0.9)
    results = {}
    for name in ("sdpa", "fa3"):
        if name == "fa3":
            monkeypatch.setattr(attention, "choose",
                                lambda device, dtype, requested, loader: (Fa3Attention(recording_fa3), None))
        engine = DecodeEngine(transformer)
        with torch.no_grad():
            _, prefix = engine.prefill(layout, hidden, embeds.embeds, t, with_target=False)
            out = engine.decode_step(prefix, latents, t, mode="eager").output
        results[name] = (prefix.k + prefix.v, out)
        assert engine.step.variant().startswith(name)
    blocks = len(transformer.transformer_blocks)
    texts = [is_text for _, _, is_text in layout.segments]
    # The prefix pass by segment (its last block only writes K/V: no attention), then one call per decode block.
    assert calls == texts * (blocks - 1) + [False] * blocks
    assert True in texts and False in texts
    for a, b in zip(*(results[n][0] for n in ("sdpa", "fa3"))):
        assert (a - b).abs().max().item() <= 1e-4
    assert (results["sdpa"][1] - results["fa3"][1]).abs().max().item() <= 1e-4
