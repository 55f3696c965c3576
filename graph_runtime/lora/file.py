"""A LoRA file read into the changes it makes to the loaded transformer's weights, checked before anything merges.

Only `.safetensors` files are read (a pickled checkpoint can run code). Every key must name a weight of the model
with matching shapes: a LoRA applied in part is not the LoRA its author trained, so a file where some keys match
nothing is refused, naming the file and the first keys that did not match, and a file made for another model says
which model it looks like.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ..comfy_interop.files import file_identity
from ..errors import CheckpointError, shorten
from ..loading.checks import FLOAT_DTYPES
from ..loading.detect import inspect_shapes
from ..safetensors_file import iter_tensors, read_header
from .formats import (ALPHA, DIFF, DIFF_BIAS, DOWN, UP, Target, foreign_model, peft_scale, split_key,
                      unsupported_kind, weight_aliases)

EXPECTED = ("a Qwen-Image-2.1 LoRA in .safetensors format: lora_A/lora_B or lora_down/lora_up pairs (with an "
            "optional alpha) or diff tensors on the transformer's layers (docs/lora.md lists the layouts read)")
LISTED_KEYS = 8
PEFT_METADATA = "lora_adapter_metadata"


@dataclass(eq=False)
class WeightPatch:
    """One change to one weight: a low-rank pair adds `scale * up @ down`, a difference adds `diff`; either is
    multiplied by the strength the user chose."""

    up: torch.Tensor | None = None  # [rows, rank]
    down: torch.Tensor | None = None  # [rank, in]
    diff: torch.Tensor | None = None  # the weight's shape (its rows, for a fused gate_up difference)
    scale: float = 1.0

    def delta(self, device, strength: float) -> torch.Tensor:
        """This patch's change at `strength`, in fp32 on `device` (a new tensor the caller may modify)."""
        if self.diff is not None:
            return self.diff.to(device, torch.float32) * strength
        up, down = self.up.to(device, torch.float32), self.down.to(device, torch.float32)
        return torch.mm(up, down).mul_(strength * self.scale)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.up, self.down, self.diff) if t is not None)


@dataclass(eq=False)
class LoraFile:
    """A LoRA as the merge needs it: per parameter name of the transformer, the patches to add."""

    path: str
    identity: tuple  # real path, size and mtime: the same file read twice is the same LoRA
    patches: dict[str, list[WeightPatch]]
    notes: list[str] = field(default_factory=list)  # what was read and deliberately left out

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for patches in self.patches.values() for p in patches)


def read_lora(path: str | os.PathLike, transformer: torch.nn.Module) -> LoraFile:
    """Read and check `path` against `transformer`'s weights; raises CheckpointError naming the file otherwise."""
    path = os.fspath(path)
    header = read_header(path, EXPECTED)
    shapes = {name: tuple(p.shape) for name, p in transformer.named_parameters()}
    aliases = weight_aliases(shapes)
    groups = _group_keys(path, header, aliases, shapes)
    names = [key for kinds in groups.values() for key in kinds.values()]
    # Copies, not views of the file's memory map: the user may replace the file while the LoRA stays in use.
    _refuse_integer_factors(path, header, groups)
    tensors = {name: t.clone() for name, t in iter_tensors([path], names=names)}
    for name, tensor in tensors.items():
        # Merged, a NaN would turn the model's output NaN, and the sampler could only blame the weights.
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(path, f"has NaN or infinite values in {shorten(repr(name))}: a damaged file.",
                                  EXPECTED)
    config = _peft_config(path, header.metadata)
    lora = LoraFile(path=path, identity=file_identity(path), patches={})
    for stem, kinds in groups.items():
        _add_patches(lora, stem, kinds, tensors, aliases[stem], shapes, config)
    return lora


def _refuse_integer_factors(path: str, header, groups: dict[str, dict[str, str]]) -> None:
    """LoRA factors and differences are floating-point (as the model loaders require of weights); integers or
    booleans there are a damaged or wrongly converted file, whose merge would be meaningless. An alpha is one number
    and may be stored as an integer."""
    factors = sorted(key for kinds in groups.values() for kind, key in kinds.items() if kind != ALPHA
                     and header.tensors[key].dtype not in FLOAT_DTYPES)
    if factors:
        shown = ", ".join(f"{shorten(repr(k))} ({header.tensors[k].dtype})" for k in factors[:3])
        raise CheckpointError(path, f"stores {len(factors)} LoRA factor(s) as integers or booleans where a LoRA needs "
                                    f"floating-point values: {shown}. A damaged or wrongly converted file.", EXPECTED)


def _not_a_lora(path: str, header) -> CheckpointError:
    """The refusal of a file none of whose keys is a LoRA's (a model checkpoint given to the LoRA loader), saying what
    the file looks like from its tensor names and shapes."""
    info = inspect_shapes({name: t.shape for name, t in header.tensors.items()})
    keys = sorted(header.tensors)
    first = ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    looks = (f"it looks like {info.description}, a model checkpoint" if info.kind != "unknown"
             else "it is no model checkpoint KV-Graph recognises either")
    return CheckpointError(path, f"is not a LoRA: none of its {len(keys)} tensors is a LoRA factor (lora_A/lora_B, "
                                 f"lora_down/lora_up, alpha or diff); {looks} (keys: {first}).", EXPECTED)


def _group_keys(path: str, header, aliases: dict, shapes: dict) -> dict[str, dict[str, str]]:
    """{module stem: {kind: key}} for a file whose every key names a weight of the model; else the refusal."""
    keys = list(header.tensors)
    if not keys:
        raise CheckpointError(path, "holds no tensors.", EXPECTED)
    if not any(split_key(k) or unsupported_kind(k) for k in keys):
        raise _not_a_lora(path, header)
    groups: dict[str, dict[str, str]] = {}
    unsupported: dict[str, str] = {}
    unmatched = []
    for key in keys:
        what = unsupported_kind(key)
        if what is not None:
            unsupported.setdefault(what, key)
            continue
        parsed = split_key(key)
        if parsed is None or parsed[0] not in aliases:
            unmatched.append(key)
            continue
        stem, kind = parsed
        groups.setdefault(stem, {})[kind] = key
    if unsupported:
        kinds = "; ".join(f"{what} (e.g. {key!r})" for what, key in unsupported.items())
        raise CheckpointError(path, f"holds adapter weights KV-Graph does not merge: {kinds}.", EXPECTED)
    if unmatched:
        foreign = foreign_model(unmatched)
        if foreign is not None:
            family, key = foreign
            raise CheckpointError(path, f"is a LoRA for {family}, not for Qwen-Image-2.1: its key {key!r} names a "
                                        "layer Qwen-Image-2.1 does not have.", EXPECTED)
        blocks = len({name.split(".")[1] for name in shapes if name.startswith("transformer_blocks.")})
        listed = ", ".join(repr(k) for k in unmatched[:LISTED_KEYS])
        if len(unmatched) > LISTED_KEYS:
            listed += f" and {len(unmatched) - LISTED_KEYS} more"
        which = ("none of its keys match a" if len(unmatched) == len(keys)
                 else f"{len(unmatched)} of its {len(keys)} keys match{'es' if len(unmatched) == 1 else ''} no")
        raise CheckpointError(path, f"{which} layer of the Qwen-Image-2.1 transformer ({blocks} blocks); a LoRA "
                                    f"applied in part is not merged. Unmatched: {listed}.", EXPECTED)
    return groups


def _peft_config(path: str, metadata: dict) -> dict:
    """PEFT's adapter config from diffusers' metadata (alpha and its per-module patterns), or {}."""
    raw = metadata.get(PEFT_METADATA)
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deep enough to exhaust the parser
        raise CheckpointError(path, f"has {PEFT_METADATA} metadata that is not valid JSON.", EXPECTED) from None
    if not isinstance(config, dict):
        return {}
    # A pipeline's save prefixes each entry with its component; the transformer's are ours.
    if any(k.startswith("transformer.") for k in config):
        config = {k.removeprefix("transformer."): v for k, v in config.items() if k.startswith("transformer.")}
    _check_peft_alphas(path, config)
    return config


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_peft_alphas(path: str, config: dict) -> None:
    """The adapter config's alphas are numbers, per-module patterns an object of numbers (as PEFT writes them)."""
    def refuse(what: str, value, needed: str):
        raise CheckpointError(path, f"has {what}={shorten(repr(value))} in its {PEFT_METADATA} metadata, which must "
                                    f"be {needed}.", EXPECTED)

    if "lora_alpha" in config and config["lora_alpha"] is not None and not _finite_number(config["lora_alpha"]):
        refuse("lora_alpha", config["lora_alpha"], "a finite number")
    patterns = config.get("alpha_pattern")
    if patterns is not None and not isinstance(patterns, dict):
        refuse("alpha_pattern", patterns, "an object of module patterns and their alphas")
    for pattern, value in (patterns or {}).items():
        if not _finite_number(value):
            refuse(f"alpha_pattern[{pattern!r}]", value, "a finite number")
        try:
            re.compile(pattern)
        except re.error:
            refuse("alpha_pattern", pattern, "regular expressions (as PEFT matches them against module names)")
    if not isinstance(config.get("use_rslora", False), bool):
        refuse("use_rslora", config["use_rslora"], "true or false")


def _add_patches(lora: LoraFile, stem: str, kinds: dict[str, str], tensors: dict, targets: tuple[Target, ...],
                 shapes: dict, config: dict) -> None:
    path = lora.path
    rows = sum(shapes[t.param][0] for t in targets)
    full_shape = (rows, *shapes[targets[0].param][1:])
    if DOWN in kinds or UP in kinds:
        if DOWN not in kinds or UP not in kinds:
            have, missing = (DOWN, UP) if DOWN in kinds else (UP, DOWN)
            raise CheckpointError(path, f"has {kinds[have]!r} without its {missing} matrix.", EXPECTED)
        down, up = tensors[kinds[DOWN]], tensors[kinds[UP]]
        if (down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0] or len(full_shape) != 2
                or (up.shape[0], down.shape[1]) != full_shape):
            raise CheckpointError(path, f"{kinds[UP]!r} {list(up.shape)} @ {kinds[DOWN]!r} {list(down.shape)} does "
                                        f"not make a {list(full_shape)} weight: a LoRA for a model of another size?",
                                  EXPECTED)
        if down.shape[0] == 0:
            raise CheckpointError(path, f"{kinds[DOWN]!r} is a rank-0 factor: a pair of rank 0 changes nothing (and "
                                        "an alpha / rank scale divides by 0), so the file is damaged or empty.",
                                  EXPECTED)
        scale = _scale(path, kinds.get(ALPHA), tensors.get(kinds.get(ALPHA)), config, targets[0], down.shape[0])
        for target in targets:
            part = up if target.rows is None else up[target.rows].contiguous()
            lora.patches.setdefault(target.param, []).append(WeightPatch(up=part, down=down, scale=scale))
    if DIFF in kinds:
        diff = tensors[kinds[DIFF]]
        if tuple(diff.shape) != full_shape:
            raise CheckpointError(path, f"{kinds[DIFF]!r} has shape {list(diff.shape)}, but the weight it changes "
                                        f"has {list(full_shape)}: a LoRA for a model of another size?", EXPECTED)
        for target in targets:
            part = diff if target.rows is None else diff[target.rows].contiguous()
            lora.patches.setdefault(target.param, []).append(WeightPatch(diff=part))
    if DIFF_BIAS in kinds:
        if tensors[kinds[DIFF_BIAS]].any():
            raise CheckpointError(path, f"{kinds[DIFF_BIAS]!r} changes a bias, but Qwen-Image-2.1's layers have no "
                                        "biases: a LoRA made for another model?", EXPECTED)
        lora.notes.append(f"{kinds[DIFF_BIAS]}: an all-zero bias difference (the model has no biases), ignored")
    if kinds.keys() == {ALPHA}:
        raise CheckpointError(path, f"has {kinds[ALPHA]!r} but no LoRA weights for that layer.", EXPECTED)


def _scale(path: str, alpha_key: str | None, alpha: torch.Tensor | None, config: dict, target: Target,
           rank: int) -> float:
    """alpha / rank from the key's own alpha (one number), else from PEFT's config, else 1 (diffusers' convention:
    no alpha means the pair is stored already scaled)."""
    if alpha is not None:
        if alpha.numel() != 1:
            raise CheckpointError(path, f"{alpha_key!r} has shape {list(alpha.shape)}, where an alpha is one number.",
                                  EXPECTED)
        return float(alpha.float().item()) / rank
    scale = peft_scale(config, target.param.removesuffix(".weight"), rank)
    return 1.0 if scale is None else scale
