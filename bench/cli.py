"""`python -m bench [options]`, run from the repository root: the decode-step benchmark (`runner`), or with `--e2e`
prompt to PNG against diffusers' pipeline (`e2e_runner`). Options: `options.py`; how to read the results:
docs/benchmark.md and docs/prompt-to-image-benchmark.md."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from graph_runtime.errors import InputError, KVGraphError

from .options import add_bench_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log the runtime's info messages")
    add_bench_arguments(parser)
    return parser


def check_device(args) -> None:
    import torch

    if not args.tiny and not (torch.cuda.is_available() and args.device.startswith("cuda")):
        # Off the GPU the full-size run would build the 7B model in host memory and be killed for it.
        none = "" if torch.cuda.is_available() else ", and this machine has none"
        raise InputError("--device", args.device, f"a CUDA device: the full-size benchmark builds the 7B model on "
                                                  f"it{none}; for a CPU smoke run use `python -m bench --tiny "
                                                  "--device cpu`")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.verbose:
        # diffusers warns on every `.to(dtype)` of a model with no fp32-pinned modules; it is noise here.
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    try:
        check_device(args)
        from .runner import main as run

        return run(args, argv)
    except KVGraphError as exc:  # input errors are reported without a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
