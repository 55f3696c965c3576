"""The benchmark's model is the model the pack's loader builds from the same weights."""

import torch

from bench.model import build_transformer
from graph_runtime.loading.transformer import load_transformer
from tests.test_loading import _transformer_out


def test_bench_built_model_equals_the_loader_built_one(tmp_path):
    """A bf16 model the benchmark builds and the one `load_transformer` builds from its saved weights hold the same
    tensors in the same dtypes, buffers included (the timestep frequencies stay fp32, as the loader computes
    them), and compute bit-identical outputs: every error the benchmark prints is one a loaded model would show."""
    bench = build_transformer(tiny=True, device="cpu", dtype=torch.bfloat16)
    bench.save_pretrained(tmp_path)
    loaded = load_transformer(tmp_path, dtype=torch.bfloat16)

    def tensors(model):
        return {**dict(model.named_parameters()), **dict(model.named_buffers())}

    got, want = tensors(bench), tensors(loaded)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    assert bench.time_text_embed.time_proj.freqs.dtype == torch.float32
    assert torch.equal(_transformer_out(bench), _transformer_out(loaded))
