"""The prefix placement benchmark end to end on the tiny model (CPU): its three placements, alternated, and its
reports."""

import json

import pytest

from bench.prefix_placement import main


def test_tiny_prefix_placement_bench_writes_its_reports(tmp_path, capsys):
    """Each placement's step is timed and compared with the gpu prefix's output: the host prefix bit-equal, the int8
    one close but not equal (its rows were rounded); the reports carry the command and a row per placement."""
    assert main(["--tiny", "--device", "cpu", "--rounds", "2", "--iters", "1", "--out-dir", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("prefix-placement-*.json")).read_text())
    speed = report["speed"]
    assert set(speed) == {"gpu", "int8", "host"} and all(len(row["all_ms"]) == 2 for row in speed.values())
    assert speed["host"]["bit_equal_to_gpu"] and speed["host"]["rel_l2_vs_gpu_prefix"] == 0
    assert 0 < speed["int8"]["rel_l2_vs_gpu_prefix"] < 1e-2
    assert speed["host"]["prefix_host_bytes"] > 0 == speed["gpu"]["prefix_host_bytes"]
    assert report["meta"]["command"].startswith("python -m bench.prefix_placement --tiny")
    text = next(tmp_path.glob("prefix-placement-*.md")).read_text()
    assert "| host |" in text and "| int8 |" in text and "bit-equal to the gpu prefix: True" in text
    assert "bench.prefix_placement: wrote" in capsys.readouterr().out


def test_tiny_prefix_placement_bench_on_an_emulated_card_writes_the_plan_and_capped_rows(tmp_path):
    """`--card GB` adds the int8 and host rows run as the planner plans them for that card, each with the plan, its
    ratio to the uncapped gpu row and its output against the gpu prefix's (host: bit-equal, the same values moved);
    the results file prints each plan. On the CPU nothing is capped: the tiny model fits whole, a smoke run."""
    assert main(["--tiny", "--device", "cpu", "--rounds", "1", "--iters", "1", "--card", "16",
                 "--out-dir", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("prefix-placement-*.json")).read_text())
    card = report["card"]
    assert set(card) == {"int8", "host"} and all(row["card_gb"] == 16 for row in card.values())
    assert card["host"]["bit_equal_to_gpu"] and card["host"]["rel_l2_vs_gpu_prefix"] == 0
    assert 0 < card["int8"]["rel_l2_vs_gpu_prefix"] < 1e-2
    for placement, row in card.items():
        assert row["fits"] and row["streamed_blocks"] == 0 and row["plan"].startswith("memory plan for 1x")
        assert row["vs_gpu"] == round(row["ms"] / report["speed"]["gpu"]["ms"], 3)
    text = next(tmp_path.glob("prefix-placement-*.md")).read_text()
    assert "## On an emulated 16 GB card" in text and f"- host: {card['host']['plan']}" in text
    assert f"host prefix on the 16 GB card: {card['host']['vs_gpu']:.3f}x the whole-GPU step" in text
    assert "--card 16" in report["meta"]["command"]


def test_a_card_size_that_is_not_positive_is_refused(tmp_path, capsys):
    """`--card 0` is a usage error naming the option and what it expects, before any model is built."""
    with pytest.raises(SystemExit) as exc:
        main(["--tiny", "--device", "cpu", "--card", "0", "--out-dir", str(tmp_path)])
    assert exc.value.code == 2 and "--card 0: expected a card size in GB above 0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
