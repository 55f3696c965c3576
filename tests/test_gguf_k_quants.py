"""GGUF K-quant and IQ types (Q2_K ... Q6_K, IQ1_S ... IQ4_XS), as ComfyUI-GGUF files hold them for Q4_K_M and
smaller downloads: the torch port dequantizes every block exactly as gguf's numpy dequantizer does, the loader's
weights equal gguf's dequantization of the file's bytes in the model's shapes, and Q4_K / Q6_K (quantized by the
pack's own quantizer) stay within their rounding of the original weights."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from graph_runtime.loading import gguf_torch, load_transformer, transformer_from_comfy_state_dict
from graph_runtime.loading.gguf_files import GGUFFile
from graph_runtime.tiny import build_tiny_components
from graph_runtime.tiny_gguf import (
    K_QUANTS, QK_K, RANDOM_TYPES, q4_k_m, quantize_q4_k, quantize_q6_k, quantize_q8_0, random_blocks,
    write_k_quant_transformer,
)

F32 = torch.float32
PORTED = [*K_QUANTS, "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
IQ = [t for t in RANDOM_TYPES if t.startswith("IQ")]


@pytest.fixture(scope="module")
def original():
    return build_tiny_components(0)["transformer"]


@pytest.fixture(scope="module")
def files(original, tmp_path_factory):
    root = tmp_path_factory.mktemp("kquants")
    out = {t: write_k_quant_transformer(original.state_dict(), root / f"tiny-{t}.gguf", lambda n, v, t=t: t)
           for t in [*K_QUANTS, *IQ]}
    out["Q4_K_M"] = write_k_quant_transformer(original.state_dict(), root / "tiny-Q4_K_M.gguf", q4_k_m)
    return out


def gguf_weights(path) -> dict[str, torch.Tensor]:
    """gguf's numpy dequantization of every tensor of the file, in the model's names and shapes."""
    file = GGUFFile(path, "")
    return transformer_from_comfy_state_dict({k: torch.from_numpy(np.array(file.dequantized(k), np.float32))
                                              for k in file.tensors})


@pytest.mark.parametrize("qtype", PORTED)
def test_the_torch_port_equals_ggufs_dequantizer_bit_for_bit(qtype):
    """On random blocks (every code and small scale, moderate float16 scales), the torch port gives exactly gguf's
    float32 values: the same operations in the same order, so no tolerance."""
    if qtype in K_QUANTS:
        blocks = random_blocks(qtype, 64, seed=5)
    else:  # the legacy types, from gguf's own quantizer
        values = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
        blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    expected = dequantize(blocks.reshape(1, -1), gguf.GGMLQuantizationType[qtype])
    ours = gguf_torch.dequantize(torch.from_numpy(np.ascontiguousarray(blocks)), qtype, expected.shape)
    assert np.array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("qtype", [*K_QUANTS, *IQ, "Q4_K_M"])
def test_each_type_loads_ggufs_dequantization_of_its_bytes(original, files, qtype):
    """The loaded model (fp32) holds exactly gguf's dequantization of the file's bytes, every tensor in the
    original model's shape (the weights stored as rows of 256 values come back in their original shapes)."""
    model = load_transformer(files[qtype], dtype=F32)
    expected, state = gguf_weights(files[qtype]), model.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in original.state_dict().items()}
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    stored = GGUFFile(files[qtype], "").type_counts()
    wanted = {"Q4_K", "Q6_K"} if qtype == "Q4_K_M" else {qtype}
    assert wanted <= set(stored)  # the block Linears really are of that type


def test_rows_that_split_into_blocks_keep_their_shape(tmp_path):
    """A weight whose rows split into blocks of 256 is stored as its own rows (no original-shape field): a 4 x 512
    Q4_K weight reads back as [4, 512], within Q4_K's rounding of the values written."""
    from graph_runtime.loading.gguf_files import ORIG_SHAPE_FIELD

    state = dict(build_tiny_components(0)["transformer"].state_dict())
    key = "transformer_blocks.0.attn.to_q.weight"
    state[key] = torch.randn(4, 512)
    file = GGUFFile(write_k_quant_transformer(state, tmp_path / "rows.gguf", lambda n, v: "Q4_K"), "")
    assert file.tensors[key].shape == (4, 512) and file.reader.get_field(ORIG_SHAPE_FIELD + key) is None
    values = torch.from_numpy(np.array(file.dequantized(key)))
    assert bool(((values - state[key]).abs() <= bound(state[key], "Q4_K")).all())


def bound(reference: torch.Tensor, qtype: str) -> torch.Tensor:
    """The rounding of the pack's quantizers, per weight, from the original values (rows of 256 in super-blocks):
    - Q4_K: half a step of its sub-block of 32, step <= (range + dmin) / 15 + d, where the levels start at
      -dmin*m <= min(x, 0) (m rounded up) and d, dmin are the super-block's largest span / (15*63) and largest
      |min| / 63, rounded up to float16 (2^-10 relative at most);
    - Q6_K: half a step of its sub-block of 16, step <= amax / 31 + d, d = the super-block's amax / (31*127) rounded
      up to float16."""
    grow = 1 + 2.0 ** -10
    if qtype == "Q4_K":
        x = reference.reshape(-1, 8, 32)
        low = x.amin(-1).clamp(max=0)
        dmin = (-low).amax(-1, keepdim=True) / 63 * grow
        span = x.amax(-1) - low + dmin
        d = span.amax(-1, keepdim=True) / (15 * 63) * grow
        step = span / 15 + d
    else:
        x = reference.reshape(-1, 16, 16)
        amax = x.abs().amax(-1)
        d = amax.amax(-1, keepdim=True) / (31 * 127) * grow
        step = amax / 31 + d
    return (step.unsqueeze(-1) / 2 * 1.001).expand_as(x).reshape(reference.shape)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_the_quantizers_stay_within_their_rounding(original, files, qtype):
    """Every Q4_K / Q6_K weight of the file is within half a step (bound) of the original, and the rounding is not
    zero (the weights really are quantized)."""
    reference, loaded = original.state_dict(), gguf_weights(files[qtype])
    checked = 0
    for key, value in loaded.items():
        if key.startswith("transformer_blocks.") and value.dim() == 2 and value.numel() % QK_K == 0:
            error = (value - reference[key]).abs()
            assert bool((error <= bound(reference[key], qtype)).all()), (key, float(error.max()))
            assert bool((error > 0).any()), key
            checked += 1
    assert checked == 14


def test_quantizers_handle_an_all_zero_super_block():
    """A super-block of zeros (a pruned row) quantizes to zero scales and dequantizes to zeros, not NaN."""
    rows = torch.zeros(2, 256)
    rows[1] = torch.linspace(-1, 1, 256)
    for qtype, quantize in (("Q4_K", quantize_q4_k), ("Q6_K", quantize_q6_k), ("Q8_0", quantize_q8_0)):
        values = dequantize(quantize(rows).numpy(), gguf.GGMLQuantizationType[qtype])
        assert np.array_equal(values[0], rows[0].numpy()) and np.isfinite(values).all(), qtype


def test_the_q8_0_quantizer_writes_ggufs_layout():
    """The torch Q8_0 quantizer (the benchmark's, on the GPU) gives blocks gguf reads back within half a step
    (amax / 254) plus float16's rounding of the scale times the largest code (127 * 2^-11 of the step), and
    equal to gguf's own quantizer's bytes but for round-half cases (at most one code apart)."""
    values = torch.randn(16, 512)
    ours = quantize_q8_0(values).numpy()
    back = dequantize(ours, gguf.GGMLQuantizationType.Q8_0)
    amax = values.reshape(-1, 32).abs().amax(-1, keepdim=True)
    step = amax / 127
    bound = (step / 2 + 127 * step * 2.0 ** -11).expand(-1, 32).reshape(values.shape) * 1.001
    assert bool(((torch.from_numpy(back) - values).abs() <= bound).all())
    theirs = gguf.quants.quantize(values.numpy(), gguf.GGMLQuantizationType.Q8_0)
    codes = lambda b: b.reshape(-1, 34)[:, 2:].view(np.int8).astype(int)  # noqa: E731
    assert np.abs(codes(ours) - codes(theirs)).max() <= 1


def test_k_quants_are_dequantized_by_the_torch_port(files, monkeypatch):
    """The loader dequantizes K-quants with the torch port (which runs on the GPU where there is one), not with
    gguf's numpy code: with gguf's dequantizer broken the Q4_K_M file still loads."""
    from graph_runtime.loading import gguf_files

    def broken(self, key):
        if self.tensors[key].type_name in gguf_torch.PORTS:
            raise AssertionError(f"numpy dequantization of {key}")
        return original_dequantized(self, key)

    original_dequantized = gguf_files.GGUFFile.dequantized
    monkeypatch.setattr(gguf_files.GGUFFile, "dequantized", broken)
    model = load_transformer(files["Q4_K_M"], dtype=F32)
    assert torch.isfinite(model.transformer_blocks[0].attn.to_q.weight).all()
