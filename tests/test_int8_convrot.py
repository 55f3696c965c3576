"""ComfyUI's INT8 ConvRot files: the int8 layers, the tiny INT8 files under the released names, both execution modes
(int8 and dequantize) of the DiT, the Turbo DiT and the text encoder, and every way a quantized file can be wrong.

comfy-kitchen has no CPU kernels: on the CPU it runs its eager backend (torch reference code of the same math:
Hadamard rotation as a matmul, row-wise int8 quantization, `torch._int_mm`), which is what these tests exercise.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from graph_runtime.errors import CheckpointError, InputError
from graph_runtime.loading import inspect_checkpoint, load_text_encoder, load_transformer
from graph_runtime.loading.comfy_layout import transformer_to_comfy_state_dict
from graph_runtime.quantized import (
    ConvRotInt8Embedding, ConvRotInt8Linear, dequantize_weight, group_size_problem, int8_modules, quantize_linears_,
    quantize_weight, record_tensor,
)
from tests.owners import loaded_for
from graph_runtime.sampling.sampler import SamplingRequest, initial_noise, sample
from graph_runtime.tiny import INT8_FILES, TINY_CONVROT_GROUP, write_comfyui_files, write_comfyui_int8_files

F32, BF16 = torch.float32, torch.bfloat16
PROMPT = "a red cube on a blue sphere"
BLOCK_LINEARS = 2 * 7  # tiny DiT: 2 blocks x (to_q, to_k, to_v, to_out.0, gate_layer, proj, out)
T_PREFIX = "model.diffusion_model."


@pytest.fixture(scope="module")
def files(tiny_parts, tmp_path_factory):
    models = tmp_path_factory.mktemp("int8") / "models"
    written = write_comfyui_int8_files(models, parts=tiny_parts)
    written.update({f"{k}_bf16": v for k, v in write_comfyui_files(models).items()})
    tokenizer = models.parent / "tokenizer"
    tiny_parts["processor"].save_pretrained(tokenizer)
    written["tokenizer"] = tokenizer
    return written


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bad-int8")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class LayerErrors:
    """Per int8 layer, the worst relative error of its output against the same input through its dequantized weight
    in fp32, over every call while installed: the activation-quantization error the W8A8 GEMM adds (the weights
    are the same values both ways)."""

    def __init__(self, model):
        self.worst: dict[str, float] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules()
                        if isinstance(m, ConvRotInt8Linear)]

    def _hook(self, name):
        def record(module, args, out):
            bias = None if module.bias is None else module.bias.float()
            ref = F.linear(args[0].float(), module.dequantized_weight(F32), bias)
            self.worst[name] = max(self.worst.get(name, 0.0), relative(out, ref))
        return record

    def remove(self):
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------------------------------------ the int8 layers


def test_linear_is_an_nn_linear_holding_int8_without_a_float_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    layer = ConvRotInt8Linear.from_linear(linear, 16)
    assert isinstance(layer, torch.nn.Linear)
    assert layer.weight.dtype == torch.int8 and tuple(layer.weight.shape) == (48, 64)
    assert isinstance(layer.weight, torch.nn.Parameter) and not layer.weight.requires_grad
    assert layer.weight_scale.dtype == F32 and tuple(layer.weight_scale.shape) == (48, 1)
    assert layer.group_size == 16
    floats = {k: v.numel() for k, v in layer.state_dict().items() if v.is_floating_point()}
    assert floats == {"bias": 48, "weight_scale": 48}  # no [48, 64] float anywhere

    # forward is comfy-kitchen's W8A8 int8_linear (ComfyUI's numerics), bit for bit
    import comfy_kitchen as ck

    x = torch.randn(3, 5, 64)
    expected = ck.int8_linear(x, layer.weight, layer.weight_scale, layer.bias, F32, convrot=True,
                              convrot_groupsize=16)
    assert torch.equal(layer(x), expected)


def test_dtype_and_device_moves_keep_int8_and_fp32_scales():
    torch.manual_seed(1)
    layer = ConvRotInt8Linear.from_linear(torch.nn.Linear(32, 16), 16)
    weight, scale = layer.weight.clone(), layer.weight_scale.clone()
    layer.to(BF16)
    assert layer.weight.dtype == torch.int8 and torch.equal(layer.weight, weight)
    assert layer.weight_scale.dtype == F32 and torch.equal(layer.weight_scale, scale)  # not rounded through bf16
    assert layer.bias.dtype == BF16 and layer(torch.randn(2, 32, dtype=BF16)).dtype == BF16
    layer.half().float().to("cpu")
    assert torch.equal(layer.weight_scale, scale)
    fresh = ConvRotInt8Linear(32, 16, group_size=16)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.weight, weight) and torch.equal(fresh.weight_scale, scale)


_UNPICKLE_AND_RUN = r"""
import pickle, sys, torch
layer, x, expected = pickle.load(sys.stdin.buffer)  # nothing imported comfy_kitchen in this process before
assert torch.equal(layer(x), expected)
"""


def test_an_unpickled_layer_runs_in_a_fresh_process():
    """A layer unpickled in another process skips `__init__` (the worker processes of graph_runtime/parallel receive
    rank 0's model that way): its forward must still find comfy-kitchen's `int8_linear` op there, and give the
    sending process's output exactly (same op, same inputs, both on the CPU)."""
    import pickle
    import subprocess
    import sys

    torch.manual_seed(5)
    layer = ConvRotInt8Linear.from_linear(torch.nn.Linear(32, 16), 16)
    x = torch.randn(3, 32)
    done = subprocess.run([sys.executable, "-c", _UNPICKLE_AND_RUN], input=pickle.dumps((layer, x, layer(x))),
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_model_dtype_stays_the_float_dtype_with_int8_layers(tiny_parts):
    """diffusers' ModelMixin.dtype (first floating parameter) and the runtime's first-parameter reads see the
    compute dtype: int8 blocks do not change them."""
    import copy

    model = copy.deepcopy(tiny_parts["transformer"]).to(BF16)
    assert quantize_linears_(model, 16, lambda name, _: name.startswith("transformer_blocks.")) == BLOCK_LINEARS
    assert model.dtype == BF16 and next(model.parameters()).dtype == BF16
    assert len(int8_modules(model)) == BLOCK_LINEARS


def test_requantize_writes_into_the_same_storage():
    torch.manual_seed(2)
    layer = ConvRotInt8Linear.from_linear(torch.nn.Linear(64, 32, bias=False), 16)
    pointers = layer.weight.data_ptr(), layer.weight_scale.data_ptr()
    new = torch.randn(32, 64) * 0.3
    layer.requantize_(new)
    assert (layer.weight.data_ptr(), layer.weight_scale.data_ptr()) == pointers
    q, scale = quantize_weight(new, 16)
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale)
    # Rounding in the rotated basis moves each value by at most half a step (scale / 2); the rotation is orthonormal,
    # so a row's L2 error is at most sqrt(in) * scale / 2.
    error = (layer.dequantized_weight() - new).norm(dim=1)
    assert bool((error <= 64 ** 0.5 * layer.weight_scale[:, 0] / 2 * (1 + 1e-5)).all())
    with pytest.raises(ValueError, match="shape"):
        layer.requantize_(torch.randn(64, 32))


def test_splitting_a_fused_weight_by_rows_is_exact():
    """ComfyUI fuses the MLP's gate and up projections; rows are quantized and rotated independently, so splitting
    the int8 rows with their scales gives exactly the halves of the dequantized fused weight."""
    torch.manual_seed(3)
    fused = torch.randn(192, 32)
    q, scale = quantize_weight(fused, 16)
    whole = dequantize_weight(q, scale, 16, dtype=BF16)
    for rows in (slice(0, 96), slice(96, 192)):
        assert torch.equal(dequantize_weight(q[rows], scale[rows], 16, dtype=BF16), whole[rows])
        assert torch.equal(quantize_weight(fused[rows], 16)[0], q[rows])


def test_embedding_lookup_dequantizes_only_the_rows_asked_for():
    torch.manual_seed(4)
    table = torch.randn(300, 64)
    q, scale = quantize_weight(table, 16)
    embed = ConvRotInt8Embedding.from_quantized(q, scale, 16, output_dtype=F32)
    ids = torch.tensor([[0, 7, 299, 7]])
    assert torch.equal(embed(ids), embed.dequantized_weight(F32)[ids])
    head = ConvRotInt8Linear.sharing(embed)
    assert head.weight is embed.weight and head.weight_scale is embed.weight_scale
    assert embed.to(BF16)(ids).dtype == BF16 and embed.weight_scale.dtype == F32


@pytest.mark.parametrize("group, width, ok", [(16, 96, True), (256, 4096, True), (64, 96, False), (32, 64, False),
                                              (8, 64, False), (1, 64, False)])
def test_group_sizes_are_powers_of_four_dividing_the_input(group, width, ok):
    assert (group_size_problem(group, width) is None) == ok


# -------------------------------------------------------------------------------------------- files and loading


def test_tiny_int8_files_carry_comfyui_records_under_the_released_names(files):
    assert {files[k].name for k in INT8_FILES} == {"qwen_image_2.1_int8_convrot.safetensors",
                                                   "qwen_image_2.1_turbo_int8_convrot.safetensors",
                                                   "qwen3vl_8b_int8_convrot.safetensors"}
    for name in INT8_FILES:
        info = inspect_checkpoint(files[name])
        assert info.quantized == f"int8 ConvRot (group {TINY_CONVROT_GROUP})"
    dit = load_file(str(files["transformer"]))
    key = T_PREFIX + "transformer_blocks.0.img_mlp.gate_up"
    assert dit[key + ".weight"].dtype == torch.int8 and dit[key + ".weight_scale"].shape == (192, 1)
    assert json.loads(bytes(dit[key + ".comfy_quant"].tolist())) == {
        "format": "int8_tensorwise", "convrot": True, "convrot_groupsize": TINY_CONVROT_GROUP}
    assert dit[T_PREFIX + "img_in.weight"].dtype == BF16  # layers without a record stay bf16


def test_int8_mode_keeps_the_files_tensors_in_the_blocks(files):
    model = load_transformer(files["transformer"], dtype=BF16)
    layers = int8_modules(model)
    assert len(layers) == BLOCK_LINEARS and all(type(m) is ConvRotInt8Linear for m in layers)
    assert type(model.modulation[1]) is torch.nn.Linear and model.modulation[1].weight.dtype == BF16
    stored = load_file(str(files["transformer"]))
    fused = T_PREFIX + "transformer_blocks.1.img_mlp.gate_up"
    mlp = model.transformer_blocks[1].img_mlp
    for half, layer in ((slice(0, 96), mlp.gate_layer), (slice(96, 192), mlp.proj)):
        assert torch.equal(layer.weight, stored[fused + ".weight"][half])
        assert torch.equal(layer.weight_scale, stored[fused + ".weight_scale"][half])
    assert model.dtype == BF16 and not any(p.requires_grad for p in model.parameters())


def test_dequantize_mode_holds_the_dequantized_weights(files):
    int8 = load_transformer(files["transformer"], dtype=BF16)
    plain = load_transformer(files["transformer"], dtype=BF16, quantized="dequantize")
    assert not int8_modules(plain)
    for name, module in int8.named_modules():
        if isinstance(module, ConvRotInt8Linear):
            assert torch.equal(plain.get_submodule(name).weight, module.dequantized_weight(BF16)), name
    # the layer int8 mode dequantizes too (outside the blocks) is the same in both
    assert torch.equal(plain.modulation[1].weight, int8.modulation[1].weight)


def test_turbo_file_is_its_own_model(files):
    base = load_transformer(files["transformer"], dtype=BF16)
    turbo = load_transformer(files["turbo_transformer"], dtype=BF16)
    assert len(int8_modules(turbo)) == BLOCK_LINEARS
    assert not torch.equal(turbo.transformer_blocks[0].attn.to_q.weight, base.transformer_blocks[0].attn.to_q.weight)


def test_bf16_file_loads_the_same_whatever_the_mode(files):
    a = load_transformer(files["transformer_bf16"], dtype=BF16)
    b = load_transformer(files["transformer_bf16"], dtype=BF16, quantized="dequantize")
    assert not int8_modules(a)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_unknown_mode_is_an_input_error(files):
    with pytest.raises(InputError, match="quantized"):
        load_transformer(files["transformer"], quantized="int4")


# ------------------------------------------------------------------------------------------------ sampling runs


def _latents(model, embeds, steps=4, dtype=BF16, trajectory=None):
    request = SamplingRequest(positive=embeds, latent_height=8, latent_width=8, seed=3, steps=steps,
                              decode_mode="eager")
    on_step = None if trajectory is None else (lambda i, n, x: trajectory.append(x.clone()))
    return sample(loaded_for(model).engine, request, on_step=on_step).latents


@pytest.fixture(scope="module")
def embeds(generator):
    return generator.encoder.encode(PROMPT)


def test_dequantized_run_equals_the_bf16_model_of_the_dequantized_weights(files, embeds, tmp_path):
    """The dequantize mode is nothing but a bf16 model: written out as an ordinary bf16 ComfyUI file of those
    weights and loaded back, it samples bit-identical latents."""
    dequantized = load_transformer(files["transformer"], dtype=BF16, quantized="dequantize")
    path = tmp_path / "qwen_image_2.1_bf16.safetensors"
    save_file({k: v.contiguous() for k, v in transformer_to_comfy_state_dict(dequantized.state_dict()).items()},
              str(path))
    as_bf16_file = load_transformer(path, dtype=BF16)
    assert torch.equal(_latents(dequantized, embeds), _latents(as_bf16_file, embeds))


def test_int8_run_stays_within_the_bound_its_layer_errors_give(files, embeds):
    """Bound, first order: each int8 layer's output is off by its measured relative error d_l (activation rounding;
    same weights). With residual connections and norms passing a relative error on with gain at most 1, a velocity
    is off by at most sum(d_l) of its size; Euler's update adds velocities scaled by the sigma steps, so the final
    latents are off by at most sum(d_l) * (path length of the dequantized trajectory, sum of |x_t+1 - x_t|)
    relative to their own size. Run in fp32 so bf16 rounding of the activations does not enter."""
    int8 = load_transformer(files["transformer"], dtype=F32)
    plain = load_transformer(files["transformer"], dtype=F32, quantized="dequantize")
    errors = LayerErrors(int8)
    ours = _latents(int8, embeds, dtype=F32)
    errors.remove()
    trajectory = [initial_noise(3, 1, 64, 8, 8, F32)]
    reference = _latents(plain, embeds, dtype=F32, trajectory=trajectory)
    assert len(errors.worst) == BLOCK_LINEARS
    path = sum((b - a).norm().item() for a, b in zip(trajectory, trajectory[1:]))
    bound = sum(errors.worst.values()) * path / reference.norm().item()
    measured = relative(ours, reference)
    print(f"int8 vs dequantized latents: relative {measured:.2e}, bound {bound:.2e} "
          f"(layer errors {min(errors.worst.values()):.1e}..{max(errors.worst.values()):.1e})")
    assert 0 < measured <= bound  # nonzero: the int8 GEMMs really ran


# --------------------------------------------------------------------------------------------- the text encoder


@pytest.fixture(scope="module")
def text_encoders(files):
    def load(path, **kw):
        from graph_runtime.encoding.prompt import PromptEncoder

        model, processor = load_text_encoder(path, dtype=F32, tokenizer_dir=files["tokenizer"], **kw)
        return PromptEncoder(model, processor)

    return {"int8": load(files["text_encoder"]), "dequantize": load(files["text_encoder"], quantized="dequantize"),
            "bf16": load(files["text_encoder_bf16"])}


def test_text_encoder_int8_layers_and_tied_head(text_encoders):
    model = text_encoders["int8"].text_encoder
    embed = model.get_input_embeddings()
    assert isinstance(embed, ConvRotInt8Embedding)
    assert model.lm_head.weight is embed.weight  # tied head reads the same int8 rows: no second table
    linears = [m for m in int8_modules(model) if isinstance(m, ConvRotInt8Linear)]
    visual = [m for n, m in model.named_modules() if n.startswith("model.visual.") and isinstance(m, ConvRotInt8Linear)]
    assert len(linears) == 2 * 7 + len(visual) and visual  # text layers and the vision tower ("params" records)
    assert not int8_modules(text_encoders["dequantize"].text_encoder)


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_text_encoder_conditioning_has_the_bf16_files_semantics(text_encoders, reference_image, with_image):
    """Same shapes, masks and dropped system turn as the bf16 file in both modes; int8 values within the bound of
    the layer errors (first order, as for the DiT: the hidden state is off by at most sum(d_l) relative)."""
    from graph_runtime.encoding.images import prepare_references

    images = [prepare_references([reference_image], 128)[0].vision_image] if with_image else []
    errors = LayerErrors(text_encoders["int8"].text_encoder)
    out = {name: enc.encode(PROMPT, images) for name, enc in text_encoders.items()}
    errors.remove()
    for name in ("int8", "dequantize"):
        assert text_encoders[name].drop_idx == text_encoders["bf16"].drop_idx
        assert out[name].embeds.shape == out["bf16"].embeds.shape
        assert torch.equal(out[name].image_mask, out["bf16"].image_mask)
        assert (out[name].text_mask is None) == (out["bf16"].text_mask is None)
    assert out["bf16"].num_image_slots == (out["bf16"].image_mask.sum().item() if with_image else 0)
    used = {k: v for k, v in errors.worst.items() if k != "lm_head"}  # the head's logits feed no hidden state
    bound = sum(used.values())
    measured = relative(out["int8"].embeds, out["dequantize"].embeds)
    print(f"text encoder int8 vs dequantized: relative {measured:.2e}, bound {bound:.2e} over {len(used)} layers")
    assert 0 < measured <= bound


# ------------------------------------------------------------------------------------------------ bad files


def _bad_copy(files, bad_dir, name, edit):
    tensors = load_file(str(files["transformer"]))
    edit(tensors)
    path = bad_dir / f"{name}.safetensors"
    save_file(tensors, str(path))
    return path


TO_Q = T_PREFIX + "transformer_blocks.0.attn.to_q"


def _set_record(record):
    def edit(tensors):
        tensors[TO_Q + ".comfy_quant"] = torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)
    return edit


@pytest.mark.parametrize("case, edit, words", [
    ("missing_scale", lambda t: t.pop(TO_Q + ".weight_scale"), ["no", TO_Q + ".weight_scale"]),
    ("unknown_format", _set_record({"format": "convrot_w4a4"}), ["'convrot_w4a4'", TO_Q + ".comfy_quant"]),
    ("group_32", _set_record({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 32}),
     ["group size 32", "power of 4", TO_Q + ".comfy_quant"]),
    ("group_not_dividing", _set_record({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64}),
     ["does not divide", "32 input features", TO_Q]),
    ("scale_shape", lambda t: t.__setitem__(TO_Q + ".weight_scale", torch.ones(3, 1)), ["[3, 1]", TO_Q]),
    ("record_not_json", lambda t: t.__setitem__(TO_Q + ".comfy_quant", torch.tensor([0xFF, 0x00],
                                                                                   dtype=torch.uint8)),
     ["JSON", TO_Q + ".comfy_quant"]),
    ("scale_without_record", lambda t: t.pop(TO_Q + ".comfy_quant"), [TO_Q + ".weight_scale", "without"]),
    ("int8_without_record", lambda t: (t.pop(TO_Q + ".comfy_quant"), t.pop(TO_Q + ".weight_scale")),
     [TO_Q + ".weight", "without a quantization record"]),
])
def test_bad_quantized_files_name_the_file_and_the_key(files, bad_dir, case, edit, words):
    path = _bad_copy(files, bad_dir, case, edit)
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(path)
    message = str(excinfo.value)
    assert message.startswith(str(path)) and all(w in message for w in words), message
    load_transformer(files["transformer"])  # nothing left behind: the next good load works


def test_full_precision_record_is_dequantized_in_int8_mode(files, bad_dir):
    record = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 16,
              "full_precision_matrix_mult": True}
    path = _bad_copy(files, bad_dir, "full_precision", _set_record(record))
    model = load_transformer(path, dtype=BF16)
    assert type(model.transformer_blocks[0].attn.to_q) is torch.nn.Linear
    assert len(int8_modules(model)) == BLOCK_LINEARS - 1


def test_quantized_vae_file_is_refused_naming_its_format(files, bad_dir):
    from graph_runtime.loading import load_vae

    tensors = load_file(str(files["vae_bf16"]))
    key = "decoder.middle.1.to_qkv"
    tensors[key + ".comfy_quant"] = record_tensor(16)
    tensors[key + ".weight_scale"] = torch.ones(1)
    path = bad_dir / "vae_int8.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="int8 ConvRot"):
        load_vae(path)


def test_cli_generates_from_the_int8_files(files, tmp_path, capsys):
    """`make-tiny --comfyui-models` writes the INT8 files too, and `generate` runs them (int8 mode, which `auto`
    keeps); an FP8 precision picked by hand dequantizes the INT8 file first, as the loader nodes do."""
    from PIL import Image

    from graph_runtime.cli import main

    models = tmp_path / "models"
    assert main(["make-tiny", "--comfyui-models", str(models)]) == 0
    assert "INT8 ConvRot" in capsys.readouterr().out
    out = tmp_path / "int8.png"
    assert main(["generate", "--out", str(out), "--width", "64", "--height", "64", "--steps", "2",
                 "--transformer", str(models / INT8_FILES["transformer"]),
                 "--vae", str(models / "vae" / "qwen_image_2.1_vae_bf16.safetensors"),
                 "--text-encoder", str(models / INT8_FILES["text_encoder"]),
                 "--tokenizer", str(files["tokenizer"])]) == 0
    assert Image.open(out).size == (64, 64)
    # What runs, named as it is: int8, the file's int8 ConvRot weights (the tiny model's embedding tables are the
    # float part), computing in fp32 on the CPU.
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("precision:"))
    assert line.startswith("precision: int8 (") and "int8 ConvRot" in line and "fp32 compute" in line
    assert "auto: an INT8 ConvRot file runs its own int8 weights" in line
    assert main(["generate", "--out", str(out), "--overwrite", "--width", "64", "--height", "64", "--steps", "1",
                 "--transformer", str(models / INT8_FILES["transformer"]),
                 "--vae", str(models / "vae" / "qwen_image_2.1_vae_bf16.safetensors"),
                 "--text-encoder", str(models / INT8_FILES["text_encoder"]),
                 "--tokenizer", str(files["tokenizer"]), "--precision", "fp8-attn"]) == 0
    assert "precision: fp8-attn (chosen): 8 block Linears in FP8" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- comfy-kitchen's version


def _required_kitchen(text: str) -> str:
    import re

    found = re.findall(r"comfy-kitchen>=([0-9.]+)", text)
    assert len(found) == 1, found
    return found[0]


def test_requirements_ask_the_oldest_comfy_kitchen_the_int8_layers_run_on():
    """The pack requires the comfy-kitchen release its int8 layers need (`INT8_LAYERS`), in requirements.txt and in
    pyproject alike, and no newer than the 0.2.31 that ComfyUI 0.33.0 pins: installing the pack never replaces
    ComfyUI's own pin. A feature needing a newer release (the int8 embedding table) checks at run time instead."""
    from pathlib import Path

    from packaging.version import Version

    from graph_runtime.quantized import kitchen

    root = Path(__file__).resolve().parents[1]
    floors = {_required_kitchen((root / name).read_text()) for name in ("requirements.txt", "pyproject.toml")}
    assert floors == {kitchen.INT8_LAYERS}
    assert Version(kitchen.INT8_LAYERS) <= Version(kitchen.INT8_EMBEDDING) <= Version("0.2.31")


def test_an_older_comfy_kitchen_is_named_when_a_feature_needs_a_newer_one(files, monkeypatch):
    """With a comfy-kitchen older than the int8 embedding table needs (0.2.20 here), loading the INT8 text encoder
    kept int8 fails at once with an error naming the version needed, the one installed and the workaround
    (dequantize), not an AttributeError from inside comfy-kitchen; the dequantized load and the int8 DiT still work.
    Without comfy-kitchen at all, an int8 layer says that it is not installed."""
    from graph_runtime.errors import DependencyError
    from graph_runtime.quantized import kitchen

    monkeypatch.setattr(kitchen, "installed_version", lambda: "0.2.20")
    with pytest.raises(DependencyError) as err:
        load_text_encoder(files["text_encoder"], dtype=F32, tokenizer_dir=files["tokenizer"])
    message = str(err.value)
    assert f">= {kitchen.INT8_EMBEDDING}" in message and "0.2.20 is installed" in message
    assert "int8_weights 'dequantize'" in message
    model, _ = load_text_encoder(files["text_encoder"], dtype=F32, tokenizer_dir=files["tokenizer"],
                                 quantized="dequantize")
    assert not int8_modules(model)
    assert len(int8_modules(load_transformer(files["transformer"], dtype=F32))) == BLOCK_LINEARS

    monkeypatch.setattr(kitchen, "installed_version", lambda: None)
    with pytest.raises(DependencyError, match="comfy-kitchen is not installed"):
        load_transformer(files["transformer"], dtype=F32)
