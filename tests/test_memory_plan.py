"""The memory planner (graph_runtime/memory/plan.py) on the full-size model's sizes, CPU only: a table of cards x
precisions x references x batch x CFG, each plan checked against invariants rather than fixed figures."""

import dataclasses
import itertools
import re
from pathlib import Path

import pytest
import torch

from graph_runtime.memory import plan as plans
from graph_runtime.memory import plan_table
from graph_runtime.memory.sizes import GiB, estimate, fitting_estimate, kv_bytes_per_token

CARDS_GB = (8, 12, 16, 24, 48, 80)
PRECISIONS = ("bf16", "int8")
REFERENCES = (0, 1, 2, 10)
BATCHES = (1, 2)
CFG = (False, True)
HOST = 128 * GiB


@pytest.fixture(scope="module")
def sizes():
    return {p: plans.ModelSizes.standard(p) for p in PRECISIONS}


@pytest.fixture(scope="module")
def table(sizes):
    """Every case's plan, keyed by (card GB, precision, references, batch, cfg)."""
    out = {}
    for card, precision, refs, batch, cfg in itertools.product(CARDS_GB, PRECISIONS, REFERENCES, BATCHES, CFG):
        shape = plans.request_shape(1024, 1024, batch=batch, cfg=cfg, references=refs)
        out[card, precision, refs, batch, cfg] = plans.plan_memory(sizes[precision], shape, card * GiB, HOST)
    return out


def _weights(s: plans.ModelSizes) -> dict:
    return {"transformer": s.transformer_bytes, "VAE": s.vae.weight_bytes}


def test_every_fitting_plan_fits_its_budget_and_accounts_for_every_block(table):
    """A plan that fits needs no more GPU bytes (margin included) than available, no more host bytes than the host
    has; resident + streamed blocks are all the blocks; the GPU parts add up to its total."""
    fitting = 0
    for (card, *_), plan in table.items():
        assert plan.resident_blocks + plan.streamed_blocks == plan.blocks == 32
        assert 0 <= plan.resident_blocks <= plan.blocks
        assert plan.gpu_bytes == sum(n for _, n in plan.budget.parts) + plan.budget.margin
        assert plan.prefix_placement in plans.PREFIX_PLACEMENTS
        if plan.fits:
            fitting += 1
            assert plan.gpu_bytes <= card * GiB and plan.new_host_bytes <= HOST
    assert fitting > len(table) // 2  # the table is not vacuous


def test_whole_gpu_wherever_todays_check_fits(table, sizes):
    """No regression: where today's budget (sizes.fitting_estimate) fits, the plan is whole (every block resident,
    prefix on the GPU) and needs exactly today's bytes, with the same VAE decode."""
    whole = 0
    for (card, precision, refs, batch, cfg), plan in table.items():
        s = sizes[precision]
        shape = plans.request_shape(1024, 1024, batch=batch, cfg=cfg, references=refs)
        today = fitting_estimate(s.dims, shape, _weights(s), s.vae, card * GiB)
        if today.total <= card * GiB:
            whole += 1
            assert plan.fits and plan.whole, (card, precision, refs, batch, cfg)
            assert plan.gpu_bytes == today.total and (plan.vae_decode == "tiled") == today.vae_tiled
            assert plan.upload_bytes == 0
    assert 0 < whole < len(table)


def test_a_bigger_card_never_gives_a_slower_or_smaller_plan(table):
    """Along the cards, for one request: once a plan fits it keeps fitting, the estimated step never grows (except
    where the smaller card's plan recomputes the prefix: the last resort, left as soon as a kept prefix fits), and
    with the same prefix placement the resident blocks never shrink."""
    for precision, refs, batch, cfg in itertools.product(PRECISIONS, REFERENCES, BATCHES, CFG):
        row = [table[card, precision, refs, batch, cfg] for card in CARDS_GB]
        for small, big in zip(row, row[1:]):
            if small.fits:
                assert big.fits
                if small.prefix_placement != "recompute":
                    assert big.step_ms <= small.step_ms + 1e-9, (precision, refs, batch, cfg)
                if big.prefix_placement == small.prefix_placement:
                    assert big.resident_blocks >= small.resident_blocks


def test_ten_references_at_1024_fit_a_24gb_int8_card_with_the_prefix_off_the_bf16_gpu_cache(table):
    """The issue's case: 10 references at 1024x1024 (about 20 GiB of bf16 prefix) on a 24 GB card with the int8
    transformer gets a plan that fits, with the prefix not in bf16 on the GPU."""
    plan = table[24, "int8", 10, 1, False]
    assert plan.fits and plan.prefix_placement in ("int8", "host", "recompute")
    assert plan.gpu_bytes <= 24 * GiB
    assert "prefix K/V" in plan.describe() and plan.as_dict()["prefix_placement"] == plan.prefix_placement


def test_the_prefix_is_recomputed_only_where_no_kept_prefix_fits(table, sizes):
    """Recompute is the last resort: wherever the planner recomputes, none of gpu, int8 or host fits the card;
    where one of them fits, it is taken even when recomputing would be estimated faster."""
    recomputed = 0
    for (card, precision, refs, batch, cfg), plan in table.items():
        if not plan.fits or plan.prefix_placement != "recompute":
            continue
        recomputed += 1
        shape = plans.request_shape(1024, 1024, batch=batch, cfg=cfg, references=refs)
        kept = plans.plan_memory(sizes[precision], shape, card * GiB, HOST, placements=("gpu", "int8", "host"))
        assert not kept.fits, (card, precision, refs, batch, cfg)
    shape = plans.request_shape(1024, 1024)
    # 12 GiB: the kept prefixes fit only with most blocks streamed (the prefix's bytes as `placement_bytes` counts them).
    faster = plans.plan_memory(sizes["bf16"], shape, 12 * GiB, HOST, placements=("recompute",))
    chosen = plans.plan_memory(sizes["bf16"], shape, 12 * GiB, HOST)
    assert chosen.fits and chosen.prefix_placement != "recompute"
    assert faster.fits and faster.step_ms < chosen.step_ms  # the case the rule decides: recompute estimated faster


def test_refused_only_below_the_smallest_plan(table, sizes):
    """A plan that does not fit is the smallest one (no block resident, the least GPU of any placement), and every
    forced placement fails too; a card just above its needs gets a plan that fits."""
    refused = [(key, plan) for key, plan in table.items() if not plan.fits]
    assert refused  # 8 GB cards with 10 references
    for (card, precision, refs, batch, cfg), plan in refused:
        assert plan.resident_blocks == 0 and plan.gpu_bytes > card * GiB
        shape = plans.request_shape(1024, 1024, batch=batch, cfg=cfg, references=refs)
        for placement in plans.PREFIX_PLACEMENTS:
            forced = plans.plan_memory(sizes[precision], shape, card * GiB, HOST, placements=(placement,))
            assert not forced.fits and forced.gpu_bytes >= plan.gpu_bytes
        assert plans.plan_memory(sizes[precision], shape, plan.gpu_bytes, HOST).fits


def test_the_description_names_every_part(table):
    """The log line and the status dict name the blocks, the prefix, the text encoder, the VAE decode, the bytes
    and the step estimate."""
    for plan in (table[24, "int8", 10, 1, False], table[80, "bf16", 0, 1, False], table[8, "int8", 10, 1, True]):
        line = plan.describe()
        for word in ("transformer", "blocks", "prefix K/V", "text encoder", "VAE decode", "GPU", "host", "step ~"):
            assert word in line, (word, line)
        record = plan.as_dict()
        assert record["text"] == line
        assert record["resident_blocks"] + record["streamed_blocks"] == 32
        assert record["gpu_bytes"] == sum(record["gpu_parts"].values())
        assert record["host_bytes"] == sum(record["host_parts"].values())


def test_a_streamed_plan_costs_compute_plus_the_upload_it_does_not_hide(sizes):
    """The step estimate: compute + max(0, uploaded bytes / bandwidth - compute); the uploads are the streamed
    blocks once per CFG branch (plus a host prefix); a faster link never makes a step slower."""
    s = sizes["bf16"]
    shape = plans.request_shape(1024, 1024, cfg=True)
    plan = plans.plan_memory(s, shape, 12 * GiB, HOST, streamed_graphs=True)
    assert plan.fits and plan.streamed_blocks > 0
    streamed = sum(s.block_bytes[plan.resident_blocks:])
    extra = (sum(p for p in shape.prefix_tokens) * kv_bytes_per_token(s.dims)
             if plan.prefix_placement == "host" else 0)
    assert plan.upload_bytes == 2 * streamed + extra
    upload_ms = plan.upload_bytes / plans.DEFAULT_H2D_BYTES_PER_S * 1e3
    assert plan.step_ms == pytest.approx(plan.compute_ms + max(0.0, upload_ms - plan.compute_ms), rel=1e-12)
    faster = plans.plan_memory(s, shape, 12 * GiB, HOST, bandwidth=4 * plans.DEFAULT_H2D_BYTES_PER_S,
                               streamed_graphs=True)
    assert faster.step_ms <= plan.step_ms


def test_without_streamed_graphs_a_streamed_plan_steps_eagerly_and_waits_for_its_uploads(sizes):
    """Where streamed blocks cannot replay inside the graph (the runtime today), a streamed plan is budgeted as eager
    steps (no graph buffers or pool) and its uploads add to the compute; a whole plan keeps its graphs."""
    s = sizes["bf16"]
    shape = plans.request_shape(1024, 1024)
    plan = plans.plan_memory(s, shape, 12 * GiB, HOST, streamed_graphs=False)
    assert plan.fits and plan.streamed_blocks and not plan.overlapped
    labels = [label for label, _ in plan.budget.parts]
    assert not any(label.startswith("graph ") for label in labels)
    assert plan.step_ms == pytest.approx(plan.compute_ms + plan.upload_ms, rel=1e-12)
    whole = plans.plan_memory(s, shape, 40 * GiB, HOST, streamed_graphs=False)
    assert whole.whole and whole.overlapped and any(label == "graph pool" for label, _ in whole.budget.parts)


def test_the_slots_hold_the_largest_streamed_block_each(sizes):
    """A streamed plan's GPU side holds `slots` blocks' weights beyond the resident ones; three slots need one more
    block than two at the same resident count."""
    s = sizes["int8"]
    shape = plans.request_shape(1024, 1024, references=2)
    two = plans.plan_memory(s, shape, 12 * GiB, HOST, slots=2, streamed_graphs=True)
    assert two.streamed_blocks >= 3
    parts = dict(two.budget.parts)
    slot_label = next(label for label in parts if label.startswith("streaming slots"))
    assert parts[slot_label] == 2 * max(s.block_bytes[two.resident_blocks:])
    three = plans.plan_memory(s, shape, 12 * GiB, HOST, slots=3, streamed_graphs=True)
    assert three.resident_blocks <= two.resident_blocks


def test_a_small_host_rules_out_the_host_prefix_and_streaming(sizes):
    """Host bytes count: the pinned copies a plan adds (streamed blocks, a host prefix) must fit the host's budget; the
    text encoder's copy, held whatever its placement, is shown but not checked. (20 GiB: where the int8 prefix of ten
    references does not fit beside enough resident blocks, so the host prefix is the fastest.)"""
    s = sizes["int8"]
    shape = plans.request_shape(1024, 1024, references=10)
    roomy = plans.plan_memory(s, shape, 20 * GiB, HOST, streamed_graphs=True)
    assert roomy.fits and roomy.prefix_placement == "host"
    assert roomy.host_bytes == roomy.new_host_bytes + s.text_encoder.bytes
    # Room on the host for the streamed blocks' copies, not for the 20 GiB of pinned prefix rows.
    tight = plans.plan_memory(s, shape, 20 * GiB, 10 * GiB, streamed_graphs=True)
    assert tight.fits and tight.prefix_placement != "host" and tight.streamed_blocks
    assert tight.new_host_bytes <= 10 * GiB


def test_the_text_encoder_placement_follows_the_room(table):
    """The text encoder stays on the GPU where it fits beside the plan, leaves after encoding where it fits alone,
    streams by layer or runs on the CPU otherwise; a bf16 encoder that an int8 file would place better gets that
    suggestion."""
    assert table[80, "bf16", 0, 1, False].text_encoder == plans.TE_GPU
    assert table[24, "bf16", 0, 1, False].text_encoder == plans.TE_OFFLOAD
    small = table[12, "int8", 0, 1, False]
    assert small.text_encoder in (plans.TE_STREAMED, plans.TE_CPU)
    assert "int8 text encoder file" in small.text_encoder_suggestion
    for plan in table.values():
        assert plan.text_encoder in plans.TE_PLACEMENTS
        if plan.text_encoder == plans.TE_GPU:
            assert plan.text_encoder_suggestion is None


def test_the_whole_plan_is_todays_budget_part_by_part(sizes):
    """Every block resident with the prefix on the GPU is sizes.estimate itself, part for part."""
    s = sizes["bf16"]
    shape = plans.request_shape(1024, 1024, references=1, cfg=True)
    plan = plans.plan_memory(s, shape, 80 * GiB)
    assert plan.whole
    today = estimate(s.dims, shape, _weights(s), s.vae)
    assert plan.budget.parts == today.parts and plan.budget.margin == today.margin


def test_without_streaming_every_block_stays_resident(sizes):
    """`stream=False` (the CPU: its memory is the host's) never streams: the whole plan, or a refusal."""
    s = sizes["bf16"]
    shape = plans.request_shape(1024, 1024)
    plan = plans.plan_memory(s, shape, 12 * GiB, placements=("gpu",), stream=False)
    assert not plan.fits and plan.resident_blocks == 32
    assert plans.plan_memory(s, shape, 40 * GiB, placements=("gpu",), stream=False).whole


@pytest.mark.parametrize("kwargs, name", [
    ({"available": -1}, "available"), ({"slots": 0}, "slots"), ({"bandwidth": 0}, "bandwidth"),
    ({"placements": ("disk",)}, "placements"),
])
def test_bad_arguments_are_refused_by_name(sizes, kwargs, name):
    """A bad argument fails naming it, before any planning."""
    args = {"available": 24 * GiB, **kwargs}
    with pytest.raises(ValueError, match=name):
        plans.plan_memory(sizes["bf16"], plans.request_shape(1024, 1024), **args)


def test_the_docs_table_is_the_planners():
    """docs/memory.md's table of plans is what plan_table.markdown() prints now (regenerate it with
    `python -m graph_runtime.memory.plan_table`)."""
    text = (Path(__file__).parents[1] / "docs" / "memory.md").read_text()
    match = re.search(re.escape(plan_table.BEGIN) + r"\n(.*?)\n" + re.escape(plan_table.END), text, re.S)
    assert match, "docs/memory.md has no generated plan table"
    assert match.group(1).strip() == plan_table.markdown().strip()


def test_request_shape_counts_references_per_branch():
    """Each reference adds the output's token count (or `reference_tokens`) to every CFG branch's prefix."""
    shape = plans.request_shape(1024, 768, cfg=True, references=2, prompt_tokens=100)
    assert shape.prefix_tokens == (100 + 2 * 64 * 48,) * 2
    assert plans.request_shape(512, 512, references=3, reference_tokens=10).prefix_tokens == (128 + 30,)
    assert dataclasses.replace(shape, batch=2).batch == 2


# -- the one check of a sampling request, on a CUDA device (nothing is allocated: the full-size model on meta) --------


@pytest.fixture(scope="module")
def meta_transformer():
    import torch
    from diffusers import QwenImage21Transformer2DModel

    with torch.device("meta"):
        return QwenImage21Transformer2DModel().to(torch.bfloat16)


def _request(width=1024, height=1024, references=0, cfg=False):
    """What the memory check reads of a SamplingRequest: prompt rows with `references` image slots."""
    import torch
    from types import SimpleNamespace

    from graph_runtime.decode import TOKENS_PER_SLOT

    tokens = (width // 16) * (height // 16)
    # Each slot of the encoder sequence stands for TOKENS_PER_SLOT latent tokens of its reference.
    slots = references * max(1, tokens // TOKENS_PER_SLOT)
    positive = SimpleNamespace(image_mask=torch.zeros(1, 128 + slots, dtype=torch.bool), num_image_slots=slots)
    request = SimpleNamespace(positive=positive, negative=positive if cfg else None, do_cfg=cfg,
                              latent_width=width // 16, latent_height=height // 16, batch_size=1, decode_mode="auto",
                              prefix_placement="auto", planned_placement=None)
    request.placement = lambda: request.planned_placement or "gpu"
    return request


def test_a_request_too_big_for_a_whole_load_runs_streamed_instead_of_being_refused(meta_transformer):
    """On CUDA, a bf16 1024x1024 request on a 12 GiB card (refused before plans) gets a budget under a streamed plan
    that fits, with a prefix placement this build carries out; on a 40 GiB card the budget is today's, whole."""
    from graph_runtime.memory import budget as budgets
    from graph_runtime.memory.sizes import VaeDims

    vae = VaeDims.standard()
    request = _request()
    whole = budgets.check_sampling_request(meta_transformer, request, budgets.Available(40 * GiB), "cuda", vae)
    assert whole.plan.whole and whole.plan.fits
    today = budgets.RequestPlan.for_request(meta_transformer, request, vae, graphs=True).budget(40 * GiB)
    assert whole.total == today.total and whole.parts == today.parts

    small = budgets.check_sampling_request(meta_transformer, request, budgets.Available(12 * GiB), "cuda", vae,
                                           host_available=HOST)
    plan = small.plan
    assert plan.fits and plan.streamed_blocks > 0 and plan.prefix_placement in plans.PREFIX_PLACEMENTS_BUILT
    assert request.placement() == plan.prefix_placement  # the run reads the plan's placement
    assert small.total == plan.gpu_bytes <= 12 * GiB
    assert small.part("transformer weights") < meta_transformer.num_parameters() * 2
    if not plans.PREFIX_PLACEMENTS_BUILT >= set(plans.PREFIX_PLACEMENTS):
        assert any("which this build does not carry out yet" in note for note in plan.notes) or plan.runnable


def test_a_request_no_plan_fits_is_refused_with_the_smallest_plans_needs(meta_transformer):
    """Below the smallest plan (every block streamed), the refusal says no memory plan fits, gives the smallest
    plan's decisions and bytes, and still lists the settings to change."""
    from graph_runtime.memory import budget as budgets
    from graph_runtime.memory.sizes import VaeDims

    with pytest.raises(budgets.MemoryBudgetError) as info:
        budgets.check_sampling_request(meta_transformer, _request(), budgets.Available(GiB), "cuda",
                                       VaeDims.standard(), host_available=HOST)
    message = str(info.value)
    assert message.startswith("KV-Graph: no memory plan fits this request on cuda")
    assert "0 of 32 blocks resident" in message and "Nothing was allocated" in message
    assert info.value.plan is not None and info.value.plan.gpu_bytes > GiB
    assert "Change one of" in message


def test_the_bandwidth_setting_is_read_and_checked(monkeypatch):
    """KVGRAPH_H2D_GB_S sets the plans' host-to-device rate (GB/s); unset, the conservative default; a value that is
    not a positive number is refused naming the setting."""
    monkeypatch.delenv(plans.BANDWIDTH_SETTING, raising=False)
    assert plans.default_bandwidth() == plans.DEFAULT_H2D_BYTES_PER_S
    monkeypatch.setenv(plans.BANDWIDTH_SETTING, "25")
    assert plans.default_bandwidth() == 25e9
    for bad in ("fast", "0", "-3", "inf", "nan"):
        monkeypatch.setenv(plans.BANDWIDTH_SETTING, bad)
        with pytest.raises(ValueError, match=plans.BANDWIDTH_SETTING):
            plans.default_bandwidth()


def test_plans_take_the_measured_link_rate_unless_the_setting_names_one(monkeypatch):
    """A CUDA device's plans assume the rate measured there (link.py); the setting wins over it; a device where
    nothing is measured (the CPU) keeps the default; the measurement runs once per device."""
    from graph_runtime.memory import link

    monkeypatch.delenv(plans.BANDWIDTH_SETTING, raising=False)
    probes = []
    monkeypatch.setattr(link, "_measured", {})
    monkeypatch.setattr(link, "_probe", lambda device: probes.append(str(device)) or 42e9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert plans.default_bandwidth("cuda:0") == 42e9 and plans.default_bandwidth("cuda:0") == 42e9
    assert probes == ["cuda:0"]
    assert plans.default_bandwidth("cpu") == plans.DEFAULT_H2D_BYTES_PER_S
    monkeypatch.setenv(plans.BANDWIDTH_SETTING, "25")
    assert plans.default_bandwidth("cuda:0") == 25e9


def test_a_built_placement_is_planned_and_a_forced_one_is_kept(meta_transformer, monkeypatch):
    """Where every prefix placement is built (what the prefix placements' branch adds to PREFIX_PLACEMENTS_BUILT),
    10 references at 1024x1024 on a 24 GiB card get a budget under a plan with the prefix off the bf16 GPU cache; a
    forced placement (a user's choice) is the only one planned; a text encoder set otherwise than the plan would run
    it is noted."""
    from graph_runtime.memory import budget as budgets
    from graph_runtime.memory.sizes import VaeDims

    monkeypatch.setattr(plans, "PREFIX_PLACEMENTS_BUILT", frozenset(plans.PREFIX_PLACEMENTS))
    request, vae = _request(references=10), VaeDims.standard()
    budget = budgets.check_sampling_request(
        meta_transformer, request, budgets.Available(24 * GiB), "cuda", vae, host_available=HOST,
        text_encoder=plans.TextEncoderSize.standard(), text_encoder_placement=plans.TE_GPU)
    plan = budget.plan
    assert plan.fits and plan.runnable and plan.prefix_placement != "gpu" and budget.total == plan.gpu_bytes
    assert budget.total <= 24 * GiB
    assert any(f"runs '{plans.TE_GPU}' as set" in note for note in plan.notes)
    auto = budgets.check_sampling_request(
        meta_transformer, request, budgets.Available(24 * GiB), "cuda", vae, host_available=HOST,
        text_encoder=plans.TextEncoderSize.standard(), text_encoder_placement=plans.TE_AUTO)
    assert not any("as set" in note for note in auto.plan.notes)  # auto runs the plan's placement: nothing to note
    forced = budgets.check_sampling_request(meta_transformer, request, budgets.Available(24 * GiB), "cuda", vae,
                                            host_available=HOST, prefix_placements=("host",))
    assert forced.plan.prefix_placement == "host" and forced.plan.fits


def test_a_refusals_settings_are_priced_as_their_smallest_plans(meta_transformer):
    """Just below the smallest plan of a 1024x1024 request, the refusal offers a smaller size that fits, priced as
    that size's smallest plan (a whole load of any size would need the whole transformer, far more)."""
    from graph_runtime.memory import budget as budgets
    from graph_runtime.memory.sizes import VaeDims

    vae = VaeDims.standard()
    with pytest.raises(budgets.MemoryBudgetError) as info:
        budgets.check_sampling_request(meta_transformer, _request(), budgets.Available(GiB), "cuda", vae,
                                       host_available=HOST)
    available = info.value.plan.gpu_bytes - 2**20
    with pytest.raises(budgets.MemoryBudgetError) as info:
        budgets.check_sampling_request(meta_transformer, _request(), budgets.Available(available), "cuda", vae,
                                       host_available=HOST)
    size = next(o for o in info.value.options if o.startswith("width x height at most"))
    assert size.endswith("(fits)")
    need = float(re.search(r"needs ([\d.]+) GiB", size).group(1)) * GiB
    assert need <= available + 0.05 * GiB  # the message rounds to 0.1 GiB
    assert need < meta_transformer.num_parameters() * 2
