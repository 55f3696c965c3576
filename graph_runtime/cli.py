"""Command line: `python -m graph_runtime generate | make-tiny` (the benchmark: `python -m bench` in a checkout)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from .errors import InputError, KVGraphError, OutputWriteError
from .output_files import check_target, save_image, write_atomically
from .validation import check_cfg, check_count, check_reference_resolution, check_seed, check_size

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def _model_dtype(args, device: str):
    """`--dtype`, else bf16 on CUDA and fp32 on the CPU."""
    return _dtype(args.dtype or ("bf16" if device.startswith("cuda") else "fp32"))


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# What `--out` may end with; JPEG has no alpha channel.
OUTPUT_FORMATS = {".png": "PNG", ".webp": "WEBP", ".jpg": "JPEG", ".jpeg": "JPEG"}
MODEL_FLAGS = (("--model", "model"), ("--transformer", "transformer"), ("--vae", "vae"),
               ("--text-encoder", "text_encoder"), ("--tokenizer", "tokenizer"))


@dataclass
class GenerateInputs:
    """`generate`'s arguments once checked: nothing here needs a model."""

    device: str
    images: list
    out_format: str


def check_device(value: str | None) -> str:
    """`--device`: cpu, or a CUDA device this machine has (default: cuda when there is one)."""
    import torch

    if value is None:
        return _default_device()
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    have = "cpu" + (f" or cuda:0..cuda:{cuda_count - 1}" if cuda_count else " (no CUDA device is available here)")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise InputError("--device", value, f"a device of this machine: {have}") from None
    if device.type == "cpu" or (device.type == "cuda" and (device.index or 0) < cuda_count):
        return value
    raise InputError("--device", value, f"a device of this machine: {have}")


def check_out(path: str, keep_alpha: bool, batch: int = 1, overwrite: bool = False) -> str:
    """`--out` and the files `--batch` derives from it, checked before anything is generated: a known image
    extension, a writable place, and no existing file unless `--overwrite`. Returns the PIL format."""
    ext = os.path.splitext(path)[1].lower()
    fmt = OUTPUT_FORMATS.get(ext)
    if fmt is None:
        raise InputError("--out", path, f"a file name ending in {', '.join(OUTPUT_FORMATS)}")
    if keep_alpha and fmt == "JPEG":
        raise InputError("--out", path, "a .png or .webp file with --keep-alpha (JPEG has no alpha channel)")
    # The last derived name is the longest; the others differ only in their number.
    check_target("--out", output_path(path, batch, batch - 1), overwrite=True, replace_hint="")
    existing = existing_outputs(path, batch)
    if existing and not overwrite:
        check_target("--out", existing[0], overwrite, "pass --overwrite to replace it")
    return fmt


def open_image(path: str, reference_resolution: int):
    """`--image`: a readable image whose shape a reference can take (its sides differ by at most 200x)."""
    from PIL import Image

    from .encoding.images import reference_size

    try:
        image = Image.open(path)
        image.load()
    except FileNotFoundError:
        raise InputError("--image", path, "an existing image file") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InputError("--image", path, f"a PNG, JPEG or WebP image file ({type(exc).__name__}: {exc})") from None
    reference_size(image, reference_resolution, name=f"--image {path}")
    return image


def check_generate_args(args) -> GenerateInputs:
    """Every `generate` argument, checked before a model is loaded, so a typo fails in a second, not after a load."""
    check_count("--repeat", args.repeat)
    check_count("--steps", args.steps)
    check_count("--batch", args.batch)
    check_seed(args.seed, "--seed")
    check_cfg(args.cfg, "--cfg")
    check_reference_resolution(args.reference_resolution, "--reference-resolution")
    from .fp8 import check_precision

    check_precision(args.precision)
    for flag, value in (("--width", args.width), ("--height", args.height)):
        if value is not None:
            check_size(flag, value)
    out_format = check_out(args.out, args.keep_alpha, args.batch, args.overwrite)
    for flag, attr in MODEL_FLAGS:
        path = getattr(args, attr)
        if path is not None and not os.path.exists(os.path.expanduser(path)):
            raise InputError(flag, path, "an existing file or folder")
    files = (args.transformer, args.vae, args.text_encoder)
    if any(files) and not all(files):
        missing = [flag for flag, value in zip(("--transformer", "--vae", "--text-encoder"), files) if not value]
        raise InputError(", ".join(missing), None, "all three single files (--transformer, --vae, --text-encoder) "
                                                   "when loading single files")
    if args.model and any(files):
        raise InputError("--model", args.model, "either --model or the three single files, not both")
    device = check_device(args.device)
    from .parallel import check_gpus

    check_gpus(args.gpus, device)
    if args.attention != "auto" and args.gpus > 1:
        # Sequence-parallel ranks build their own decode steps, which choose their attention as `auto` does.
        raise InputError("--attention", args.attention, "auto with --gpus above 1")
    images = [open_image(path, args.reference_resolution) for path in args.image]
    return GenerateInputs(device=device, images=images, out_format=out_format)


def load_models(args, device: str, precision=None):
    """Models from --model DIR, from the three single files, or the tiny built-in default. An INT8 transformer file
    is dequantized when `precision` (a ResolvedPrecision) converts to FP8, which quantizes from float weights."""
    import torch

    from .kernels.preload import start_preload
    from .loading import QwenImageModels, load_pipeline_folder, load_text_encoder, load_transformer, load_vae
    from .tiny import build_tiny_components

    if device.startswith("cuda"):
        start_preload(torch.device(device))  # Triton's and the CUDA libraries' set-up, while the models load

    dtype = _model_dtype(args, device)
    # The text encoder starts on the host unless it stays on the GPU: a card too small for it (16.3 GB in bf16)
    # then still loads, and its placement brings it to the GPU for each encode.
    te_device = device if getattr(args, "text_encoder_placement", "gpu") == "gpu" else "cpu"
    if args.model:
        print(f"model: diffusers folder {args.model} ({args.dtype or dtype}, {device})")
        return load_pipeline_folder(args.model, dtype=dtype, device=device, text_encoder_device=te_device)
    if args.transformer:
        from .loading.gguf_transformer import int8_while_read

        print(f"model: single files ({dtype}, {device})")
        # a GGUF file converted to int8 turns int8 block by block as it is read (the peak stays near the int8
        # model's size), as the loader node does
        early = precision is not None and int8_while_read(args.transformer, precision)
        text_encoder, processor = load_text_encoder(args.text_encoder, dtype=dtype, device=te_device,
                                                    tokenizer_dir=args.tokenizer)
        return QwenImageModels(
            transformer=load_transformer(args.transformer, dtype=dtype, device=device,
                                         quantized="dequantize" if precision and precision.converts else "int8",
                                         gguf_int8_on=device if early else None),
            vae=load_vae(args.vae, dtype=dtype, device=device),
            text_encoder=text_encoder, processor=processor, scheduler_config=None,
            sources={"transformer": args.transformer, "vae": args.vae, "text_encoder": args.text_encoder},
        )
    print("model: none given, using the tiny built-in random Qwen-Image-2.1 (2 blocks; images are noise-like)")
    parts = build_tiny_components()
    return QwenImageModels(
        transformer=parts["transformer"].to(device, dtype), vae=parts["vae"].to(device, dtype),
        text_encoder=parts["text_encoder"].to(te_device, dtype), processor=parts["processor"],
        scheduler_config=dict(parts["scheduler"].config), sources={"model": "tiny built-in"},
    )


def output_path(out: str, count: int, index: int) -> str:
    """The file the `index`-th of `count` images goes to: `out` itself for one image, else NAME_<index>.EXT."""
    if count == 1:
        return out
    stem, ext = os.path.splitext(out)
    return f"{stem}_{index}{ext}"


def existing_outputs(out: str, count: int) -> list[str]:
    """Those of the `count` output paths that exist, found with one listing of their folder (a huge --batch, refused
    later by the memory budget, must not make this check slow)."""
    if count == 1:
        return [out] if os.path.lexists(out) else []
    folder = os.path.dirname(out) or "."
    try:
        names = set(os.listdir(folder))
    except OSError:  # no such folder yet: nothing in it to replace
        return []
    found = sorted((index, name) for name in names
                   if (index := _derived_index(os.path.basename(out), name, count)) is not None)
    return [os.path.join(os.path.dirname(out), name) for _, name in found]


def _derived_index(out_name: str, name: str, count: int) -> int | None:
    """The index `name` has as a derived output of `out_name` (NAME_<i>.EXT, i < count), or None."""
    stem, ext = os.path.splitext(out_name)
    number = name[len(stem) + 1:len(name) - len(ext)] if name.startswith(stem + "_") and name.endswith(ext) else ""
    if number.isdigit() and str(int(number)) == number and int(number) < count:
        return int(number)
    return None


def resolve_cli_precision(args, device: str):
    """`--precision` for the transformer the arguments name, `auto` resolved as the loader nodes resolve it (before the
    load, from the file's header: an INT8 file is dequantized only for an FP8 precision picked by hand)."""
    from .fp8 import resolve_precision
    from .loading.transformer import transformer_is_quantized

    source = args.transformer or args.model
    int8_file = source is not None and transformer_is_quantized(source)
    return resolve_precision(args.precision, device, dtype=_model_dtype(args, device), int8_file=int8_file)


def apply_cli_precision(transformer, resolved, converted_while_read: bool = False) -> None:
    """Convert the loaded transformer to the resolved precision (nothing for bf16, nor for a GGUF file the load made
    int8 as it read it); prints what was done."""
    from .fp8 import apply_precision

    if converted_while_read:
        print(f"precision: {resolved.precision} ({resolved.reason}): the GGUF file's block Linears made INT8 block "
              "by block while it was read")
        return
    if not resolved.converts:
        print(f"precision: {resolved.describe(transformer)}")
        return
    done = apply_precision(transformer, resolved.precision, device=next(transformer.parameters()).device)
    kind = "INT8" if resolved.precision == "int8" else "FP8"
    print(f"precision: {resolved.precision} ({resolved.reason}): {done['linears']} block Linears in {kind}, "
          f"{done['block_linear_bytes_after'] / 2**30:.2f} GiB instead of "
          f"{done['block_linear_bytes_before'] / 2**30:.2f} GiB ({done['seconds']} s)")


def step_printer(run: int):
    """Each sampling step as it ends, with the time since the run started: a large image on the CPU takes minutes
    per step, and a silent terminal looks hung."""
    start = time.perf_counter()

    def on_step(step: int, total: int, *_):
        then = "; decoding with the VAE" if step == total else ""
        print(f"run {run}: step {step}/{total} done ({time.perf_counter() - start:.1f} s){then}", flush=True)

    return on_step


def cmd_generate(args) -> int:
    from .generate import QwenImageGenerator

    checked = check_generate_args(args)
    start = time.perf_counter()
    precision = resolve_cli_precision(args, checked.device)
    models = load_models(args, checked.device, precision)
    from .loading.gguf_transformer import int8_while_read

    apply_cli_precision(models.transformer, precision, int8_while_read(args.transformer, precision))
    load_s = time.perf_counter() - start
    from .parallel.plan import check_heads

    check_heads(args.gpus, models.transformer.config.num_attention_heads, "--gpus")
    from .loaded import LoadedTransformer

    from .encoding.placed import CLI_PLACEMENTS

    generator = QwenImageGenerator(models, gpus=args.gpus,
                                   loaded=LoadedTransformer(models.transformer, attention=args.attention),
                                   text_encoder_placement=CLI_PLACEMENTS[args.text_encoder_placement])
    for run in range(args.repeat):
        result = generator.generate(
            args.prompt, negative_prompt=args.negative, cfg=args.cfg, images=checked.images, width=args.width,
            height=args.height, steps=args.steps, seed=args.seed, sigma_preset=args.sigmas, decode_mode=args.decode,
            compile=args.compile == "blocks", batch_size=args.batch, reference_resolution=args.reference_resolution,
            keep_alpha=args.keep_alpha, on_step=step_printer(run + 1), prefix_placement=args.prefix_placement,
        )
        timings = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.timings.items()}
        print(f"run {run + 1}: load {load_s:.2f} s (first run only) | " + " | ".join(
            f"{k} {v}" for k, v in timings.items()))
        print(f"run {run + 1}: graph statistics for this run: {json.dumps(result.stats)}")
    for index, image in enumerate(result.images):
        path = output_path(args.out, len(result.images), index)
        write_atomically(path, lambda file: save_image(file, image, checked.out_format))
        print(f"wrote {path} ({image.size[0]}x{image.size[1]} {image.mode})")
    if args.gpus == 1:
        print("graph manager: " + json.dumps(generator.engine.status()))
    else:
        print("ranks: " + json.dumps(generator.loaded.parallel_runtime(args.gpus).status()))
        generator.loaded.shutdown_parallel()
    return 0


def cmd_make_tiny(args) -> int:
    from .controlnet.tiny import comfyui_controlnet_path, write_tiny_controlnet
    from .lora.tiny import comfyui_lora_path, write_tiny_lora
    from .tiny import (build_tiny_components, check_writable, comfyui_file_paths, comfyui_int8_file_paths,
                       write_comfyui_files, write_comfyui_int8_files, write_diffusers_folder)
    from .tiny_gguf import (comfyui_gguf_paths, comfyui_text_encoder_gguf_path, write_comfyui_gguf_files,
                            write_gguf_language_tower)
    from .tiny_kitchen import comfyui_kitchen_paths, write_comfyui_kitchen_files

    if not args.dir and not args.comfyui_models:
        raise SystemExit("make-tiny needs DIR and/or --comfyui-models DIR")
    # Both targets are checked before either is written, so a refusal leaves nothing half done.
    if args.comfyui_models:
        check_writable([*comfyui_file_paths(args.comfyui_models).values(),
                        *comfyui_int8_file_paths(args.comfyui_models).values(),
                        *comfyui_gguf_paths(args.comfyui_models).values(),
                        *comfyui_kitchen_paths(args.comfyui_models).values(),
                        comfyui_text_encoder_gguf_path(args.comfyui_models),
                        comfyui_lora_path(args.comfyui_models), comfyui_controlnet_path(args.comfyui_models)],
                       args.force)
    if args.dir:
        check_writable([args.dir], args.force, folder=True)
    if args.comfyui_models:
        for name, path in write_comfyui_files(args.comfyui_models, force=args.force).items():
            print(f"wrote {name}: {path}")
        for name, path in write_comfyui_int8_files(args.comfyui_models, force=args.force).items():
            print(f"wrote {name} (INT8 ConvRot): {path}")
        # the same weights as the bf16 file (seed 0), as ComfyUI-GGUF files
        parts = build_tiny_components(0)
        for qtype, path in write_comfyui_gguf_files(args.comfyui_models, parts["transformer"],
                                                    force=args.force).items():
            print(f"wrote transformer (GGUF {qtype}): {path}")
        # and as ComfyUI mixed-precision files: FP8 scaled, W4A16/AWQ, NVFP4, MXFP8 (dequantized at load)
        for fmt, path in write_comfyui_kitchen_files(args.comfyui_models, parts["transformer"]).items():
            print(f"wrote transformer ({fmt}): {path}")
        te_gguf = write_gguf_language_tower(parts["text_encoder"].state_dict(),
                                            comfyui_text_encoder_gguf_path(args.comfyui_models), "Q8_0")
        print(f"wrote text encoder language tower (GGUF Q8_0): {te_gguf}")
        # The LoRA example workflow's file, so that example runs as shipped on the tiny model too.
        print(f"wrote lora: {write_tiny_lora(comfyui_lora_path(args.comfyui_models))}")
        # The ControlNet examples' file (the Fun ControlNet Union's layout), in models/model_patches.
        print(f"wrote controlnet: {write_tiny_controlnet(comfyui_controlnet_path(args.comfyui_models))}")
    if args.dir:
        try:
            folder = write_diffusers_folder(args.dir, force=args.force)
        except OSError as exc:  # a full disk, say: the folder is left part-written, which the message says
            raise OutputWriteError(args.dir, f"{exc.strerror or exc} (the folder may be incomplete: write it "
                                             "again with --force)") from None
        print(f"wrote diffusers folder: {folder}")
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            print(f"  {path.relative_to(folder)}")
    return 0


# The benchmark is the repository's lab, not part of the installed package: the command says where it went.
BENCH_MOVED = ("the benchmark is not part of the installed package: it runs from a checkout of the repository, as "
               "`python -m bench [options]` from the repository root (docs/benchmark.md)")


def cmd_bench_moved(args) -> int:
    print(f"error: {BENCH_MOVED}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    from .decode.attention import ATTENTION_CHOICES

    parser = argparse.ArgumentParser(prog="python -m graph_runtime", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log the runtime's info messages")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate an image (text-to-image or edit)")
    gen.add_argument("--prompt", default="A capybara wearing a wizard hat, oil painting",
                     help="what to generate, or the edit to make (default: %(default)r)")
    gen.add_argument("--negative", default=None, help="negative prompt, used when --cfg > 1 (default: none)")
    gen.add_argument("--cfg", type=float, default=1.0,
                     help="true CFG scale; above 1 with --negative it doubles the work (default: 1, no CFG)")
    gen.add_argument("--image", action="append", default=[],
                     help="reference image for an edit, repeatable (default: none, text-to-image)")
    gen.add_argument("--model", help="diffusers folder (transformer/, vae/, text_encoder/, processor/, scheduler/) "
                                     "(default: the tiny built-in random model, unless the single files are given)")
    gen.add_argument("--transformer", help="single file, e.g. qwen_image_2.1_bf16.safetensors (default: none)")
    gen.add_argument("--vae", help="single file, e.g. qwen_image_2.1_vae_bf16.safetensors (default: none)")
    gen.add_argument("--text-encoder", help="single file, e.g. qwen3vl_8b_bf16.safetensors (default: none)")
    gen.add_argument("--tokenizer", help="tokenizer folder for a single-file text encoder (default: one found next "
                                         "to the file)")
    gen.add_argument("--width", type=int, default=None,
                     help="output width in px, a multiple of 16 (default: 1024, or the last reference's)")
    gen.add_argument("--height", type=int, default=None,
                     help="output height in px, a multiple of 16 (default: 1024, or the last reference's)")
    gen.add_argument("--steps", type=int, default=40,
                     help="denoising steps of the dynamic schedule (default: 40; --sigmas turbo always runs 8)")
    gen.add_argument("--seed", type=int, default=0, help="noise seed, 0 to 2^64-1 (default: 0)")
    gen.add_argument("--batch", type=int, default=1,
                     help="images per run; more than one writes NAME_0.EXT, NAME_1.EXT, ... (default: 1)")
    gen.add_argument("--sigmas", choices=["dynamic", "turbo"], default="dynamic",
                     help="dynamic: the model's resolution-shifted schedule over --steps; turbo: the Turbo model's "
                          "fixed 8-step grid (default: dynamic)")
    gen.add_argument("--decode", choices=["auto", "graph", "eager"], default="auto",
                     help="auto: replay CUDA graphs where possible, else eager; graph: the same, warning when a step "
                          "cannot replay; eager: never capture (default: auto)")
    gen.add_argument("--prefix-placement", choices=["auto", "gpu", "int8", "host", "recompute"], default="auto",
                     help="where the prefix K/V live: auto (the memory budget picks the first that fits), gpu, int8, "
                          "host (pinned memory) or recompute (no cache) (default: auto)")
    gen.add_argument("--text-encoder-placement", choices=["auto", "offload", "gpu", "streamed", "cpu"],
                     default="auto",
                     help="where the text encoder encodes, as the loader nodes' text_encoder_placement: auto (the "
                          "memory plan's choice for the free memory), offload (gpu while encoding, then offload), "
                          "gpu (always gpu), streamed (streamed by layer: two of its layers on the GPU at a time) or "
                          "cpu; on --device cpu all run on the CPU (default: auto)")
    gen.add_argument("--compile", choices=["blocks", "off"], default="off",
                     help="blocks: also torch.compile the transformer blocks on CUDA (the same step time, and a "
                          "compile on the first prompt: docs/performance.md) (default: off)")
    gen.add_argument("--attention", choices=list(ATTENTION_CHOICES), default="auto",
                     help="the decode step's attention: auto (FlashAttention-3 on Hopper where the fa3 extra is "
                          "installed, in FP8 under int8 Linears, else bf16; SDPA elsewhere), sdpa, fa3 (bf16), or "
                          "fp8 (FlashAttention-3's FP8 forward over e4m3 K/V in the graph entries; where it cannot "
                          "run it falls back to auto's choice, logged and counted: docs/performance.md) "
                          "(default: auto)")
    gen.add_argument("--reference-resolution", type=int, default=1024,
                     help="references are resized to about N x N px (default: 1024)")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                     help="the models' dtype (default: bf16 on CUDA, fp32 on the CPU)")
    gen.add_argument("--precision", default="auto",
                     help="the transformer blocks' Linears: auto (default: int8 for an INT8 ConvRot file, and for "
                          "bf16 weights of a float file on a GPU of compute capability 8.0+ (Ampere, Ada, Hopper, "
                          "Blackwell); fp8-attn for bf16 weights on an FP8 GPU without the INT8 path; "
                          "else as loaded, as on the CPU, where neither INT8 nor FP8 GEMMs run), bf16 (as loaded), "
                          "int8 (INT8 ConvRot W8A8), fp8, fp8-attn (MLP kept bf16) or fp8-no-out (docs/fp8.md)")
    gen.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    gen.add_argument("--gpus", type=int, default=1,
                     help="decode each image on N devices: N-1 worker processes beside this one split the image's "
                          "tokens (and, with --cfg, the two branches); on CUDA it needs N GPUs, on --device cpu it "
                          "runs N CPU processes (docs/multi-gpu.md) (default: 1)")
    gen.add_argument("--repeat", type=int, default=1,
                     help="generate N times in one process, to show graph reuse (default: 1)")
    gen.add_argument("--out", required=True,
                     help=f"output image path ({', '.join(OUTPUT_FORMATS)}); RGB over white unless --keep-alpha "
                          "(required)")
    gen.add_argument("--overwrite", action="store_true",
                     help="replace an existing --out (and the NAME_i files of --batch) (default: refuse)")
    gen.add_argument("--keep-alpha", action="store_true",
                     help="keep the VAE's alpha channel (RGBA; .png or .webp), instead of compositing over white as "
                          "the ComfyUI nodes show the image (default: off)")
    gen.set_defaults(func=cmd_generate)

    tiny = sub.add_parser("make-tiny", help="write a tiny random Qwen-Image-2.1 for tests")
    tiny.add_argument("dir", nargs="?", help="diffusers folder to write")
    tiny.add_argument("--comfyui-models", help="a ComfyUI models/ folder to write the single files into (bf16 and "
                                               "INT8 ConvRot, under the real files' names; the transformer also as "
                                               "ComfyUI-GGUF Q8_0 and Q4_0 files, the text encoder's language tower "
                                               "as a Q8_0 GGUF), and a tiny LoRA under the name the LoRA example "
                                               "loads (loras/) and a tiny Fun ControlNet Union under the name the "
                                               "ControlNet examples load (model_patches/)")
    tiny.add_argument("--force", action="store_true", help="overwrite existing files (refused otherwise)")
    tiny.set_defaults(func=cmd_make_tiny)

    # Any options after `bench` are accepted (see main), so every old spelling gets the pointer, not a usage error.
    moved = sub.add_parser("bench", add_help=False, help="moved: `python -m bench` in a checkout of the repository")
    moved.set_defaults(func=cmd_bench_moved)
    return parser


class Terminated(BaseException):
    """SIGTERM (`kill`, a container stopping), raised in the main thread like Ctrl-C's KeyboardInterrupt, so a file
    being written is removed on the way out (output_files) rather than left half written."""


def _raise_terminated(signum, frame):
    raise Terminated


def main(argv=None) -> int:
    # Python's default for SIGTERM ends the process at once, without unwinding: no cleanup would run.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        return _main(argv)
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.verbose:
        # diffusers warns on every `.to(dtype)` of a model with no fp32-pinned modules; it is noise here.
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    try:
        return args.func(args)
    except KVGraphError as exc:  # the CLI reports input errors without a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, e.g. during a long load: no traceback, the shell's usual status
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
