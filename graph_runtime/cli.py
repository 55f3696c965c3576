"""Command line: `python -m graph_runtime generate | make-tiny | bench`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_models(args):
    """Models from --model DIR, from the three single files, or the tiny built-in default."""
    import torch

    from .loading import QwenImageModels, load_pipeline_folder, load_text_encoder, load_transformer, load_vae
    from .tiny import build_tiny_components

    device = args.device or _default_device()
    dtype = _dtype(args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    files = (args.transformer, args.vae, args.text_encoder)
    if args.model:
        print(f"model: diffusers folder {args.model} ({args.dtype or dtype}, {device})")
        return load_pipeline_folder(args.model, dtype=dtype, device=device)
    if any(files):
        missing = [flag for flag, value in zip(("--transformer", "--vae", "--text-encoder"), files) if not value]
        if missing:
            raise SystemExit(f"single-file loading needs all three files; missing {', '.join(missing)}")
        print(f"model: single files ({dtype}, {device})")
        text_encoder, processor = load_text_encoder(args.text_encoder, dtype=dtype, device=device,
                                                    tokenizer_dir=args.tokenizer)
        return QwenImageModels(
            transformer=load_transformer(args.transformer, dtype=dtype, device=device),
            vae=load_vae(args.vae, dtype=dtype, device=device),
            text_encoder=text_encoder, processor=processor, scheduler_config=None,
            sources={"transformer": args.transformer, "vae": args.vae, "text_encoder": args.text_encoder},
        )
    print("model: none given, using the tiny built-in random Qwen-Image-2.1 (2 blocks; images are noise-like)")
    parts = build_tiny_components()
    return QwenImageModels(
        transformer=parts["transformer"].to(device, dtype), vae=parts["vae"].to(device, dtype),
        text_encoder=parts["text_encoder"].to(device, dtype), processor=parts["processor"],
        scheduler_config=dict(parts["scheduler"].config), sources={"model": "tiny built-in"},
    )


def cmd_generate(args) -> int:
    from PIL import Image

    from .generate import QwenImageGenerator

    start = time.perf_counter()
    models = load_models(args)
    if args.precision != "bf16":
        from .fp8 import apply_precision

        done = apply_precision(models.transformer, args.precision)
        print(f"precision: {args.precision}: {done['linears']} block Linears in FP8, "
              f"{done['block_linear_bytes_after'] / 2**30:.2f} GiB instead of "
              f"{done['block_linear_bytes_before'] / 2**30:.2f} GiB ({done['seconds']} s)")
    load_s = time.perf_counter() - start
    generator = QwenImageGenerator(models)
    images = [Image.open(path) for path in args.image]
    for run in range(args.repeat):
        result = generator.generate(
            args.prompt, negative_prompt=args.negative, cfg=args.cfg, images=images, width=args.width,
            height=args.height, steps=args.steps, seed=args.seed, sigma_preset=args.sigmas, decode_mode=args.decode,
            compile=args.compile == "blocks", batch_size=args.batch, reference_resolution=args.reference_resolution,
        )
        timings = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.timings.items()}
        print(f"run {run + 1}: load {load_s:.2f} s (first run only) | " + " | ".join(
            f"{k} {v}" for k, v in timings.items()))
        print(f"run {run + 1}: graph statistics for this run: {json.dumps(result.stats)}")
    out = args.out
    for i, image in enumerate(result.images):
        path = out if len(result.images) == 1 else f"{os.path.splitext(out)[0]}_{i}{os.path.splitext(out)[1]}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        image.save(path)
        print(f"wrote {path} ({image.size[0]}x{image.size[1]})")
    print("graph manager: " + json.dumps(generator.engine.status()))
    return 0


def cmd_make_tiny(args) -> int:
    from .tiny import write_comfyui_files, write_diffusers_folder

    if args.comfyui_models:
        for name, path in write_comfyui_files(args.comfyui_models).items():
            print(f"wrote {name}: {path}")
    if args.dir:
        print(f"wrote diffusers folder: {write_diffusers_folder(args.dir)}")
    if not args.dir and not args.comfyui_models:
        raise SystemExit("make-tiny needs DIR and/or --comfyui-models DIR")
    return 0


def cmd_bench(args) -> int:
    from .bench.runner import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m graph_runtime", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log the runtime's info messages")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate an image (text-to-image or edit)")
    gen.add_argument("--prompt", default="A capybara wearing a wizard hat, oil painting")
    gen.add_argument("--negative", default=None, help="negative prompt (used when --cfg > 1)")
    gen.add_argument("--cfg", type=float, default=1.0, help="true CFG scale; > 1 with --negative doubles the work")
    gen.add_argument("--image", action="append", default=[], help="reference image for edits (repeatable)")
    gen.add_argument("--model", help="diffusers folder (transformer/, vae/, text_encoder/, processor/, scheduler/)")
    gen.add_argument("--transformer", help="single file, e.g. qwen_image_2.1_bf16.safetensors")
    gen.add_argument("--vae", help="single file, e.g. qwen_image_2.1_vae_bf16.safetensors")
    gen.add_argument("--text-encoder", help="single file, e.g. qwen3vl_8b_bf16.safetensors")
    gen.add_argument("--tokenizer", help="tokenizer folder for a single-file text encoder")
    gen.add_argument("--width", type=int, default=None, help="multiple of 16 (default 1024, or from the reference)")
    gen.add_argument("--height", type=int, default=None)
    gen.add_argument("--steps", type=int, default=40)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--batch", type=int, default=1)
    gen.add_argument("--sigmas", choices=["dynamic", "turbo"], default="dynamic")
    gen.add_argument("--decode", choices=["auto", "graph", "eager"], default="auto")
    gen.add_argument("--compile", choices=["blocks", "off"], default="off",
                     help="blocks: also torch.compile the transformer blocks on CUDA (same step time in our "
                          "benchmark, ~6 s more on the first prompt); default off")
    gen.add_argument("--reference-resolution", type=int, default=1024, help="references are resized to ~N*N px")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    gen.add_argument("--precision", default="bf16",
                     help="the transformer blocks' Linears: bf16 (as loaded), fp8, fp8-attn (MLP kept bf16) or "
                          "fp8-no-out; FP8 GEMMs need an Ada, Hopper or Blackwell GPU (docs/fp8.md)")
    gen.add_argument("--device", default=None, help="default cuda when available")
    gen.add_argument("--repeat", type=int, default=1, help="generate N times in one process (shows graph reuse)")
    gen.add_argument("--out", required=True, help="output PNG path")
    gen.set_defaults(func=cmd_generate)

    tiny = sub.add_parser("make-tiny", help="write a tiny random Qwen-Image-2.1 for tests")
    tiny.add_argument("dir", nargs="?", help="diffusers folder to write")
    tiny.add_argument("--comfyui-models", help="a ComfyUI models/ folder to write the single files into")
    tiny.set_defaults(func=cmd_make_tiny)

    bench = sub.add_parser("bench", help="decode-step benchmark on the GPU (full-size random weights)")
    from .bench.options import add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.verbose:
        # diffusers warns on every `.to(dtype)` of a model with no fp32-pinned modules; it is noise here.
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    try:
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - the CLI reports input errors without a traceback
        from .errors import KVGraphError

        if isinstance(exc, KVGraphError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
