"""The GGUF quality bench on the tiny model: re-quantizing a GGUF to int8 at load adds a second rounding no larger
than INT8 ConvRot's own error on float weights, and loading in bf16 adds at most bf16's rounding."""

import torch

from bench.gguf_quality import block_errors, dequant_speed
from graph_runtime.tiny import build_tiny_components
from graph_runtime.tiny_gguf import write_gguf_transformer


def test_block_errors_of_a_q8_file(tmp_path):
    """Per block: int8 adds about INT8 ConvRot's bound (within 10%: the rounding of other weights), the Q8_0 file's
    own error is nonzero, and bf16 adds at most 2^-8 relative; the total is at most the two roundings' sum."""
    original = {k: v.float() for k, v in build_tiny_components(0)["transformer"].state_dict().items()}
    path = write_gguf_transformer(original, tmp_path / "q8.gguf", "Q8_0")
    rows = block_errors(path, "int8", original=original)
    assert [r["block"] for r in rows] == [0, 1]
    for row in rows:
        assert 0 < row["loaded"] <= 1.1 * row["int8_bound"]
        assert 0 < row["gguf"]
        assert row["total"] <= row["loaded"] + row["gguf"] + 1e-9
    for row in block_errors(path, "bf16"):
        assert 0 < row["loaded"] <= 2.0 ** -8


def test_dequant_speed_reports_each_type():
    """One positive figure per type, for a written type and one gguf only reads."""
    rows = dequant_speed(("Q8_0", "Q4_K"), rows=256, cols=256, repeat=1)
    assert [r["type"] for r in rows] == ["Q8_0", "Q4_K"] and all(r["s_per_gib"] > 0 for r in rows)
