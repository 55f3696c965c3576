"""The command line's GGUF load converted to int8: the blocks turn INT8 ConvRot as they are read (as the loader node
does), so the float weights held at any moment stay near the int8 model's size, never the whole dequantized model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace

import torch

from graph_runtime.fp8 import resolve_precision
from graph_runtime.loading import gguf_transformer
from graph_runtime.tiny_gguf import write_gguf_transformer


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta")


def test_the_cli_makes_a_gguf_int8_block_by_block(tmp_path, tiny_parts, tiny_folder, monkeypatch, capsys):
    """`generate --transformer X.gguf --precision int8`: the model's weights, measured after every block is assigned
    (a hook on the loader's assign step), never exceed the final int8 model's size plus one block in the load dtype
    (bf16), and stay below the whole bf16 model's size, which the old load-then-convert held at its peak; the command
    line says the blocks were made INT8 while reading."""
    from graph_runtime.cli import apply_cli_precision, load_models
    from graph_runtime.loading.gguf_transformer import int8_while_read
    from graph_runtime.quantized import ConvRotInt8Linear
    from graph_runtime.tiny import write_comfyui_files

    files = write_comfyui_files(tmp_path / "models")
    gguf = write_gguf_transformer(tiny_parts["transformer"].state_dict(), tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    held = []
    assign = gguf_transformer.assign_weights

    def measured(model, tensors):
        assign(model, tensors)
        held.append(_bytes(model))

    monkeypatch.setattr(gguf_transformer, "assign_weights", measured)
    args = SimpleNamespace(model=None, transformer=str(gguf), text_encoder=str(files["text_encoder"]),
                           vae=str(files["vae"]), tokenizer=str(tiny_folder), dtype="bf16")
    precision = resolve_precision("int8", "cpu", dtype=torch.bfloat16, int8_file=False)
    models = load_models(args, "cpu", precision)
    apply_cli_precision(models.transformer, precision, int8_while_read(args.transformer, precision))
    model = models.transformer
    assert sum(isinstance(m, ConvRotInt8Linear) for m in model.modules()) == 14
    final = _bytes(model)
    block = max(sum(p.numel() for p in b.parameters()) * 2 for b in tiny_parts["transformer"].transformer_blocks)
    whole_bf16 = sum(p.numel() for p in tiny_parts["transformer"].parameters()) * 2
    assert held and max(held) <= final + block and max(held) < whole_bf16
    assert "made INT8 block by block while it was read" in capsys.readouterr().out
