"""The prompt-to-image jobs the end-to-end benchmark runs, and their inputs.

A job is what a user queues: a prompt (of a set token length, so the text prefix matches the decode benchmark's
128 tokens), a size, a schedule and optionally one reference image. Text-to-image at 1024x1024 with 40 steps is
the headline (SGLang publishes 4.48 s for it on one H200); Turbo runs the fixed 8-step grid; the edit adds one
1024x1024 reference, which both the vision encoder and the VAE read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROMPT_TOKENS = 128  # text prefix tokens after the system turn is dropped, as in the decode benchmark
_WORDS = ("a capybara wearing a wizard hat reading a book by candlelight oil painting portrait studio lighting "
          "highly detailed sharp focus golden hour red cube on a blue sphere at sunset snowy mountain boat").split()


@dataclass(frozen=True)
class E2EScenario:
    name: str
    size: int = 1024
    steps: int = 40
    sigma_preset: str = "dynamic"
    references: int = 0

    def for_tiny(self) -> "E2EScenario":
        """The same job on the tiny model: 128x128, at most 4 dynamic steps (Turbo keeps its 8-step grid)."""
        steps = self.steps if self.sigma_preset == "turbo" else min(self.steps, 4)
        return E2EScenario(self.name, 128, steps, self.sigma_preset, self.references)


SCENARIOS = {
    "t2i": E2EScenario("t2i"),
    "turbo": E2EScenario("turbo", steps=8, sigma_preset="turbo"),
    "edit": E2EScenario("edit", references=1),
}


def select(names: str, tiny: bool) -> list[E2EScenario]:
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SCENARIOS]
    if unknown or not wanted:
        raise SystemExit(f"--e2e-scenarios: unknown {unknown or names!r}; choose from {', '.join(SCENARIOS)}")
    return [SCENARIOS[n].for_tiny() if tiny else SCENARIOS[n] for n in wanted]


def prompt_of_tokens(encoder, tokens: int = PROMPT_TOKENS) -> tuple[str, int]:
    """A prompt whose text prefix (what the transformer sees after the system turn is dropped) is `tokens` long with
    this tokenizer, or the shortest one past it, and that prefix's length."""
    words: list[str] = []
    while True:
        text = " ".join(words) or " "
        count = text_prefix_tokens(encoder, text)
        if count >= tokens:
            return text, count
        words.append(_WORDS[len(words) % len(_WORDS)])


def text_prefix_tokens(encoder, prompt: str) -> int:
    from graph_runtime.encoding.prompt import prompt_text

    tokenizer = encoder.processor.tokenizer
    return len(tokenizer(prompt_text(prompt, 0), add_special_tokens=False).input_ids) - encoder.drop_idx


def reference_image(size: int, seed: int = 0):
    """A noise RGB image of `size`x`size` (the reference's content does not change any shape or kernel)."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)
