"""The adversarial probe families of issue 43 (and the earlier ones of docs/robustness.md), as data for
tests/e2e/test_comfyui_probes.py.

A probe is a name, a family, and what it sends: a prompt (`prompt(base)` builds it; the files it needs are written by
`prepare(base)` before the server starts) or an HTTP request. Its expectation says what a user must see:
- REFUSED: the prompt fails (at validation or when it runs) with a clear message;
- RUNS: the prompt succeeds;
- EITHER: success, or a clear refusal (for inputs where both are reasonable, e.g. an odd save prefix).
`no_overwrite`: the prompt runs twice and no file of the first run may be replaced by the second.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from comfy_server import LORA_FILE, load_api_workflow, node_of, with_diffusers_loader

REFUSED, RUNS, EITHER = "refused", "runs", "either"
T2I, EDIT, LORA = "qwen_image_2.1_text_to_image", "qwen_image_2.1_edit_one_reference", "qwen_image_2.1_lora"
STEPS = 2
ENCODE, SAMPLER, DECODE, SAVE = "4", "5", "6", "7"
# Exception names and texts that mean a raw Python error reached the user instead of a message.
RAW_MARKERS = ("Traceback", "TypeError", "AttributeError", "SafetensorError", "KeyError", "IndexError",
               "UnicodeEncodeError", "UnicodeDecodeError", "JSONDecodeError", "HeaderTooLarge", "NoneType",
               "object has no attribute", "unexpected keyword argument", "DefaultCPUAllocator", "is not valid UTF-8",
               "not iterable", "RecursionError", "ZeroDivisionError", "OverflowError")
RAW_TYPES = ("TypeError", "AttributeError", "KeyError", "IndexError", "RuntimeError", "SafetensorError", "OSError",
             "ValueError", "UnicodeEncodeError", "UnicodeDecodeError", "JSONDecodeError", "RecursionError",
             "ZeroDivisionError", "OverflowError", "NotImplementedError", "AssertionError", "MemoryError")

LOADERS = {  # loader node of the text-to-image example, its file input and the model folder it reads
    "transformer": ("1", "transformer_name", "diffusion_models"),
    "text_encoder": ("2", "text_encoder_name", "text_encoders"),
    "vae": ("3", "vae_name", "vae"),
}
DAMAGED_HEADERS = ("float_shape", "string_offsets", "truncated", "huge_header_length", "header_not_json", "empty")
PIPELINE = "qwen-image-2.1-tiny"


@dataclass
class Probe:
    family: str
    name: str
    expect: str = REFUSED
    prompt: Callable[[Path], dict] | None = None  # the API prompt, given the base directory
    http: Callable | None = None  # (server) -> (status, text): a route probe's answer
    http_ok: Callable[[int, str], bool] | None = None  # whether a route probe's answer holds
    no_overwrite: bool = False
    words: tuple[str, ...] = field(default=())  # what a refusal's message must contain


def good(steps: int = STEPS, seed: int = 2024, name: str = T2I) -> dict:
    return load_api_workflow(name, seed=seed, steps=steps)


def link_string(prompt: dict, value, node: str = "90") -> list:
    """A STRING (or any primitive) that reaches an input through core's Switch, whose output takes any type, so
    ComfyUI's own validation never sees it."""
    kind = {str: "PrimitiveString", int: "PrimitiveInt", float: "PrimitiveFloat"}[type(value)]
    prompt[node] = {"class_type": kind, "inputs": {"value": value}}
    prompt[f"{node}1"] = {"class_type": "ComfySwitchNode", "inputs": {"switch": True, "on_true": [node, 0],
                                                                      "on_false": [node, 0]}}
    return [f"{node}1", 0]


def linked(value_of_socket: list) -> Callable[[dict], list]:
    return lambda prompt: value_of_socket


# -- files the probes load (written before the server starts) -------------------------------------------------------


def damaged_copy(source: Path, kind: str) -> bytes:
    """The bytes of `source` (a valid safetensors file) damaged one way, everything else as it was: the loader gets as
    far with it as with the real file."""
    data = source.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header, payload = json.loads(data[8:8 + length]), data[8 + length:]
    # The first tensor with a shape to spoil (a LoRA's first entries are 0-d alphas, whose shape [] stays [] in floats).
    first = next(k for k in header if k != "__metadata__" and (kind != "float_shape" or header[k]["shape"]))
    if kind == "float_shape":
        header[first]["shape"] = [float(v) for v in header[first]["shape"]]  # 64 -> 64.0
    elif kind == "string_offsets":
        header[first]["data_offsets"] = [str(v) for v in header[first]["data_offsets"]]
    elif kind == "truncated":
        return data[: 8 + length + len(payload) // 2]
    elif kind == "huge_header_length":
        return struct.pack("<Q", 1 << 60) + data[8:]
    elif kind == "header_not_json":
        return struct.pack("<Q", 16) + b"{not json at all" + payload
    elif kind == "empty":
        return b""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def damaged_name(component: str, kind: str) -> str:
    return f"kvgraph_probe_{component}_{kind}.safetensors"


NON_UTF8_NAME = b"kvgraph_probe_\xff\xfe.safetensors"
NON_UTF8_DAMAGED = b"kvgraph_probe_damaged_\xff.safetensors"
FAULT_FILES = ("kvgraph_probe_truncate_me.safetensors", "kvgraph_probe_delete_me.safetensors")
NAN_VAE = "kvgraph_probe_nan_vae.safetensors"


def prepare(base: Path) -> None:
    """Write the damaged files, configs and folders the probes name, inside the base's model folders."""
    import shutil

    models = base / "models"
    prompt = good()
    for component, (node, name, folder) in {**LOADERS, "lora": (None, None, "loras")}.items():
        real = models / folder / (LORA_FILE if component == "lora" else prompt[node]["inputs"][name])
        for kind in DAMAGED_HEADERS:
            (models / folder / damaged_name(component, kind)).write_bytes(damaged_copy(real, kind))
    # A valid file under a name that is not UTF-8 (what a download from another system can leave behind).
    source = models / "vae" / node_of(good(), "KVGraphLoadVAE")["inputs"]["vae_name"]
    (models / "vae").joinpath(NON_UTF8_NAME.decode("utf-8", "surrogateescape")).write_bytes(source.read_bytes())
    (models / "vae").joinpath(NON_UTF8_DAMAGED.decode("utf-8", "surrogateescape")).write_bytes(
        damaged_copy(source, "float_shape"))
    # Copies of the transformer for the faults family to truncate and delete while a prompt samples from them, and a
    # VAE whose weights are all NaN (docs/robustness.md: refused at the decode, naming the cause).
    transformer = models / "diffusion_models" / prompt["1"]["inputs"]["transformer_name"]
    for fault in FAULT_FILES:
        shutil.copy(transformer, models / "diffusion_models" / fault)
    from safetensors.torch import load_file, save_file
    import torch

    save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
               for k, v in load_file(source).items()}, str(models / "vae" / NAN_VAE))
    # Non-LoRA files in the LoRA folder: a text encoder and a VAE.
    shutil.copy(models / "text_encoders" / node_of(good(), "KVGraphLoadTextEncoder")["inputs"]["text_encoder_name"],
                models / "loras" / "kvgraph_probe_text_encoder_as_lora.safetensors")
    shutil.copy(source, models / "loras" / "kvgraph_probe_vae_as_lora.safetensors")
    # Damaged diffusers configs in copies of the tiny pipeline.
    pipeline = models / "diffusers" / PIPELINE
    for name, part, change in (
        ("kvgraph_probe_te_layers", "text_encoder", {"num_hidden_layers": 1_000_000}),
        ("kvgraph_probe_vae_zdim", "vae", {"z_dim": 1_000_000}),
        ("kvgraph_probe_transformer_layers", "transformer", {"num_layers": 100_000}),
        ("kvgraph_probe_config_not_json", "transformer", None),
    ):
        copy = models / "diffusers" / name
        if copy.exists():
            continue
        shutil.copytree(pipeline, copy)
        config = copy / part / "config.json"
        if change is None:
            config.write_text("{not json")
            continue
        data = json.loads(config.read_text())
        target = data.get("text_config", data) if part == "text_encoder" and "text_config" in data else data
        target.update(change)
        config.write_text(json.dumps(data))


# -- the probes ------------------------------------------------------------------------------------------------------


def _with_input(node: str, name: str, value, template: str = T2I) -> Callable[[Path], dict]:
    def build(base):
        prompt = good(name=template)
        prompt[node]["inputs"][name] = value(prompt) if callable(value) else value
        return prompt
    return build


def _diffusers(folder: str) -> Callable[[Path], dict]:
    return lambda base: with_diffusers_loader(good(), folder, placement="cpu")


def _lora(name_value) -> Callable[[Path], dict]:
    def build(base):
        prompt = good(name=LORA)
        prompt["8"]["inputs"]["lora_name"] = name_value(prompt) if callable(name_value) else name_value
        return prompt
    return build


def _references(sockets: dict) -> Callable[[Path], dict]:
    def build(base):
        prompt = good(name=EDIT)
        inputs = prompt[ENCODE]["inputs"]
        for key in [k for k in inputs if k.startswith("images.")]:
            del inputs[key]
        for socket, value in sockets.items():
            inputs[socket] = value(prompt) if callable(value) else value
        return prompt
    return build


def _save_prefix(value) -> Callable[[Path], dict]:
    def build(base):
        prompt = good()
        prompt[SAVE] = {"class_type": "KVGraphSaveImage",
                        "inputs": {"images": [DECODE, 0],
                                   "filename_prefix": value(prompt) if callable(value) else value}}
        return prompt
    return build


def paths() -> list[Probe]:
    probes = []
    surrogate = "x\ud800.safetensors"
    for component, (node, name, _) in LOADERS.items():
        probes.append(Probe("paths", f"{component}: lone surrogate name", prompt=_with_input(node, name, surrogate)))
        probes.append(Probe("paths", f"{component}: linked lone surrogate name",
                            prompt=_with_input(node, name, lambda p: link_string(p, surrogate))))
        for label, value in (("traversal", "../vae/x.safetensors"), ("absolute", "/etc/passwd"),
                             ("NUL byte", "x\x00.safetensors"), ("5000 characters", "v" * 4988 + ".safetensors"),
                             ("empty", "")):
            probes.append(Probe("paths", f"{component}: linked {label} name",
                                prompt=_with_input(node, name, lambda p, v=value: link_string(p, v))))
    non_utf8 = NON_UTF8_NAME.decode("utf-8", "surrogateescape")
    # A sound file under such a name loads (the pack opens it by descriptor); the server must not stop over it.
    probes.append(Probe("paths", "vae: a real file with a non-UTF-8 name", expect=RUNS,
                        prompt=_with_input("3", "vae_name", non_utf8)))
    probes.append(Probe("paths", "vae: a damaged file with a non-UTF-8 name",
                        prompt=_with_input("3", "vae_name", NON_UTF8_DAMAGED.decode("utf-8", "surrogateescape"))))
    probes.append(Probe("paths", "lora: lone surrogate name", prompt=_lora(surrogate)))
    probes.append(Probe("paths", "lora: linked lone surrogate name",
                        prompt=_lora(lambda p: link_string(p, surrogate))))
    probes.append(Probe("paths", "lora: linked traversal name", prompt=_lora(lambda p: link_string(p, "../vae/x"))))
    probes.append(Probe("paths", "diffusers: lone surrogate folder", prompt=_diffusers("x\ud800")))
    probes.append(Probe("paths", "diffusers: linked lone surrogate folder",
                        prompt=lambda base: _linked_folder(base, "x\ud800")))
    probes.append(Probe("paths", "diffusers: linked traversal folder",
                        prompt=lambda base: _linked_folder(base, "../../outside")))
    return probes


def _linked_folder(base, value):
    prompt = _diffusers(PIPELINE)(base)
    prompt["1"]["inputs"]["folder"] = link_string(prompt, value)
    return prompt


def damaged_files() -> list[Probe]:
    probes = []
    for component, (node, name, _) in LOADERS.items():
        for kind in DAMAGED_HEADERS:
            probes.append(Probe("damaged files", f"{component}: {kind}",
                                prompt=_with_input(node, name, damaged_name(component, kind))))
    for kind in DAMAGED_HEADERS:
        probes.append(Probe("damaged files", f"lora: {kind}", prompt=_lora(damaged_name("lora", kind))))
    probes.append(Probe("damaged files", "vae: every weight NaN", prompt=_with_input("3", "vae_name", NAN_VAE),
                        words=("NaN",)))
    probes.append(Probe("damaged files", "lora: a text encoder file", prompt=_lora(
        "kvgraph_probe_text_encoder_as_lora.safetensors"), words=("not a LoRA",)))
    probes.append(Probe("damaged files", "lora: a VAE file", prompt=_lora("kvgraph_probe_vae_as_lora.safetensors"),
                        words=("not a LoRA",)))
    for folder in ("kvgraph_probe_te_layers", "kvgraph_probe_vae_zdim", "kvgraph_probe_transformer_layers",
                   "kvgraph_probe_config_not_json"):
        probes.append(Probe("damaged files", f"diffusers: {folder}", prompt=_diffusers(folder)))
    return probes


def inputs() -> list[Probe]:
    probes = []
    for target, node, name in (("sampler model", SAMPLER, "model"), ("decode vae", DECODE, "vae"),
                               ("encode text_encoder", ENCODE, "text_encoder")):
        probes.append(Probe("inputs", f"a STRING into {target}",
                            prompt=_with_input(node, name, lambda p: link_string(p, "oops"))))
        probes.append(Probe("inputs", f"an INT into {target}",
                            prompt=_with_input(node, name, lambda p: link_string(p, 7))))
    probes.append(Probe("inputs", "the VAE into the sampler's model",
                        prompt=_with_input(SAMPLER, "model", lambda p: link_any(p, ["3", 0]))))
    probes.append(Probe("inputs", "the latent into the decode's vae",
                        prompt=_with_input(DECODE, "vae", lambda p: link_any(p, [SAMPLER, 0]))))
    image = ["10", 0]
    for socket in ("images.image0", "images.image11", "images.imagefoo", "images.", "image1"):
        probes.append(Probe("inputs", f"reference socket {socket!r}", prompt=_references({socket: image})))
    probes.append(Probe("inputs", "11 references",
                        prompt=_references({f"images.image{i}": image for i in range(1, 12)})))
    probes.append(Probe("inputs", "a STRING into images.image1",
                        prompt=_references({"images.image1": lambda p: link_string(p, "oops")})))
    probes.append(Probe("inputs", "a STRING into images (the group)",
                        prompt=_references({"images": lambda p: link_string(p, "oops")})))
    for label, side, value in (("width 100", "width", 100), ("height 8", "height", 8), ("width 0", "width", 0)):
        probes.append(Probe("inputs", f"size {label}", prompt=_with_input(ENCODE, side, value)))
    probes.append(Probe("inputs", "a linked width of 16384",
                        prompt=_with_input(ENCODE, "width", lambda p: link_string(p, 16384))))
    probes.append(Probe("inputs", "a lone surrogate in the prompt", prompt=_with_input(ENCODE, "prompt", "a \ud800")))
    probes.append(Probe("inputs", "70000-character negative prompt",
                        prompt=_with_input(ENCODE, "negative_prompt", "blurry " * 10_000)))
    probes.append(Probe("inputs", "control tokens in the prompt", RUNS,
                        prompt=_with_input(ENCODE, "prompt", "a <|image_pad|> and <|im_end|>")))
    for label, name, value in (("steps 0", "steps", 0), ("cfg NaN", "cfg", float("nan")), ("seed -1", "seed", -1),
                               ("denoise 0", "denoise", 0.0), ("sigma_preset bogus", "sigma_preset", "bogus"),
                               ("decode_mode bogus", "decode_mode", "bogus")):
        probes.append(Probe("inputs", f"sampler {label}", prompt=_with_input(SAMPLER, name, value)))
    for label, value in (("empty", ""), ("slash", "/"), ("subfolder only", "sub/"), ("%batch_num%", "x_%batch_num%"),
                         ("trailing slash", "KVGraph/"), ("dot", "."), ("traversal", "../escape"),
                         ("absolute", "/tmp/kvgraph_probe")):
        probes.append(Probe("inputs", f"save prefix {label}", EITHER, prompt=_save_prefix(value), no_overwrite=True))
    probes.append(Probe("inputs", "save prefix: a linked INT", EITHER,
                        prompt=_save_prefix(lambda p: link_string(p, 5)), no_overwrite=True))
    return probes


def link_any(prompt: dict, socket: list, node: str = "95") -> list:
    """Any node's output through core's Switch (so the sampler sees another type than its socket's)."""
    prompt[node] = {"class_type": "ComfySwitchNode", "inputs": {"switch": True, "on_true": socket,
                                                                "on_false": socket}}
    return [node, 0]


ALL_PROMPT_FAMILIES = (paths, damaged_files, inputs)
