"""Run in a child process by tests/test_damaged_configs.py: load each damaged checkpoint named on the command line and
print, one JSON line each, the error it raised, the seconds it took and how much the process's resident memory peaked
above where it was (VmHWM, reset before each load, which sees torch's allocations too).

`python tests/damaged_loads.py KIND PATH [KIND PATH ...]`: KIND is transformer, vae or text_encoder, PATH a file or
folder for that loader.
"""

import json
import sys
import time


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def measure(load) -> dict:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to what is resident now
    before, start = _status("VmRSS:"), time.perf_counter()
    try:
        load()
        error = None
    except Exception as exc:  # reported to the test, which says what it expected
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.perf_counter() - start, "grew": _status("VmHWM:") - before}


def main(args: list[str]) -> None:
    import torch
    # What every load imports, imported before the measure starts: the measure is the load's own cost.
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel  # noqa: F401
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration  # noqa: F401

    from graph_runtime.loading.text_encoder import load_text_encoder
    from graph_runtime.loading.transformer import load_transformer
    from graph_runtime.loading.vae import load_vae

    loaders = {"transformer": load_transformer, "vae": load_vae, "text_encoder": load_text_encoder}
    for kind, path in zip(args[::2], args[1::2]):
        print(json.dumps(measure(lambda: loaders[kind](path, dtype=torch.float32))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
