"""The command line's main job and its tiny-model writer, run in-process."""

import pytest
from PIL import Image

from graph_runtime.cli import main


def test_generate_with_the_built_in_tiny_model_writes_the_requested_png(tmp_path, capsys):
    """The README's first command: no model given -> the tiny default, said so, and a 256x256 PNG."""
    out = tmp_path / "x.png"
    assert main(["generate", "--out", str(out), "--width", "256", "--height", "256", "--steps", "4"]) == 0
    printed = capsys.readouterr().out
    assert "tiny built-in" in printed and "prefill_ms" in printed and '"eager_steps"' in printed
    assert Image.open(out).size == (256, 256)


def test_generate_from_a_diffusers_folder_and_from_single_files(tmp_path, tiny_folder, capsys):
    """Both on-disk layouts drive the same CLI; `--repeat 2` shows the manager serving the second run."""
    assert main(["make-tiny", "--comfyui-models", str(tmp_path / "models")]) == 0
    models = tmp_path / "models"
    out = tmp_path / "folder.png"
    assert main(["generate", "--model", str(tiny_folder), "--out", str(out), "--width", "128", "--height", "96",
                 "--steps", "2", "--repeat", "2"]) == 0
    assert Image.open(out).size == (128, 96)
    single = tmp_path / "single.png"
    assert main(["generate", "--out", str(single), "--width", "64", "--height", "64", "--steps", "2",
                 "--transformer", str(models / "diffusion_models" / "qwen_image_2.1_bf16.safetensors"),
                 "--vae", str(models / "vae" / "qwen_image_2.1_vae_bf16.safetensors"),
                 "--text-encoder", str(models / "text_encoders" / "qwen3vl_8b_bf16.safetensors"),
                 "--tokenizer", str(tiny_folder)]) == 0
    assert Image.open(single).size == (64, 64)
    assert capsys.readouterr().out.count("graph statistics for this run") == 3


def test_bad_size_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    assert main(["generate", "--out", str(tmp_path / "x.png"), "--width", "250", "--height", "256",
                 "--steps", "2"]) == 2
    assert "width=250 is invalid: expected a positive multiple of 16" in capsys.readouterr().err


def test_single_file_loading_needs_all_three_files(tmp_path):
    with pytest.raises(SystemExit, match="missing --vae, --text-encoder"):
        main(["generate", "--out", str(tmp_path / "x.png"), "--transformer", "t.safetensors"])
