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


def test_prefix_placement_option_reaches_the_run_and_equals_the_gpu_prefix(tmp_path, capsys):
    """`--prefix-placement host` keeps the prefix in host memory (the run's statistics count it) and writes the same
    image as the default placement (the same values, moved: bit-equal on the CPU)."""
    images = {}
    for placement in ("gpu", "host"):
        images[placement], printed = _small_run(tmp_path, capsys, "--prefix-placement", placement)
        assert f'"prefix_placements": {{"{placement}": 1}}' in printed
    assert images["gpu"] == images["host"]


def _small_run(tmp_path, capsys, option: str, value: str) -> tuple[bytes, str]:
    """A 128x128 two-step run of the tiny model with `option value`: its image's pixels and what it printed."""
    out = tmp_path / f"{value}.png"
    assert main(["generate", "--out", str(out), "--width", "128", "--height", "128", "--steps", "2", option,
                 value]) == 0
    return Image.open(out).tobytes(), capsys.readouterr().out


def test_text_encoder_placement_option_reaches_the_encode_and_streamed_equals_the_default(tmp_path, capsys):
    """`--text-encoder-placement streamed` reaches the encode (the run says which placement ran) and writes the same
    image as the default: on the CPU there is no GPU to stream to, so the encoder runs whole where its weights are, as
    the loader nodes do there (bit-equal: the same computation)."""
    images = {}
    for choice, ran in (("auto", "gpu while encoding, then offload"), ("streamed", "streamed by layer")):
        images[choice], printed = _small_run(tmp_path, capsys, "--text-encoder-placement", choice)
        assert f"text_encoder_placement {ran}" in printed
    assert images["auto"] == images["streamed"]


def test_a_bad_text_encoder_placement_is_refused_naming_the_option_and_the_choices(tmp_path, capsys,
                                                                                     no_model_loading):
    """An unknown placement (the node's long spelling included: the shell takes one word) is a usage error that
    names the option and every choice, before any model loads."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--out", str(tmp_path / "x.png"), "--text-encoder-placement", "layers"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--text-encoder-placement" in err and "'layers'" in err
    assert all(f"'{c}'" in err for c in ("auto", "offload", "gpu", "streamed", "cpu"))


def test_the_cli_placement_names_are_the_loader_nodes_choices():
    """Each one-word choice maps onto one of the placements the memory plan and the loader nodes know, all covered."""
    from graph_runtime.cli import build_parser
    from graph_runtime.encoding.placed import CLI_PLACEMENTS
    from graph_runtime.memory import plan

    action = next(a for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions
                  if "--text-encoder-placement" in a.option_strings)
    assert list(action.choices) == list(CLI_PLACEMENTS)
    assert sorted(CLI_PLACEMENTS.values()) == sorted((plan.TE_AUTO, *plan.TE_PLACEMENTS))


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
    assert "--width=250 is invalid: expected a multiple of 16 pixels" in capsys.readouterr().err


def test_single_file_loading_needs_all_three_files(tmp_path, capsys):
    transformer = tmp_path / "t.safetensors"
    transformer.write_bytes(b"")
    assert main(["generate", "--out", str(tmp_path / "x.png"), "--transformer", str(transformer)]) == 2
    assert "--vae, --text-encoder=None is invalid: expected all three single files" in capsys.readouterr().err


# -- arguments are checked before any model is loaded ---------------------------------------------------------------


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the CLI gets as far as loading a model."""
    import graph_runtime.cli as cli

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "load_models", refuse)


@pytest.fixture
def bad_files(tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    strip = tmp_path / "strip.png"
    Image.new("RGB", (1, 6000), (10, 20, 30)).save(strip)
    return {"text": str(text), "strip": str(strip), "missing": str(tmp_path / "missing.png")}


@pytest.mark.parametrize("extra,message", [
    (["--repeat", "0"], "--repeat=0 is invalid: expected an integer >= 1"),
    (["--steps", "0"], "--steps=0 is invalid"),
    (["--batch", "0"], "--batch=0 is invalid"),
    (["--reference-resolution", "0"], "--reference-resolution=0 is invalid"),
    (["--seed", "-1"], "--seed=-1 is invalid: expected an integer in [0, 18446744073709551615]"),
    (["--seed", str(2**64)], "--seed=18446744073709551616 is invalid"),
    (["--cfg", "nan"], "--cfg=nan is invalid: expected a finite number >= 1"),
    (["--cfg", "0.5"], "--cfg=0.5 is invalid"),
    (["--width", "0"], "--width=0 is invalid: expected a multiple of 16 pixels"),
    (["--height", "0"], "--height=0 is invalid"),
    (["--device", "gpu"], "--device='gpu' is invalid: expected a device of this machine"),
    (["--image", "{missing}"], "--image='{missing}' is invalid: expected an existing image file"),
    (["--image", "{text}"], "--image='{text}' is invalid: expected a PNG, JPEG or WebP image file"),
    (["--image", "{strip}"], "--image {strip}='1x6000 px' is invalid: expected an image whose sides differ by at"),
    (["--model", "{missing}"], "--model='{missing}' is invalid: expected an existing file or folder"),
    (["--keep-alpha", "--out", "{out}.jpg"], "--out='{out}.jpg' is invalid: expected a .png or .webp file with "
                                             "--keep-alpha"),
    (["--out", "{out}.gif"], "--out='{out}.gif' is invalid: expected a file name ending in .png, .webp, .jpg, .jpeg"),
    (["--out", "{out}"], "--out='{out}' is invalid: expected a file name ending in"),
])
def test_bad_arguments_fail_before_any_model_is_loaded(tmp_path, capsys, no_model_loading, bad_files, extra,
                                                       message):
    names = dict(bad_files, out=str(tmp_path / "x"))
    extra = [e.format(**names) for e in extra]
    argv = ["generate", "--out", str(tmp_path / "x.png")] + extra
    assert main(argv) == 2
    assert message.format(**names) in capsys.readouterr().err


def test_device_cuda_without_cuda_is_refused_before_loading(tmp_path, capsys, no_model_loading, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["generate", "--out", str(tmp_path / "x.png"), "--device", "cuda"]) == 2
    assert ("--device='cuda' is invalid: expected a device of this machine: cpu (no CUDA device is available here)"
            in capsys.readouterr().err)


def _pixels(path):
    import numpy as np

    return np.asarray(Image.open(path))


def test_a_good_run_after_refused_arguments_equals_the_first(tmp_path, capsys, bad_files):
    import numpy as np

    good = ["generate", "--width", "64", "--height", "64", "--steps", "2", "--seed", "5"]
    assert main(good + ["--out", str(tmp_path / "first.png")]) == 0
    for bad in (["--seed", "-1"], ["--image", bad_files["strip"]], ["--cfg", "inf"], ["--prompt", "x " * 20000]):
        assert main(good + bad + ["--out", str(tmp_path / "bad.png")]) == 2
    assert main(good + ["--out", str(tmp_path / "again.png")]) == 0
    assert np.array_equal(_pixels(tmp_path / "first.png"), _pixels(tmp_path / "again.png"))
    assert not (tmp_path / "bad.png").exists()
    assert "prompt='40000 characters" in capsys.readouterr().err


# -- the written image ----------------------------------------------------------------------------------------------


def test_png_is_rgb_over_white_by_default_and_keep_alpha_keeps_the_alpha(tmp_path):
    """What the nodes show: the VAE's RGBA composited over white. The tolerance is two 8-bit roundings (the RGBA file
    rounds colour and alpha once each before this test composites them again). Both files are the threaded PNG
    writer's at ComfyUI's SaveImage level 4 (the same bytes it gives for the decoded pixels), not PIL's default."""
    import numpy as np

    from graph_runtime.png_writer import encode_png

    args = ["generate", "--width", "64", "--height", "64", "--steps", "2"]
    assert main(args + ["--out", str(tmp_path / "rgb.png")]) == 0
    assert main(args + ["--out", str(tmp_path / "rgba.png"), "--keep-alpha"]) == 0
    rgb, rgba = Image.open(tmp_path / "rgb.png"), Image.open(tmp_path / "rgba.png")
    assert rgb.mode == "RGB" and rgba.mode == "RGBA"
    for name, image in (("rgb.png", rgb), ("rgba.png", rgba)):
        assert (tmp_path / name).read_bytes() == encode_png(Image.fromarray(np.asarray(image)), 4)
    colour = np.asarray(rgba)[..., :3].astype(float) / 255
    alpha = np.asarray(rgba)[..., 3:].astype(float) / 255
    assert alpha.min() < 0.98  # not opaque: compositing changes the picture, so the test can tell the two apart
    over_white = colour * alpha + (1 - alpha)
    assert np.abs(np.asarray(rgb) / 255 - over_white).max() <= 2 / 255 + 1e-9


def test_jpeg_output_is_written_as_rgb(tmp_path, capsys):
    out = tmp_path / "out" / "x.jpg"
    assert main(["generate", "--width", "64", "--height", "64", "--steps", "2", "--out", str(out)]) == 0
    image = Image.open(out)
    assert image.format == "JPEG" and image.mode == "RGB" and image.size == (64, 64)
    assert f"wrote {out} (64x64 RGB)" in capsys.readouterr().out


# -- --out: checked before the run, never replaced silently, never left half written -------------------------------


def test_an_existing_out_and_the_batch_files_are_refused_before_loading_unless_overwrite(tmp_path, capsys,
                                                                                       no_model_loading):
    """An existing --out, and an existing NAME_i file of the ones --batch derives, are refused before any model
    loads (the files unchanged); a NAME_i beyond the batch does not count."""
    keep = tmp_path / "keep.png"
    keep.write_bytes(b"my picture")
    assert main(["generate", "--out", str(keep)]) == 2
    assert f"--out='{keep}' is invalid: expected a file that does not exist yet" in capsys.readouterr().err
    (tmp_path / "batch_1.png").write_bytes(b"batch image 1")
    (tmp_path / "batch_7.png").write_bytes(b"not part of a batch of 3")
    assert main(["generate", "--out", str(tmp_path / "batch.png"), "--batch", "3"]) == 2
    assert f"--out='{tmp_path / 'batch_1.png'}' is invalid: expected a file that does not exist yet" in \
        capsys.readouterr().err
    assert keep.read_bytes() == b"my picture" and (tmp_path / "batch_1.png").read_bytes() == b"batch image 1"


def test_overwrite_replaces_the_out_file_and_the_batch_files(tmp_path, capsys):
    keep = tmp_path / "keep.png"
    keep.write_bytes(b"my picture")
    (tmp_path / "keep_1.png").write_bytes(b"old batch image")
    args = ["generate", "--width", "32", "--height", "32", "--steps", "1", "--overwrite"]
    assert main(args + ["--out", str(keep)]) == 0
    assert Image.open(keep).size == (32, 32)
    assert main(args + ["--out", str(keep), "--batch", "2"]) == 0
    assert Image.open(tmp_path / "keep_1.png").size == (32, 32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.png", "keep_0.png", "keep_1.png"]


@pytest.mark.parametrize("case", ["parent is a file", "name too long", "folder not writable"])
def test_an_out_that_cannot_be_written_is_refused_before_loading(tmp_path, capsys, no_model_loading, monkeypatch,
                                                                 case):
    """Where --out can not go is found before any model runs, naming --out and why."""
    import os

    if case == "parent is a file":
        (tmp_path / "file").write_text("a file")
        out, expected = tmp_path / "file" / "x.png", f"a path inside a folder: {tmp_path / 'file'} is a file"
    elif case == "name too long":
        out, expected = tmp_path / ("n" * 300 + ".png"), "names of at most"
    else:  # root may write anywhere, so the permission the check reads is simulated
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path / "locked")
                            else real_access(path, mode))
        (tmp_path / "locked").mkdir()
        out, expected = tmp_path / "locked" / "x.png", f"{tmp_path / 'locked'} is not writable"
    assert main(["generate", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out=") and " is invalid: expected " in err and expected in err
    assert "Traceback" not in err


def _disk_full_after(monkeypatch, module, name, nbytes=100):
    """Make `module.name(..., file)` write `nbytes` and then fail as a full disk does (ENOSPC)."""
    import errno

    real = getattr(module, name)

    def write_then_fail(*args, **kwargs):
        file = next(a for a in [*args, *kwargs.values()] if hasattr(a, "write"))
        file.write(b"x" * nbytes)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, name, write_then_fail)
    return real


def test_a_full_disk_leaves_the_existing_out_whole_and_no_partial_file(tmp_path, capsys, monkeypatch):
    """The image goes to a temporary file beside --out and is renamed over it only once complete: a write that
    fails (ENOSPC) leaves keep.png as it was, no temporary file, and a one-line error."""
    keep = tmp_path / "keep.png"
    keep.write_bytes(b"my picture")
    import graph_runtime.output_files as output_files

    _disk_full_after(monkeypatch, output_files, "write_png")  # what writes a PNG's bytes
    args = ["generate", "--width", "32", "--height", "32", "--steps", "1"]
    assert main(args + ["--out", str(keep), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"error: {keep} could not be written: the disk is full (the existing file is unchanged)." in err
    assert keep.read_bytes() == b"my picture"
    assert main(args + ["--out", str(tmp_path / "new.png")]) == 2
    assert "(nothing was written)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.png"]


def test_ctrl_c_during_the_load_ends_without_a_traceback(tmp_path, capsys, monkeypatch):
    import graph_runtime.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_models", interrupted)
    assert main(["generate", "--out", str(tmp_path / "x.png")]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert not (tmp_path / "x.png").exists()


# -- the CPU has a memory budget too ---------------------------------------------------------------------------------


def test_the_cpu_refuses_what_host_memory_cannot_hold_and_the_next_run_equals_the_first(tmp_path, capsys,
                                                                                       monkeypatch):
    """`--device cpu` is budgeted as CUDA is, against the host's available memory (pinned here to 4 GiB, so the test
    does not depend on the machine): 16384x16384 is refused naming the size that fits, a batch of 100000000 naming
    the batch that fits, each before anything is allocated and without a traceback; a good run afterwards equals the
    first, pixel for pixel."""
    import numpy as np

    import graph_runtime.memory as memory

    monkeypatch.setattr(memory.free, "host_available_bytes", lambda: 4 * 2**30)
    good = ["generate", "--device", "cpu", "--width", "64", "--height", "64", "--steps", "1", "--seed", "3"]
    assert main(good + ["--out", str(tmp_path / "first.png")]) == 0
    capsys.readouterr()
    for extra, option in ((["--width", "16384", "--height", "16384"], "width x height at most "),
                          (["--batch", "100000000"], "batch ")):
        assert main(good + extra + ["--out", str(tmp_path / "refused.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: KV-Graph: this request needs ") and "on cpu, and 4.0 GiB is available" in err
        assert "Nothing was allocated" in err and f"Change one of: {option}" in err and "(fits)" in err
        assert "Traceback" not in err
    assert main(good + ["--out", str(tmp_path / "again.png")]) == 0
    assert np.array_equal(_pixels(tmp_path / "first.png"), _pixels(tmp_path / "again.png"))
    assert not (tmp_path / "refused.png").exists()


# -- what the command says about itself ----------------------------------------------------------------------------


def test_every_generate_option_has_one_help_line_with_its_default():
    """`generate --help`: every option has help text, and every option that takes a value and has a default says
    which (the required --out says it is required)."""
    from graph_runtime.cli import build_parser

    parser = build_parser()
    generate = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "generate")[1]
    missing = []
    for action in generate._actions:
        if "-h" in action.option_strings:
            continue
        text = action.help or ""
        if not text or ("(default" not in text and "(required)" not in text):
            missing.append(action.option_strings[0])
    assert missing == []


# -- make-tiny never overwrites ------------------------------------------------------------------------------------


def test_make_tiny_refuses_to_overwrite_a_real_checkpoint_unless_forced(tmp_path, capsys):
    models = tmp_path / "models"
    real = models / "diffusion_models" / "qwen_image_2.1_bf16.safetensors"
    real.parent.mkdir(parents=True)
    real.write_bytes(b"thirty gigabytes of real weights")
    assert main(["make-tiny", "--comfyui-models", str(models)]) == 2
    assert f"make-tiny output='{real}' is invalid" in capsys.readouterr().err
    assert real.read_bytes() == b"thirty gigabytes of real weights"
    assert not (models / "vae").exists()  # nothing at all was written

    assert main(["make-tiny", "--comfyui-models", str(models), "--force"]) == 0
    printed = capsys.readouterr().out
    for name in ("diffusion_models/qwen_image_2.1_bf16.safetensors", "vae/qwen_image_2.1_vae_bf16.safetensors",
                 "text_encoders/qwen3vl_8b_bf16.safetensors"):
        assert f"{models / name}" in printed
        assert (models / name).stat().st_size > 1000
    assert real.read_bytes() != b"thirty gigabytes of real weights"


def test_make_tiny_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")
    assert main(["make-tiny", str(folder), "--comfyui-models", str(tmp_path / "models")]) == 2
    assert f"make-tiny output='{folder}' is invalid" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()  # both targets are checked before either is written
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["make-tiny", str(empty)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote diffusers folder: {empty}" in printed and "model_index.json" in printed


@pytest.mark.parametrize("case", ["folder onto a file", "models onto a file", "folder not writable"])
def test_make_tiny_refuses_a_place_it_cannot_write_even_with_force(tmp_path, capsys, monkeypatch, case):
    """--force allows replacing files, not writing where no file can go: a one-line error, nothing written."""
    import os

    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    if case == "folder onto a file":
        argv, expected = [str(a_file)], f"make-tiny output='{a_file}' is invalid: expected a folder, not a file"
    elif case == "models onto a file":
        argv, expected = ["--comfyui-models", str(a_file)], f"a path inside a folder: {a_file} is a file"
    else:  # root may write anywhere, so the permission the check reads is simulated
        locked = tmp_path / "locked"
        locked.mkdir()
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(locked)
                            else real_access(path, mode))
        argv, expected = ["--comfyui-models", str(locked)], f"{locked} is not writable"
    before = sorted(tmp_path.rglob("*"))
    assert main(["make-tiny", *argv, "--force"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before and a_file.read_text() == "not a folder"


def test_make_tiny_on_a_full_disk_is_one_error_and_leaves_no_truncated_checkpoint(tmp_path, capsys, monkeypatch):
    """A single file is written beside its final name and renamed once complete: on a full disk (ENOSPC) the
    real checkpoint it was to replace is unchanged and no partial file is left; the diffusers folder's error says it
    may be incomplete."""
    import safetensors.torch
    from transformers import modeling_utils

    models = tmp_path / "models"
    real = models / "diffusion_models" / "qwen_image_2.1_bf16.safetensors"
    real.parent.mkdir(parents=True)
    real.write_bytes(b"thirty gigabytes of real weights")

    def full(*args, **kwargs):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save", lambda *a, **k: b"x" * 100 + full())
    assert main(["make-tiny", "--comfyui-models", str(models), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"error: {real} could not be written: the disk is full (the existing file is unchanged)." in err
    assert real.read_bytes() == b"thirty gigabytes of real weights"
    assert [p.name for p in real.parent.iterdir()] == [real.name]

    monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    assert main(["make-tiny", str(tmp_path / "pipe")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'pipe'} could not be written: No space left on device (the folder may be incomplete" in err
    assert "Traceback" not in err


# -- the benchmark is not part of the installed command line ------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--tiny", "--device", "cpu"], ["--e2e", "--out-dir", "x"], ["-h"]])
def test_bench_subcommand_points_to_the_repository_benchmark(capsys, extra):
    """`python -m graph_runtime bench ...` (any options the benchmark took) stops with exit code 2 and says the
    benchmark runs from a checkout as `python -m bench`, instead of a usage error about the options."""
    assert main(["bench"] + extra) == 2
    err = capsys.readouterr().err
    assert "not part of the installed package" in err and "`python -m bench [options]`" in err
    assert "checkout of the repository" in err


def test_other_subcommands_still_refuse_unknown_options(capsys):
    """Options after `bench` are let through only to reach the pointer above: elsewhere a typo is a usage error."""
    with pytest.raises(SystemExit) as exit_info:
        main(["make-tiny", "--tiny"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --tiny" in capsys.readouterr().err


SLOW_WRITE = """
import sys, time
import graph_runtime.output_files as output_files

def slow_save(file, image, image_format):
    file.write(b"\\x89PNG half of it")
    file.flush()
    print("writing", flush=True)
    time.sleep(120)

output_files.save_image = slow_save
import graph_runtime.cli as cli
cli.save_image = slow_save
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_write_leaves_no_partial_file(tmp_path, sig):
    """A real `generate` process stopped by SIGTERM (or Ctrl-C's SIGINT) while it writes --out: it exits with the
    shell's status for that signal, and neither the hidden temporary file nor a half-written --out is left."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out" / "image.png"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    process = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, "generate", "--width", "32", "--height", "32",
                                "--steps", "1", "--out", str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in process.stdout:  # the load and the run come first
            if line.strip() == "writing":
                break
        else:
            pytest.fail(f"the process ended before writing: {process.stderr.read()}")
        assert [p.name for p in out.parent.iterdir()][0].startswith(".kvgraph-")  # mid-write, the temporary file
        process.send_signal(getattr(signal, sig))
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == {"SIGTERM": 143, "SIGINT": 130}[sig], err
    assert list(out.parent.iterdir()) == []
    assert "Traceback" not in err


def test_generate_help_lists_every_precision_and_what_auto_picks(capsys):
    """`generate --help` names every `--precision` the loader accepts (int8 included) and says what auto picks: int8
    on compute capability 8.0+, as graph_runtime/fp8/auto.py resolves it."""
    from graph_runtime.cli import build_parser
    from graph_runtime.fp8.precisions import PRECISION_CHOICES

    generate = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith(
        "generate"))
    text = " ".join(generate.format_help().split())
    for precision in PRECISION_CHOICES:
        assert f"{precision} (" in text or f"{precision}," in text or f"{precision} or" in text, precision
    assert "int8 for an INT8 ConvRot file, and for bf16 weights of a float file on a GPU of compute capability 8.0+" \
        in text


def test_generate_prints_each_step_as_it_ends(tmp_path, capsys):
    """A long run is never silent: each sampling step prints a line as it ends, the last one saying the VAE decode
    comes next."""
    assert main(["generate", "--width", "32", "--height", "32", "--steps", "3", "--out", str(tmp_path / "a.png")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " step " in line]
    assert [line.split(" done")[0] for line in lines] == ["run 1: step 1/3", "run 1: step 2/3", "run 1: step 3/3"]
    assert lines[-1].endswith("; decoding with the VAE")


# -- what docs/robustness.md and docs/memory.md promise about large images ---------------------------------------------

@pytest.mark.parametrize("size, steps, limit", [(16384, 40, "at most 402897 latent tokens (about 10144x10144 px) "
                                                            "with 40 steps"),
                                                (16384, 8, "about 9616x9616 px) with 8 steps"),
                                                (32768, 1, "about 21168x21168 px) with 1 steps")])
def test_the_schedule_limits_the_docs_give_are_the_ones_enforced(tmp_path, capsys, size, steps, limit):
    """docs/robustness.md: the largest image the dynamic schedule can shift depends on the steps (about 10,144 px a
    side at 40 steps, 9,616 at 8, 21,168 at 1); a larger one is refused before any model runs for the sampler."""
    out = tmp_path / "big.png"
    assert main(["generate", "--width", str(size), "--height", str(size), "--steps", str(steps), "--out",
                 str(out)]) == 2
    assert limit in capsys.readouterr().err
    assert not out.exists()


def test_16384_at_one_step_is_refused_by_memory_alone_where_it_does_not_fit(tmp_path, capsys, monkeypatch):
    """docs/memory.md and docs/robustness.md: 16384x16384 at --steps 1 passes the schedule's limit, and the tiny model
    needs 18.1 GiB for it on the CPU: with 16 GiB available it is refused naming what fits, nothing written."""
    from graph_runtime import free_memory

    monkeypatch.setattr(free_memory, "host_available_bytes", lambda: 16 * 2**30)
    out = tmp_path / "big.png"
    assert main(["generate", "--width", "16384", "--height", "16384", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "needs 18.1 GiB" in err and "16.0 GiB is available" in err and "width x height at most" in err, err
    assert not out.exists()
