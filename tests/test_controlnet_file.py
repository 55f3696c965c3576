"""The Fun ControlNet Union file: the released key layout read back exactly, and every file that does not match
refused with the file and the key named (a file that matched only in part would run a different network)."""

import pytest
import torch
from safetensors.torch import save_file

from graph_runtime.controlnet import load_fun_controlnet
from graph_runtime.controlnet.file import to_file_state_dict
from graph_runtime.controlnet.tiny import random_tiny_controlnet, write_tiny_controlnet
from graph_runtime.errors import CheckpointError, InputError
from graph_runtime.tiny import TINY_TRANSFORMER, random_tiny_transformer


def _write(tmp_path, tensors, name="cn.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize("fused", [True, False], ids=["gate_up", "split-mlp"])
def test_the_released_layout_reads_back_exactly(tmp_path, fused):
    """Both MLP spellings of the file give the module's weights bit for bit (the fused one split gate rows first)."""
    net = random_tiny_controlnet(seed=1)
    path = _write(tmp_path, to_file_state_dict(net, fused=fused))
    loaded = load_fun_controlnet(path)
    assert loaded.num_blocks == 2 and loaded.inner_dim == 32 and loaded.head_dim == 16
    for key, value in net.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_make_tiny_writes_a_file_the_loader_reads(tmp_path):
    """The examples' tiny file is in the released layout (fused MLP, bf16) and fits the tiny transformer."""
    path = write_tiny_controlnet(tmp_path / "model_patches" / "cn.safetensors")
    net = load_fun_controlnet(path)
    assert net.control_img_in.weight.dtype == torch.bfloat16
    net.check_base(random_tiny_transformer())


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("control_blocks.1.attn.to_k.weight"), "control_blocks.1.attn.to_k.weight"),
    (lambda sd: sd.__setitem__("control_blocks.0.extra.weight", torch.zeros(2)), "control_blocks.0.extra.weight"),
    (lambda sd: sd.__setitem__("control_blocks.1.after_proj.bias", torch.zeros(5)), "after_proj.bias"),
    (lambda sd: sd.__setitem__("control_img_in.weight", torch.zeros(32, 132)), "129"),
    (lambda sd: sd.__setitem__("control_blocks.0.attn.to_q.weight_scale", torch.ones(32)), "quantized"),
    (lambda sd: sd.pop("control_img_in.weight"), "control_img_in.weight"),
])
def test_a_file_that_does_not_match_is_refused_naming_the_key(tmp_path, edit, message):
    state = to_file_state_dict(random_tiny_controlnet(seed=1))
    edit(state)
    path = _write(tmp_path, state)
    with pytest.raises(CheckpointError) as info:
        load_fun_controlnet(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_another_file_kind_is_refused(tmp_path):
    """A LoRA, say, put in model_patches: refused as not a Fun ControlNet Union file."""
    path = _write(tmp_path, {"diffusion_model.transformer_blocks.0.attn.to_q.lora_down.weight": torch.zeros(4, 32)})
    with pytest.raises(CheckpointError, match="Fun ControlNet Union"):
        load_fun_controlnet(path)


def test_a_net_for_another_model_is_refused():
    """Width or block count that do not fit the base model: refused naming both."""
    transformer = random_tiny_transformer()
    with pytest.raises(InputError, match="width 64"):
        random_tiny_controlnet(config={**TINY_TRANSFORMER, "num_attention_heads": 4}).check_base(transformer)
    with pytest.raises(InputError, match="divides the model's 2 blocks"):
        random_tiny_controlnet(num_blocks=3).check_base(transformer)
