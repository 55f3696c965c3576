"""Runs every model-patching node of a real ComfyUI's comfy_extras (a node that takes a MODEL and returns one) on the
pack's MODEL and on core's own Qwen-Image model, and prints what each did as JSON.

Run with ComfyUI's Python, from the repository root (tests/test_core_patch_nodes_comfyui.py does, asserts on the
output, and checks the table in docs/core-sampling.md against it):

    COMFYUI_DIR=/path/to/ComfyUI $COMFYUI_PYTHON tests/core_patch_nodes_driver.py

For each node: its inputs are its defaults (the first choice of a list), with a few set so the node acts on the tiny
two-block models (`OVERRIDES`); a node that needs another input than a MODEL and plain values is listed as not run.
The patched MODEL then samples as KSampler does (euler, 3 steps, cfg 4 with a negative prompt, a fixed seed) and the
result is compared with the same sampling unpatched: "changed" / "unchanged", or "refused" with the message when the
node or the sampling raised. Core's model is a tiny Qwen-Image (ComfyUI's own `qwen_image` architecture, two blocks,
random weights) fed the same prompt embeddings. On the pack's MODEL the capture backend records instead of capturing
CUDA graphs, so the statistics say whether the steps replayed graphs or ran eagerly (and why) on CPU too.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
STEPS, CFG, SEED = 3, 4.0, 5
SIZE = (64, 64)  # pixels
SKIPPED = {
    "TorchCompileModel": "compiles the model with inductor: not run on the CPU here",
    "TrainLoraNode": "trains a LoRA",
}
# Inputs set so the node acts on two-block models (its defaults name blocks 7 to 9) or at all.
OVERRIDES = {
    "SkipLayerGuidanceDiT": {"double_layers": "1", "single_layers": "1", "start_percent": 0.0, "end_percent": 1.0},
    "SkipLayerGuidanceDiTSimple": {"double_layers": "1", "single_layers": "1"},
    "SkipLayerGuidanceSD3": {"layers": "1", "start_percent": 0.0, "end_percent": 1.0},
    "FreSca": {"freq_cutoff": 1},  # its default low band (20 around the centre) covers a whole 4x4 latent
}
# Max |difference| of the final latents (magnitude ~3) above which a node "changed" the output. Below it is round-off:
# another attention kernel, or an eager step over the joint sequence instead of a replayed decode step, move the
# latents by up to ~2e-4 on these models.
CHANGED = 1e-3


def setup():
    comfyui = os.environ["COMFYUI_DIR"]
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path[:0] = [comfyui, str(REPO / "tests"), str(REPO)]
    import comfy.options

    comfy.options.enable_args_parsing()
    # ComfyUI's own node API and nodes, imported before the test fake takes over the pack's imports.
    from comfy_api.latest import io  # noqa: F401

    nodes = patch_nodes(Path(comfyui))
    from comfy_fake.env import make_env

    return make_env(device="cpu", real_comfy=comfyui), nodes


def patch_nodes(comfyui: Path) -> dict:
    """node id -> class, for every comfy_extras node with a MODEL input and a MODEL output."""
    from comfy_api.latest import io

    found = {}
    for path in sorted((comfyui / "comfy_extras").glob("nodes_*.py")):
        try:
            module = importlib.import_module(f"comfy_extras.{path.stem}")
        except Exception as exc:  # noqa: BLE001 - a module this environment cannot import is reported
            found[f"({path.stem})"] = f"import failed: {type(exc).__name__}: {exc}"
            continue
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            if issubclass(cls, io.ComfyNode) and cls is not io.ComfyNode:
                try:
                    schema = cls.define_schema()
                except Exception:  # noqa: BLE001 - an abstract base
                    continue
                ins = [i.io_type for i in schema.inputs]
                outs = [o.io_type for o in schema.outputs]
                node_id = schema.node_id
            elif hasattr(cls, "INPUT_TYPES") and hasattr(cls, "RETURN_TYPES"):
                types = cls.INPUT_TYPES()
                ins = [spec[0] for spec in types.get("required", {}).values()]
                outs = list(cls.RETURN_TYPES)
                node_id = next((k for k, v in getattr(module, "NODE_CLASS_MAPPINGS", {}).items() if v is cls),
                               cls.__name__)
            else:
                continue
            if "MODEL" in ins and "MODEL" in outs:
                found[node_id] = cls
    return found


def node_inputs(node_id, cls, model) -> dict | str:
    """The node's inputs: defaults, MODELs, overrides; or why it cannot be run with those alone."""
    from comfy_api.latest import io

    values, missing = {}, []
    if isinstance(cls, type) and issubclass(cls, io.ComfyNode):
        for inp in cls.define_schema().inputs:
            value = _default(inp.io_type, getattr(inp, "default", None), getattr(inp, "options", None), model)
            if value is _MISSING:
                if not getattr(inp, "optional", False):
                    missing.append(inp.io_type)
                continue
            values[inp.id] = value
    else:
        types = cls.INPUT_TYPES()
        for name, spec in types.get("required", {}).items():
            kind = spec[0]
            options = spec[1] if len(spec) > 1 else {}
            choices = kind if isinstance(kind, list) else options.get("options")  # old and new list styles
            value = _default(kind if isinstance(kind, str) else "COMBO", options.get("default"), choices, model)
            if value is _MISSING:
                missing.append(kind if isinstance(kind, str) else "COMBO")
                continue
            values[name] = value
    if missing:
        return "needs " + ", ".join(sorted(set(missing))) + " inputs"  # COMBO: a list with nothing to pick (files)
    values.update({k: v for k, v in OVERRIDES.get(node_id, {}).items() if k in values})
    return values


_MISSING = object()


def _default(kind, default, options, model):
    if kind == "MODEL":
        return model
    if kind in ("INT", "FLOAT", "BOOLEAN", "STRING") and default is not None:
        return default
    if kind == "STRING":
        return ""
    if kind == "COMBO" or options:
        choices = list(options or [])
        return default if default is not None else (choices[0] if choices else _MISSING)
    if kind in ("INT", "FLOAT"):
        return 0
    if kind == "BOOLEAN":
        return False
    return _MISSING


def run_node(cls, values):
    from comfy_api.latest import io

    if isinstance(cls, type) and issubclass(cls, io.ComfyNode):
        out = cls.execute(**values)
        out = asyncio.run(out) if inspect.iscoroutine(out) else out
        return out.args[0]
    return getattr(cls(), cls.FUNCTION)(**values)[0]


def ksampler(model, positive, negative, latent):
    import comfy.sample

    latent = comfy.sample.fix_empty_latent_channels(model, latent)  # what KSampler does first
    noise = comfy.sample.prepare_noise(latent, SEED)
    return comfy.sample.sample(model, noise, STEPS, CFG, "euler", "simple", positive, negative, latent,
                               seed=SEED).float().cpu()


def message(exc) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def core_qwen_image():
    """ComfyUI's own Qwen-Image architecture, two blocks with the tiny model's widths, random weights."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.QwenImage({"image_model": "qwen_image", "in_channels": 64, "out_channels": 16,
                                               "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                                               "joint_attention_dim": 64, "axes_dims_rope": (4, 6, 6)})
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.diffusion_model.named_parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
            else:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(), offload_device="cpu")


def recording(engine):
    """The engine's capture backend swapped for the recording one: graphs "capture" and "replay" on CPU."""
    from test_graph_manager import RecordingBackend

    backend = RecordingBackend()
    engine.graphs.backend = backend
    engine.guard._backend = backend
    engine.guard.new_request()


def main() -> dict:
    env, nodes = setup()
    handle, model = env.nodes["KVGraphLoadTransformer"].execute(
        transformer_name="qwen_image_2.1_bf16.safetensors", dtype="fp32").args
    text_encoder, = env.nodes["KVGraphLoadTextEncoder"].execute(
        text_encoder_name="qwen3vl_8b_bf16.safetensors", dtype="fp32",
        text_encoder_placement="gpu while encoding, then offload").args
    positive, negative, latent = env.nodes["KVGraphTextEncode"].execute(
        text_encoder=text_encoder, prompt="a red cube on a blue sphere", negative_prompt="blurry", width=SIZE[0],
        height=SIZE[1], size_from_reference=True, reference_resolution=128).args
    engine = handle.engine
    recording(engine)
    core = core_qwen_image()
    plain = lambda c: [[c[0][0], {}]]  # noqa: E731 - core's model reads the embeddings alone
    targets = {
        "kvgraph": (model, positive, negative, latent["samples"]),
        "core": (core, plain(positive), plain(negative), torch.zeros(1, 16, SIZE[1] // 8, SIZE[0] // 8)),
    }
    base = {name: ksampler(*args) for name, args in targets.items()}
    rows = {}
    for node_id, cls in sorted(nodes.items()):
        if isinstance(cls, str):
            rows[node_id] = {"skipped": cls}
            continue
        if node_id in SKIPPED:
            rows[node_id] = {"skipped": SKIPPED[node_id]}
            continue
        row = {}
        for name, (target, pos, neg, lat) in targets.items():
            values = node_inputs(node_id, cls, target)
            if isinstance(values, str):
                row = {"skipped": values}
                break
            before = engine.stats.snapshot()
            try:
                patched = run_node(cls, values)
                out = ksampler(patched, pos, neg, lat)
            except Exception as exc:  # noqa: BLE001 - a refusal (or a failure) is what is measured
                row[name] = {"outcome": "refused", "message": message(exc)}
            else:
                change = float((out - base[name]).abs().max())
                row[name] = {"outcome": "changed" if change > CHANGED else "unchanged", "max_diff": change}
            if name == "kvgraph":
                row[name]["steps"] = engine.stats.delta(before)
        rows[node_id] = row
    return {"comfyui": os.environ["COMFYUI_DIR"], "version": comfyui_version(), "rows": rows}


def comfyui_version() -> str:
    import comfyui_version

    return comfyui_version.__version__


if __name__ == "__main__":
    result = main()
    print("KVGRAPH-RESULT " + json.dumps(result))
