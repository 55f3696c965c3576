"""Checks on generation inputs, in one place: the generator, the sampler, the CLI and the ComfyUI nodes (in their
`validate_inputs` too) call these, so every caller refuses the same values with the same message.

Each check returns the value it accepted (converted where that is lossless) or raises `InputError` naming the input.
"""

from __future__ import annotations

import math
import operator

import torch

from .errors import InputError

VAE_SCALE = 16

# The transformer's rotary table (diffusers' `QwenImage21Rope`) holds positions 0..8191 and -1024..-1. Text tokens
# and image blocks share the positive range: text advances one position per token, each image block advances
# max(h, w) latent tokens. Inside an image, rows and columns are centred on zero, so one side may span at most
# 2 x 1024 latent tokens. Beyond either range the lookup silently wraps to wrong positions, or fails.
ROPE_POSITIONS = 8192
ROPE_NEGATIVE_POSITIONS = 1024
MAX_SIDE_TOKENS = 2 * ROPE_NEGATIVE_POSITIONS
MAX_IMAGE_SIDE = MAX_SIDE_TOKENS * VAE_SCALE  # 32768 px

# The longest prompt accepted, in text-encoder tokens after the system turn is dropped (the template's user and
# assistant markers count too). The Qwen-Image-2.1 pipeline sets no limit; the real one is the rotary table above,
# which the prompt shares with every image block. Half of it goes to the prompt: 4096 tokens is about 3,000 English
# words (the Qwen-Image 1.x pipeline stopped at 1024 tokens), and it leaves 4096 positions for images, where a
# 2048 px target takes 128. The sampler checks the exact total (`check_positions`).
MAX_PROMPT_TOKENS = 4096

# Reference images one prompt may take: Qwen-Image-2.1's own limit.
MAX_REFERENCES = 10

# Qwen3-VL's image processor refuses images whose sides differ by more than 200x; a reference also needs at least one
# vision slot (32 px) per side.
MAX_REFERENCE_ASPECT = 200
REFERENCE_MULTIPLE = 32
# 4096**2 pixels is the most Qwen3-VL's image processor takes (its `longest_edge` pixel budget).
MAX_REFERENCE_RESOLUTION = 4096

MAX_SEED = 2**64 - 1


def _integer(name: str, value, expected: str) -> int:
    """`value` as an int when it is one (numpy and torch integers included; bools and floats are refused)."""
    if isinstance(value, bool):
        raise InputError(name, value, expected)
    try:
        return operator.index(value)
    except TypeError:
        raise InputError(name, value, expected) from None


def check_size(name: str, value, maximum: int = MAX_IMAGE_SIDE) -> int:
    """An output width or height in pixels: a multiple of 16 (the VAE's grid) within the rotary table's reach, or
    within `maximum` where the input has a lower bound of its own (a node's widget range), so the message states
    the limit that applies where the value came from."""
    maximum = min(maximum, MAX_IMAGE_SIDE)
    expected = f"a multiple of {VAE_SCALE} pixels from {VAE_SCALE} to {maximum} (the VAE compresses 16x)"
    value = _integer(name, value, expected)
    if value < VAE_SCALE or value % VAE_SCALE or value > maximum:
        raise InputError(name, value, expected)
    return value


def check_count(name: str, value, minimum: int = 1) -> int:
    """An integer count (steps, batch size, repeats) of at least `minimum`."""
    value = _integer(name, value, f"an integer >= {minimum}")
    if value < minimum:
        raise InputError(name, value, f"an integer >= {minimum}")
    return value


def check_seed(value, name: str = "seed") -> int:
    """A noise seed: torch's CPU generator takes any value in [0, 2**64); a negative one would be silently mapped to
    another seed, so it is refused rather than reinterpreted. The generator (a Mersenne Twister) keeps the seed's low
    32 bits, so seeds that differ by a multiple of 2**32 give the same noise, in diffusers and core ComfyUI alike;
    the runtime keeps that, so every seed gives the pipeline's image (docs/robustness.md)."""
    expected = f"an integer in [0, {MAX_SEED}]"
    value = _integer(name, value, expected)
    if not 0 <= value <= MAX_SEED:
        raise InputError(name, value, expected)
    return value


def _real(name: str, value, expected: str) -> float:
    if isinstance(value, bool):
        raise InputError(name, value, expected)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(name, value, expected) from None
    if not math.isfinite(number):
        raise InputError(name, value, expected)
    return number


def check_cfg(value, name: str = "cfg") -> float:
    """True-CFG scale: 1 turns CFG off; below 1 would extrapolate away from the prompt, which no workflow means."""
    expected = "a finite number >= 1 (1 means no CFG)"
    number = _real(name, value, expected)
    if number < 1.0:
        raise InputError(name, value, expected)
    return number


def check_denoise(value, name: str = "denoise") -> float:
    expected = "a finite number in (0, 1]"
    number = _real(name, value, expected)
    if not 0.0 < number <= 1.0:
        raise InputError(name, value, expected)
    return number


def check_reference_resolution(value, name: str = "reference_resolution") -> int:
    """References are resized to about `value`**2 pixels in 32 px steps."""
    expected = f"an integer number of pixels from {REFERENCE_MULTIPLE} to {MAX_REFERENCE_RESOLUTION}"
    value = _integer(name, value, expected)
    if not REFERENCE_MULTIPLE <= value <= MAX_REFERENCE_RESOLUTION:
        raise InputError(name, value, expected)
    return value


def check_reference_size(name: str, original: tuple[int, int], resized: tuple[int, int]) -> None:
    """A reference image of `original` (w, h) px that the pipeline's sizing maps to `resized` (w, h) px."""
    width, height = resized
    expected = (f"an image whose sides differ by at most {MAX_REFERENCE_ASPECT}x, so that resized each side is "
                f"{REFERENCE_MULTIPLE} to {MAX_IMAGE_SIDE} px")
    value = f"{original[0]}x{original[1]} px"
    if min(width, height) < REFERENCE_MULTIPLE or max(width, height) > MAX_IMAGE_SIDE:
        raise InputError(name, value, expected)
    if max(width, height) / min(width, height) > MAX_REFERENCE_ASPECT:
        raise InputError(name, value, expected)


def check_prompt_text(name: str, prompt) -> str:
    """A prompt is a string of whole Unicode characters. A lone UTF-16 surrogate (`"\\ud800"` in JSON: half of a
    character such as an emoji, cut in two) cannot be encoded as UTF-8, so no tokenizer can read it."""
    if not isinstance(prompt, str):
        raise InputError(name, type(prompt).__name__, "a string")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(name, f"text with a lone surrogate U+{ord(prompt[exc.start]):04X} at character {exc.start}",
                         "whole Unicode characters (a lone UTF-16 surrogate is half of a character, e.g. of an "
                         "emoji cut in two)") from None
    return prompt


def check_prompt_tokens(name: str, characters: int, tokens: int) -> None:
    if tokens > MAX_PROMPT_TOKENS:
        raise InputError(name, f"{characters} characters ({tokens} tokens)",
                         f"at most {MAX_PROMPT_TOKENS} tokens (about {MAX_PROMPT_TOKENS * 3 // 4} English words)")


def check_positions(text_tokens: int, img_shapes) -> None:
    """The joint sequence's rotary positions fit the table: `text_tokens` text rows plus each image block's
    max(h, w) (the target's block is the last and starts at the final position), and no image side too long."""
    for i, (_, h, w) in enumerate(img_shapes):
        if max(h, w) > MAX_SIDE_TOKENS:
            name = "target image" if i == len(img_shapes) - 1 else f"reference image {i + 1}"
            raise InputError(name, f"{w * VAE_SCALE}x{h * VAE_SCALE} px",
                             f"sides of at most {MAX_IMAGE_SIDE} px (the transformer's rotary table)")
    last = text_tokens + sum(max(h, w) for _, h, w in img_shapes[:-1])
    if last >= ROPE_POSITIONS:
        raise InputError("prompt and reference images", f"{text_tokens} text tokens and {len(img_shapes) - 1} "
                         f"references spanning {last} positions",
                         f"at most {ROPE_POSITIONS - 1} positions in all (the transformer's rotary table): a shorter "
                         "prompt, or fewer or smaller references")


def check_finite(name: str, tensor: torch.Tensor, cause: str) -> None:
    """One reduction (and one host sync) over an input tensor; call once per request, not per step."""
    if not bool(torch.isfinite(tensor).all()):
        raise InputError(name, "a tensor with NaN or infinite values", f"finite values ({cause})")


# ComfyUI's names for the types a user can wire, so a refusal says what arrived in the words of the UI's sockets.
_SOCKET_NAMES = ((bool, "a BOOLEAN"), (int, "an INT"), (float, "a FLOAT"), (str, "a STRING"))


def describe_value(value) -> str:
    """What arrived at an input, for a refusal: the socket type a Switch-like node passed on (a STRING, an INT, ...),
    a tensor's shape, or the object's class (ComfyUI's MODEL is a ModelPatcher)."""
    for kind, name in _SOCKET_NAMES:
        if isinstance(value, kind):
            return name
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if value is None:
        return "nothing"
    kind = type(value).__name__
    return f"a MODEL ({kind})" if kind.endswith("ModelPatcher") else f"a {kind}"


def check_kind(name: str, value, kinds, expected: str):
    """`value` when it is an instance of `kinds`; else an InputError naming the input, what arrived and `expected`.
    A typed socket only takes its type in the UI, but a Switch-like node (any output type) or the API can hand any
    object to any input."""
    if not isinstance(value, kinds):
        raise InputError(name, describe_value(value), expected)
    return value
