"""The step-cache benchmark end to end on the tiny model (CPU): prompts without and with the cache, alternated, and
its reports."""

import json

from bench.step_cache import main


def test_tiny_step_cache_bench_writes_its_reports(tmp_path, capsys):
    """Five prompts (one warm-up, then without / with twice): the cached ones skip steps and run only the others, their
    latents change against the run without the cache, the same both times; the reports say so."""
    assert main(["--tiny", "--device", "cpu", "--size", "128", "--steps", "12", "--out-dir", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("step-cache-*.json")).read_text())
    prompts = report["prompts"]
    assert [p["cache"] for p in prompts] == [False, False, True, False, True]
    for p in prompts:
        computed = p["replays"] + sum(p["eager_steps"].values())
        assert computed + p["skipped_steps"] == 12 and (p["skipped_steps"] > 0) == p["cache"]
    assert prompts[2]["change"] == prompts[4]["change"] > 0
    numbers = report["summary"]["KV-Graph Sampler + KV-Graph Step Cache"]
    assert numbers["skipped_steps"] == prompts[4]["skipped_steps"]
    assert "| prompt | sampler | cache |" in next(tmp_path.glob("step-cache-*.md")).read_text()
    assert "bench.step_cache: wrote" in capsys.readouterr().out
