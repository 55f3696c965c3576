"""The prefix placement benchmark end to end on the tiny model (CPU): its three placements, alternated, and its
reports."""

import json

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
