"""The streamed-step benchmark end to end on the tiny model (CPU): it times a streamed step per slot count and the
eager way at the same resident blocks, and writes its reports with the command."""

import json

from bench.streaming import main


def test_tiny_streaming_bench_writes_its_reports(tmp_path, capsys):
    assert main(["--tiny", "--device", "cpu", "--slots", "2,3", "--iters", "2", "--out-dir", str(tmp_path)]) == 0
    (md,) = tmp_path.glob("streaming-*.md")
    report = json.loads(next(tmp_path.glob("streaming-*.json")).read_text())
    assert report["meta"]["command"].startswith("python -m bench.streaming --tiny")
    rows = report["rows"]
    assert [r["slots"] for r in rows] == [2, 3, 0]
    assert len({r["resident_blocks"] for r in rows}) == 1 and all(r["streamed_blocks"] > 0 and r["ms"] > 0
                                                                     for r in rows)
    assert all(r["eager_vs_this"] > 0 for r in rows[:2]) and rows[2]["eager_vs_this"] is None
    assert "| card | slots | resident blocks |" in md.read_text() and "0 (eager way)" in md.read_text()
    assert "bench.streaming: wrote" in capsys.readouterr().out
