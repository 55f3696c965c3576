"""The benchmark command end to end on the tiny model (CPU): the reports it writes and what they hold."""

import json

import pytest

from bench.cli import main


def test_tiny_bench_writes_markdown_and_json_with_every_path_guarded(tmp_path, capsys):
    """On CPU the default paths are the reference and our eager step; each scenario row carries a decode time and a
    passing quality guard, and the markdown names the columns a reader compares (clock columns stay empty off
    CUDA); our rows give the blocks' weights apart from the whole model's."""
    assert main(["--tiny", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    (md,) = tmp_path.glob("decode-*.md")
    (js,) = tmp_path.glob("decode-*.json")
    report = json.loads(js.read_text())
    assert report["meta"]["command"] == f"python -m bench --tiny --device cpu --out-dir {tmp_path}"
    rows = [row for scenario in report["scenarios"] for row in scenario["rows"]]
    assert {row["path"] for row in rows} == {"diffusers", "eager"}
    assert all(row["decode_ms"] > 0 and row["quality_ok"] is True for row in rows)
    assert not any("decode_ms_after_idle" in row or "clock_limit" in row for row in rows)
    # Block weights (what a precision quantizes) are a part of the whole model's, which also holds the embeddings.
    ours = [row for row in rows if row["path"] == "eager"]
    assert all(0 < row["block_weights_gb"] * 1e9 < row["weights_gb"] * 2**30 for row in ours)
    text = md.read_text()
    assert "| path | prefill ms | decode ms/step |" in text and "clock held by" in text
    assert "fastest path passing the guard: **eager**" in text
    runs = [(r["run"], r["steps"]) for r in report["amortization"]]
    assert runs[:6] == [("t2i-40", 40), ("t2i-40", 40), ("turbo-8", 8), ("turbo-8", 8),
                        ("t2i-40 after 3 s idle", 40), ("turbo-8 after 3 s idle", 8)]
    assert all(r["dit_total_ms"] > 0 for r in report["amortization"])
    assert "| turbo-8 after 3 s idle | 8 |" in text
    assert "bench: wrote" in capsys.readouterr().out


def test_fastest_path_lists_paths_tied_within_one_percent():
    """A path that failed a quality check is never the fastest; sums within 1% of the fastest are reported as tied
    (run-to-run noise), fastest first; the reference is never a candidate."""
    from bench.paths import PathSpec
    from bench.runner import _fastest_passing, describe_fastest

    specs = [PathSpec("diffusers", reference=True), PathSpec("eager", mode="eager"), PathSpec("graph"),
             PathSpec("compile+graph", compile=True), PathSpec("fast-but-wrong")]
    rows = [{"path": "diffusers", "decode_ms": 50.0}, {"path": "eager", "decode_ms": 40.0},
            {"path": "graph", "decode_ms": 25.1}, {"path": "compile+graph", "decode_ms": 25.0},
            {"path": "fast-but-wrong", "decode_ms": 10.0, "quality_ok": False}]
    results = [{"rows": rows + [{"path": "diffusers", "skipped": "odd latent grid"}]},
               {"rows": [dict(r, decode_ms=r["decode_ms"] * 4) for r in rows]}]
    tied, totals = _fastest_passing(results, specs)
    assert [s.name for s in tied] == ["compile+graph", "graph"]
    assert totals == {"eager": 200.0, "graph": 125.5, "compile+graph": 125.0}
    assert describe_fastest(tied, totals).startswith("compile+graph (tied within 1% with graph;")
    rows[2]["decode_ms"] = 30.0
    tied, _ = _fastest_passing(results[:1], specs)
    assert [s.name for s in tied] == ["compile+graph"]


def test_int8_paths_are_judged_by_the_int8_bound_not_the_bf16_guard():
    """W8A8's error is larger than bf16's by construction, so an INT8 file kept int8 (`graph-int8`) and
    `precision: int8` are judged by the `int8` variant's verdict against comfy-kitchen's W8A8 (their own weights),
    and neither is a fastest-path candidate until that verdict was measured and met."""
    from bench.paths import PathSpec
    from bench.runner import _bound_variant, _fastest_passing

    kept = PathSpec("graph-int8", weights="int8")
    quantized = PathSpec("int8", precision="int8")
    assert _bound_variant(kept) == _bound_variant(quantized) == "int8"
    assert _bound_variant(PathSpec("graph")) == "bf16"
    assert _bound_variant(PathSpec("fp8-attn", precision="fp8-attn")) == "fp8-attn"
    # 8-bit attention on top of int8 Linears is judged by its own measured variant, not int8's.
    assert _bound_variant(PathSpec("int8-attn8", precision="int8", attention="int8")) == "int8-attn8"
    specs = [PathSpec("graph"), kept, quantized]
    rows = [{"path": "graph", "decode_ms": 100.0, "quality_ok": True}, {"path": "graph-int8", "decode_ms": 70.0},
            {"path": "int8", "decode_ms": 71.0, "quality_ok": True}]
    tied, totals = _fastest_passing([{"rows": rows}], specs)
    assert [s.name for s in tied] == ["int8"] and "graph-int8" not in totals


@pytest.mark.parametrize("extra", [[], ["--device", "cpu"]])
def test_bench_without_cuda_stops_at_once_and_points_to_tiny(monkeypatch, capsys, extra):
    import torch

    import bench.runner as runner

    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark built its model")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runner, "build_transformer", refuse)
    assert main(extra) == 2
    err = capsys.readouterr().err
    assert "--device=" in err and "expected a CUDA device" in err and "`python -m bench --tiny --device cpu`" in err


def test_bench_runs_as_a_module_from_the_repository_root():
    """`python -m bench` is the benchmark's command (bench/__main__.py): from the repository root it parses the
    benchmark's options, the prompt-to-image ones included."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m bench") and "--e2e" in done.stdout and "--tiny" in done.stdout


def test_attention_swap_is_undone_and_falls_back_to_sdpa_off_cuda():
    """The 8-bit attention path swaps every block's attention only while inside and restores SDPA after, an error
    included, and an inner swap gives back the outer one; off CUDA (where comfy-kitchen's kernel does not run) the
    swapped attention is SDPA's, so a CPU step is unchanged; an unknown attention is refused by name."""
    import torch

    from bench.swap import attention_swapped
    from graph_runtime.decode.step import TargetDecodeBlock

    plain = TargetDecodeBlock.attention
    q, k = torch.randn(1, 5, 2, 16), torch.randn(1, 7, 2, 16)
    expected = TargetDecodeBlock.sdpa_attention(q, k, k, None)  # what a block runs off CUDA
    with attention_swapped("int8"):
        assert TargetDecodeBlock.attention is not plain
        assert torch.equal(TargetDecodeBlock.attention(q, k, k, None), expected)
    assert TargetDecodeBlock.attention is plain
    with pytest.raises(RuntimeError), attention_swapped("int8"):
        raise RuntimeError("a failed measurement")
    assert TargetDecodeBlock.attention is plain
    with attention_swapped("int8"):
        swapped_in = TargetDecodeBlock.attention
        with attention_swapped("int8"):
            pass
        assert TargetDecodeBlock.attention is swapped_in  # an inner swap restores the outer one
    assert TargetDecodeBlock.attention is plain
    with attention_swapped("sdpa"):
        assert TargetDecodeBlock.attention is plain
    with pytest.raises(ValueError, match="'fp4'"), attention_swapped("fp4"):
        pass
