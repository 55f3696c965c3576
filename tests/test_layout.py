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


def test_rotary_table_is_remembered_per_model_and_layout():
    """The RoPE table equals the model's own builder, is built once per layout (a prompt of a seen layout reuses
    it: the builder walks every token on the host), differs for another layout, and only the most recent
    ROTARY_TABLES_KEPT layouts are kept."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope

    from graph_runtime.decode import layout as layout_module

    rope = QwenImage21Rope(theta=10000, axes_dim=[4, 6, 6])
    calls = []
    builder = rope.forward
    rope.forward = lambda *args, **kwargs: calls.append(1) or builder(*args, **kwargs)
    first = TokenLayout.build(_vlm_mask("TTIIIITT"), [(1, 2, 8), (1, 4, 4)], "cpu")
    again = TokenLayout.build(_vlm_mask("TTIIIITT"), [(1, 2, 8), (1, 4, 4)], "cpu")
    table = first.rotary(rope)
    assert torch.equal(table, builder(list(first.img_shapes), first.image_pad_mask, device="cpu"))
    assert again.rotary(rope) is table and len(calls) == 1
    other = TokenLayout.build(_vlm_mask("TTTIIIIT"), [(1, 2, 8), (1, 4, 4)], "cpu")  # same counts, other runs
    assert not torch.equal(other.rotary(rope), table) and len(calls) == 2
    for width in range(2, 2 + layout_module.ROTARY_TABLES_KEPT):
        TokenLayout.build(_vlm_mask("TT"), [(1, 2, width)], "cpu").rotary(rope)
    first.rotary(rope)
    assert len(calls) == 3 + layout_module.ROTARY_TABLES_KEPT  # the first layout was dropped and is built again


def test_precomputed_positions_match_the_mask():
    """The prefill scatters rows by the layout's precomputed image and text positions: the mask's own."""
    layout = TokenLayout.build(_vlm_mask("TIIIIT"), [(1, 2, 8), (1, 4, 4)], "cpu")
    assert torch.equal(layout.image_positions, layout.image_pad_mask.nonzero(as_tuple=True)[0])
    assert torch.equal(layout.text_positions, (~layout.image_pad_mask).nonzero(as_tuple=True)[0])
