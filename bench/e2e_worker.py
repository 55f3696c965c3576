"""One process of the end-to-end benchmark: build the models, run the prompts a task names, write the records.

`python -m bench.e2e_worker TASK.json OUT.json`. The benchmark starts one per first-prompt figure, so
"first prompt" is the first in a fresh process whose kernels, plans and graphs nothing has set up yet, and one for
the warm runs of both paths in one process. Tasks:

- `first`: one path, one scenario: the first prompt of the process, then the same prompt again (the second prompt
  a restarted ComfyUI would run). With `warm_up` ("kernels" or "capture"), our engine's `warm_up` runs for the
  scenario's size right after the models are built (timed apart), as a loader could call it. Every task starts
  the preload (`kernels/preload.py`) before building the models, as ComfyUI's start-up does, but those that show
  what it saves: `preload: false` (none) and `preload: "triton"` (Triton alone, not the CUDA libraries).
- `profile`: as `first` for our path, the first prompt run under `first_prompt.profiled_ours`.
- `warm`: every scenario x path: one unmeasured prompt each, then `repeats` rounds alternating the paths.
"""

from __future__ import annotations

import json
import os
import sys
import time

_STARTED = time.time()

import torch  # noqa: E402

from graph_runtime.kernels.preload import preload_result, start_preload  # noqa: E402

from .e2e_models import E2EModels, build_models, diffusers_pipeline, parameter_count  # noqa: E402
from .e2e_paths import run_diffusers, run_ours  # noqa: E402
from .e2e_scenarios import SCENARIOS, prompt_of_tokens, reference_image  # noqa: E402

SPAWNED_AT_ENV = "KVGRAPH_E2E_SPAWNED_AT"


def triton_cache_kernels(cache_dir: str | None) -> int | None:
    """Compiled kernels in a Triton cache folder (one `.cubin` per kernel variant), None without a folder."""
    if not cache_dir or not os.path.isdir(cache_dir):
        return None if not cache_dir else 0
    return sum(name.endswith(".cubin") for _, _, files in os.walk(cache_dir) for name in files)


def _round(value):
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


class Worker:
    def __init__(self, task: dict):
        self.task = task
        self.device = task["device"]
        self.tiny = task.get("tiny", False)
        self.dtype = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.scenarios = [SCENARIOS[name].for_tiny() if self.tiny else SCENARIOS[name] for name in task["scenarios"]]
        self.runs: list[dict] = []
        self.images: list | None = None  # set to a list to keep every output image (tests)
        self.imported = time.time()  # the imports above are done: what a restart pays before loading models

    def build(self):
        from graph_runtime.generate import QwenImageGenerator
        from graph_runtime.memory.plan import TE_GPU

        start = time.perf_counter()
        paths = self.task["paths"]
        preload = self.task.get("preload", True)
        if preload and self.device != "cpu":
            # What the pack starts at ComfyUI's start-up, and the command line before it loads the models.
            start_preload(torch.device(self.device), libraries=preload != "triton")
        self.models = build_models(self.device, self.dtype, tiny=self.tiny)
        self.generators = {}
        # Every path shares one text encoder, kept on the device as diffusers' pipeline needs it: `auto` would move it
        # to the host after each of ours' encodes (what the text encoder placements cost is bench.placement's).
        make = lambda models: QwenImageGenerator(models, text_encoder_placement=TE_GPU)  # noqa: E731
        if "ours-fp8" in paths:
            self.generators["ours-fp8"] = make(self._fp8_models(alone=paths == ["ours-fp8"]))
        if paths != ["ours-fp8"]:
            self.generators["ours"] = make(self.models)
        self.generator = next(iter(self.generators.values()))
        self.pipe = diffusers_pipeline(self.models) if "diffusers" in paths else None
        self.prompt, self.prompt_tokens = prompt_of_tokens(self.generator.encoder)
        self.build_total_s = time.perf_counter() - start
        if self.task.get("warm_up"):
            size = self.scenarios[0].size // 16
            self.warm_up = self.generator.engine.warm_up([(size, size)], prompt_tokens=self.prompt_tokens,
                                                         capture=self.task["warm_up"] == "capture")
            print(json.dumps({"warm_up": self.warm_up}), flush=True)

    def _fp8_models(self, alone: bool):
        """The models with an FP8 transformer (precision `task["fp8_precision"]`, its bf16 weights freed): the loaded
        one converted when no bf16 path runs in this process, else a second one with the same weights."""
        from graph_runtime.fp8 import apply_precision
        from .model import build_transformer

        transformer = self.models.transformer if alone else build_transformer(device=self.device, dtype=self.dtype,
                                                                              tiny=self.tiny)
        self.models.build_s["fp8"] = apply_precision(transformer, self.task.get("fp8_precision", "fp8"))
        return E2EModels(transformer=transformer, vae=self.models.vae, text_encoder=self.models.text_encoder,
                         processor=self.models.processor, scheduler_config=self.models.scheduler_config)

    def run(self, path: str, scenario, label: str, seed: int) -> dict:
        image = reference_image(scenario.size) if scenario.references else None
        if path in self.generators:
            generator = self.generators[path]
            record = run_ours(generator, scenario, self.prompt, image, seed, self.device, self.images)
            record["dit_peak_gb"] = self._dit_peak(generator, record)
        else:
            record = run_diffusers(self.pipe, scenario, self.prompt, image, seed, self.device, self.images)
        row = {"path": path, "scenario": scenario.name, "run": label, **record}
        self.runs.append(row)
        summary = {k: row[k] for k in ("path", "scenario", "run", "total_ms", "encode_ms", "prefill_ms", "steps_ms",
                                       "vae_decode_ms", "png_encode_ms", "peak_gb") if k in row}
        print(json.dumps(_round(summary)), flush=True)
        return row

    def _dit_peak(self, generator, record) -> float | None:
        """The sampling phase's peak less what else the process holds (the text encoder, the VAE, another
        transformer): the peak of a card with only this transformer, its graphs and the sampling on it."""
        sampling = record.get("peak_gb_by_phase", {}).get("sampling")
        if sampling is None:
            return None
        own = generator.models.transformer
        others = {id(m): m for m in (self.models.text_encoder, self.models.vae,
                                     *(g.models.transformer for g in self.generators.values())) if m is not own}
        return sampling - sum(_nbytes(m) for m in others.values()) / 2**30

    def first(self, profile: bool = False):
        (path,), (scenario,) = self.task["paths"], self.scenarios
        # Empty when the preload was not started or had not finished when the first prompt began.
        self.triton_preload = preload_result()
        if profile:
            from .first_prompt import profiled_ours

            with profiled_ours(self.generator, self.device) as prof:
                self.run(path, scenario, "first (profiled)", seed=0)
            self.profile = prof.report()
        else:
            self.run(path, scenario, "first", seed=0)
        self.run(path, scenario, "second", seed=1)

    def fill(self):
        """Every scenario once on every path, unmeasured: what leaves the on-disk kernel caches as a machine has them
        after running these jobs once, for the restarts that follow."""
        for scenario in self.scenarios:
            for path in self.task["paths"]:
                self.run(path, scenario, "cache fill", seed=0)

    def warm(self):
        paths = self.task["paths"]
        for scenario in self.scenarios:
            for path in paths:
                self.run(path, scenario, "warm-up", seed=0)
            for i in range(self.task.get("repeats", 2)):
                for path in paths:
                    self.run(path, scenario, f"warm {i + 1}", seed=i + 1)

    def result(self) -> dict:
        spawned = float(os.environ.get(SPAWNED_AT_ENV, _STARTED))
        out = {
            "task": self.task,
            "import_s": self.imported - spawned,
            "build_s": self.models.build_s,
            "build_total_s": self.build_total_s,
            "params_billion": {"transformer": parameter_count(self.generator.models.transformer),
                               "text_encoder": parameter_count(self.models.text_encoder),
                               "vae": parameter_count(self.models.vae)},
            "prompt_words": len(self.prompt.split()),
            "prompt_tokens": self.prompt_tokens,
            "runs": self.runs,
            "engine": {path: g.engine.status() for path, g in self.generators.items()},
        }
        for name in ("warm_up", "profile", "triton_preload"):
            if hasattr(self, name):
                out[name] = getattr(self, name)
        return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    task_path, out_path = argv
    with open(task_path) as f:
        task = json.load(f)
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    kernels_before = triton_cache_kernels(cache_dir)
    worker = Worker(task)
    worker.build()
    kind = task["kind"]
    if kind == "warm":
        worker.warm()
    elif kind == "fill":
        worker.fill()
    else:
        worker.first(profile=kind == "profile")
    result = worker.result()
    result["triton_cache"] = {"dir": cache_dir, "kernels_before": kernels_before,
                              "kernels_after": triton_cache_kernels(cache_dir)}
    result["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if worker.device != "cpu"
                     else "cpu", "triton": _triton_version()}
    with open(out_path, "w") as f:
        json.dump(_round(result), f, indent=1, default=str)
    return 0


def _nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
