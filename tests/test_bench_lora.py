"""The LoRA benchmark end to end on the tiny model (CPU): it merges, switches and restores, times the step with and
without the merged LoRA, and writes its reports."""

import json

from bench.lora import main


def test_tiny_lora_bench_writes_its_reports(tmp_path, capsys):
    assert main(["--tiny", "--device", "cpu", "--iters", "2", "--out-dir", str(tmp_path)]) == 0
    (md,) = tmp_path.glob("lora-*.md")
    report = json.loads(next(tmp_path.glob("lora-*.json")).read_text())
    assert report["meta"]["command"].startswith("python -m bench.lora --tiny")
    merges = {row["step"]: row for row in report["merges"]}
    assert all(row["changed"] and row["s"] > 0 for row in merges.values())
    assert merges["first merge (host copies + merge)"]["weights"] == report["meta"]["lora_weights"] == 14
    assert merges["restore (no LoRA)"]["weights"] == 0
    for row in report["steps"]:
        assert row["decode_ms_without"] > 0 and row["decode_ms_merged"] > 0
        assert row["captures_after_merges"] == 0 and row["restored_output_equal"] is True
        assert row["output_change_rel_l2"] > 0  # the merged weights are what the step computes with
    assert "| merge step | weights merged | s | host copies GiB |" in md.read_text()
    assert "bench.lora: wrote" in capsys.readouterr().out
