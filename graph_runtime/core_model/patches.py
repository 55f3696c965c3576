"""What other nodes' patches in a model call's `transformer_options` ask of a KV-Graph model, read once per call.

ComfyUI's own Qwen-Image-2.1 model reads four kinds of patch (its conventions: decode/block_patches.py): a block
replace `patches_replace["dit"][("single_block", i)]`, `attn1_patch`, `post_input` and `single_block` patches. Each
model call's patches end in one of three ways here:

- **a static choice**: a block replace that returns its input unchanged (core's SkipLayerGuidance puts exactly such
  a function in, for fixed blocks) leaves the block out. The step still replays a captured graph: one keyed on the
  skipped blocks, over a prefix computed with the same blocks left out (as the native model leaves them out of every
  row);
- **arbitrary Python**: any other patch of those four kinds runs in an eager step over the whole joint sequence, the
  reason counted and logged once;
- **refused** (`UnsupportedPatch`, naming the node that set it): a patch of any other kind (UNet attention replaces,
  cross-attention or UNet block patches, ...). A Qwen-Image-2.1 model has no place that would run it, so the node
  would do nothing: the prompt stops with a message instead. `double_block` replaces are left out without a refusal
  when `single_block` ones come with them (SkipLayerGuidance sets both; ComfyUI's own model has no double-stream
  block and reads only the single ones); alone they are refused. Likewise blocks past the model's last one are left
  out next to blocks it has, and refused alone. An attention override (ModelAttentionBackend) is
  refused too: the decode step runs its own attention.

Nothing here imports ComfyUI: the options are plain dicts and the patches plain callables.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from ..decode.block_patches import BlockPatches, origin
from ..decode.eligibility import PYTHON_PATCHES
from ..errors import KVGraphError

RUN_PATCHES = ("attn1_patch", "post_input", "single_block")  # `transformer_options["patches"]` kinds that run
ATTENTION_OVERRIDE = "optimized_attention_override"  # ComfyUI's `set_model_optimized_attention` puts it here
ARBITRARY = PYTHON_PATCHES  # the eager steps' reason in the statistics


class UnsupportedPatch(KVGraphError):
    """A patch a KV-Graph model cannot run; the message names the node that set it."""


@dataclass(frozen=True)
class CallPatches:
    """One model call's patches: `skip` blocks (a static choice) and the `python` ones (an eager step)."""

    skip: frozenset = frozenset()
    python: BlockPatches = field(default_factory=BlockPatches)
    ignored: tuple = ()  # what was left out, for a log line

    @property
    def eager(self) -> bool:
        return bool(self.python)


NONE = CallPatches()


# Code flags that change how a call runs (variable arguments, generators, coroutines); others (nested, future
# imports) do not.
_CALL_KIND_FLAGS = (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE
                    | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE)


def _skip_reference(args, extra_args):
    return args


def is_skip(fn) -> bool:
    """Whether `fn` is a block replace that returns its input unchanged: a plain two-argument function whose code is
    `return <first argument>` (what core's SkipLayerGuidance nodes put in), with nothing bound to it. Anything else,
    however simple it looks, is treated as arbitrary Python."""
    code = getattr(fn, "__code__", None)
    if not inspect.isfunction(fn) or code is None:
        return False
    ref = _skip_reference.__code__
    return (code.co_code == ref.co_code and code.co_argcount == 2 and code.co_kwonlyargcount == 0
            and not code.co_flags & _CALL_KIND_FLAGS and fn.__closure__ is None and not fn.__defaults__
            and not fn.__kwdefaults__)


def _refuse(fn, what: str) -> UnsupportedPatch:
    return UnsupportedPatch(
        f"KV-Graph: {origin(fn)} sets {what}, which a Qwen-Image-2.1 model has no place for: it would do nothing "
        "to the image. Remove that node from the workflow (ComfyUI's own Qwen-Image-2.1 model ignores or fails on it "
        "too; docs/core-sampling.md lists what runs on a KV-Graph MODEL).")


def _first_fn(value):
    """A representative function of a patch entry (a list of patches, or one)."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    if isinstance(value, dict):
        return next(iter(value.values()), None)
    return value


def check_supported(options: dict | None) -> None:
    """Refuse (naming the node) any patch in `options` (a `transformer_options` dict) that no Qwen-Image-2.1 model
    runs. Run at the start of a sampling run and at every model call."""
    options = options or {}
    override = options.get(ATTENTION_OVERRIDE)
    if override is not None:
        inner = next((c.cell_contents for c in (getattr(override, "__closure__", None) or ())
                      if callable(c.cell_contents)), override)
        raise UnsupportedPatch(
            f"KV-Graph: the MODEL carries an attention override ({origin(inner)}, set by ModelAttentionBackend or "
            "another node that sets the model's attention function). A KV-Graph MODEL runs its own attention in its "
            "captured decode step, so the override would do nothing: remove that node from the workflow.")
    for kind, value in (options.get("patches") or {}).items():
        if value and kind not in RUN_PATCHES:
            raise _refuse(_first_fn(value), f"a '{kind}' patch")
    replace = options.get("patches_replace") or {}
    for kind, value in replace.items():
        if value and kind != "dit":
            raise _refuse(_first_fn(value), f"a '{kind}' replace (UNet attention)")
    dit = replace.get("dit") or {}
    kinds = {key[0] if isinstance(key, tuple) else key for key in dit}
    for key, fn in dit.items():
        kind = key[0] if isinstance(key, tuple) else key
        if kind == "double_block" and "single_block" in kinds:
            continue
        if kind != "single_block" or not isinstance(key, tuple) or len(key) != 2:
            raise _refuse(fn, f"a '{kind}' block replace (Qwen-Image-2.1 has single-stream blocks only; set "
                              "single-stream layers instead)" if kind == "double_block" else f"a {key!r} replace")


def read_patches(options: dict | None, num_blocks: int) -> CallPatches:
    """What a model call's `transformer_options` ask of a model of `num_blocks` blocks (refusing what it cannot
    run)."""
    if not options or not (options.get("patches") or options.get("patches_replace")
                           or options.get(ATTENTION_OVERRIDE) is not None):
        return NONE
    check_supported(options)
    patches = options.get("patches") or {}
    dit = (options.get("patches_replace") or {}).get("dit") or {}
    skip, replace, ignored, outside = set(), {}, [], []
    for key, fn in dit.items():
        kind, index = key
        if kind == "double_block":
            ignored.append(f"double_block {index} replace ({origin(fn)})")
            continue
        if not isinstance(index, int) or not 0 <= index < num_blocks:
            # As ComfyUI's own model, which looks up only the blocks it has.
            outside.append((index, fn))
            ignored.append(f"single_block {index} replace ({origin(fn)}; the model has {num_blocks} blocks)")
            continue
        if is_skip(fn):
            skip.add(index)
        else:
            replace[index] = fn
    if outside and not (skip or replace):
        index, fn = outside[0]
        raise UnsupportedPatch(f"KV-Graph: {origin(fn)} replaces blocks {sorted(i for i, _ in outside)}, none of "
                               f"which the model has (blocks 0 to {num_blocks - 1}): it would do nothing. Set "
                               "layers in that range.")
    python = BlockPatches(replace=replace, attn1=tuple(patches.get("attn1_patch") or ()),
                          post_input=tuple(patches.get("post_input") or ()),
                          after_block=tuple(patches.get("single_block") or ()), options=options)
    return CallPatches(skip=frozenset(skip), python=python, ignored=tuple(ignored))
