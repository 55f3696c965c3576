"""The host-side token layout against diffusers' per-forward metadata, and layout signatures."""

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Transformer2DModel,
    _qwenimage21_prefix_segments,
)

from graph_runtime.decode.layout import TokenLayout


def _vlm_mask(pattern):
    return torch.tensor([[c == "I" for c in pattern]])


@pytest.mark.parametrize("pattern,shapes", [
    ("TTTTT", [(1, 4, 6)]),
    ("TTIIIITT", [(1, 2, 8), (1, 4, 4)]),
    ("TIIIIT", [(1, 2, 4), (1, 4, 2), (1, 6, 6)]),  # two adjacent references: still two blocks
])
def test_layout_matches_diffusers_metadata(pattern, shapes):
    """Joint image mask, prefix length and segments equal what diffusers derives inside its forward."""
    vlm = _vlm_mask(pattern)
    layout = TokenLayout.build(vlm, shapes, "cpu")
    target = shapes[-1][1] * shapes[-1][2]
    img_mask = torch.cat([vlm, torch.ones(1, target // 4, dtype=torch.bool)], dim=1)
    repeats = torch.where(img_mask, 4, 1)[0]
    expected_mask = torch.repeat_interleave(img_mask[0], repeats)
    assert torch.equal(layout.image_pad_mask, expected_mask)
    image_ids, target_mask = QwenImage21Transformer2DModel.build_token_metadata(expected_mask, shapes)
    prefix_len = int((~target_mask).sum())
    assert layout.prefix_len == prefix_len
    assert torch.equal(layout.target_token_mask(), target_mask)
    assert list(layout.segments) == _qwenimage21_prefix_segments(image_ids, prefix_len)


def test_odd_latent_grids_are_laid_out_token_by_token():
    """A 16-px-multiple size with an odd latent grid (e.g. 208x208 -> 13x13) gets a valid layout."""
    layout = TokenLayout.build(_vlm_mask("TTT"), [(1, 13, 13)], "cpu")
    assert layout.target_tokens == 169 and layout.seq_len == 3 + 169


def test_signature_separates_layouts_with_equal_token_counts():
    a = TokenLayout.build(_vlm_mask("TTTT"), [(1, 8, 8)], "cpu")
    b = TokenLayout.build(_vlm_mask("TTTT"), [(1, 4, 16)], "cpu")
    c = TokenLayout.build(_vlm_mask("TTIIIIT" + "T"), [(1, 4, 4), (1, 8, 8)], "cpu")
    d = TokenLayout.build(_vlm_mask("TIIIITT" + "T"), [(1, 4, 4), (1, 8, 8)], "cpu")
    assert a.seq_len == b.seq_len and a.signature != b.signature
    assert c.seq_len == d.seq_len and c.signature != d.signature  # same reference, different position
    assert a.signature == TokenLayout.build(_vlm_mask("TTTT"), [(1, 8, 8)], "cpu").signature


def test_mismatched_reference_count_is_a_clear_error():
    with pytest.raises(ValueError, match="reserves 1 image slots"):
        TokenLayout.build(_vlm_mask("TIT"), [(1, 4, 4), (1, 8, 8)], "cpu")
