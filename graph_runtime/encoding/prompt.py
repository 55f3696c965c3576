"""Prompt encoding with Qwen3-VL exactly as `QwenImage21Pipeline` does it.

The raw template string (not `apply_chat_template`, which tokenizes differently), left padding, the last decoder
layer's hidden states *before* the final norm, the system turn dropped, and a mask of the image-slot positions.

Unlike the pipeline, which calls the whole `Qwen3VLForConditionalGeneration`, only its base model runs here: the LM
head would turn every token into 151,936 logits nobody reads (8.5-12 GB for a long prompt), and neither a KV cache
nor every layer's hidden states are kept. The embeddings are the same tensors the pipeline reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import check_prompt_text, check_prompt_tokens
from .prompt_tokens import TemplateTokenizer

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
TEMPLATE = (
    f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
VISION_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class PromptEmbeds:
    """One encoded prompt (one CFG branch): what the transformer reads as text context.

    `image_mask` marks the encoder positions that are image slots (each stands for 2x2 latent tokens of a
    reference image); the transformer replaces them with the reference latents. `text_mask` is None unless the
    encoder output is padded.
    """

    embeds: torch.Tensor  # [N, L, C]
    image_mask: torch.Tensor  # [N, L] bool
    text_mask: torch.Tensor | None = None  # [N, L] bool

    @property
    def num_image_slots(self) -> int:
        return int(self.image_mask[0].sum())

    def for_batch(self, batch: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings and mask repeated to `batch` samples (the pipeline's `num_images_per_prompt` repeat)."""
        embeds = self.embeds.to(device, dtype)
        if embeds.shape[0] == 1 and batch > 1:
            embeds = embeds.repeat(batch, 1, 1)
        elif embeds.shape[0] != batch:
            raise ValueError(f"prompt embeddings hold {embeds.shape[0]} prompts but the batch is {batch}")
        mask = None
        if self.text_mask is not None and not bool(self.text_mask.all()):
            mask = self.text_mask.to(device).bool()
            if mask.shape[0] == 1 and batch > 1:
                mask = mask.repeat(batch, 1)
        return embeds, mask


def prompt_template(prompt: str, num_images: int) -> tuple[str, str, str]:
    """The pipeline's template as (before, prompt, after); reference images go first in the user turn, as
    `<imageN>` + a vision block."""
    prompt = prompt or " "  # Qwen has no BOS token: an empty prompt would leave the encoder nothing to read.
    before, after = TEMPLATE.split("{}")
    return before + " ".join(f"<image{i + 1}>{VISION_BLOCK}" for i in range(num_images)), prompt, after


def prompt_text(prompt: str, num_images: int) -> str:
    """The pipeline's template string, as its processor reads it."""
    return "".join(prompt_template(prompt, num_images))


def _flatten_alpha(image):
    """The vision encoder was trained on RGBA composited over white; the VAE reads all four channels itself."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    if image.mode == "RGBA":
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.getchannel("A"))
        return white
    return image


class PromptEncoder:
    def __init__(self, text_encoder, processor):
        self.text_encoder = text_encoder
        self.processor = processor
        self.tokens = TemplateTokenizer(processor)
        self.image_token_id = self.tokens.image_token_id
        # Leading system-turn tokens to drop, counted on the tokenized system turn itself.
        system_turn = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        self.drop_idx = len(processor.tokenizer(system_turn, add_special_tokens=False).input_ids)

    @property
    def device(self) -> torch.device:
        return next(self.text_encoder.parameters()).device

    def check_prompt(self, prompt, num_images: int = 0, name: str = "prompt") -> None:
        """Refuse a prompt that is not a string of whole characters or is longer than `MAX_PROMPT_TOKENS`, by
        tokenizing it alone (no image processing, no model): the count is of the tokens the transformer will read,
        template included."""
        check_prompt_text(name, prompt)
        ids = self.tokens.ids(*prompt_template(prompt, num_images))
        text_tokens = sum(1 for i in ids[self.drop_idx:] if i != self.image_token_id)
        check_prompt_tokens(name, len(prompt), text_tokens)

    def token_bound(self, prompt: str, images=()) -> int:
        """About the tokens one encode of `prompt` with `images` (PIL) runs: the template's, plus one per 32x32 pixels
        of each image (Qwen3-VL's 16-pixel patches, merged 2x2), rounded up: for sizing the encode before it runs."""
        ids = self.tokens.ids(*prompt_template(prompt, len(images)))
        return len(ids) + sum(-(-img.width // 32) * -(-img.height // 32) for img in images)

    @torch.no_grad()
    def encode(self, prompts: str | list[str], images: list | None = None, device=None,
               name: str = "prompt") -> PromptEmbeds:
        """Encode one or more prompts, each with the same reference images (already resized, PIL).

        A prompt longer than `MAX_PROMPT_TOKENS` is refused (naming `name`) before the encoder runs.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        images = list(images or [])
        for prompt in prompts:
            self.check_prompt(prompt, len(images), name)
        device = device or self.device
        # What the processor gives for the template strings, except that a prompt's text never becomes a control
        # token (prompt_tokens.py).
        forward = self.tokens.batch([prompt_template(p, len(images)) for p in prompts],
                                    [_flatten_alpha(img) for img in images], device)
        forward["use_cache"] = False
        input_ids, attention_mask = forward["input_ids"], forward["attention_mask"]

        # The transformer was trained on the last decoder layer's output *before* the final RMSNorm. A forward hook
        # returning the norm's input makes the base model's `last_hidden_state` exactly that, for this call: the
        # tensor the pipeline reads as `hidden_states[-1]` (transformers 5 ties that entry to the normed output,
        # which the same hook undoes there). The base model stops before the LM head.
        model = self.text_encoder.model
        text_model = getattr(model, "language_model", model)
        handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])
        try:
            hidden = model(**forward).last_hidden_state
        finally:
            handle.remove()

        valid = attention_mask.bool()
        per_sample = [h[m][self.drop_idx:] for h, m in zip(hidden, valid)]
        slots = [(ids[m] == self.image_token_id)[self.drop_idx:] for ids, m in zip(input_ids, valid)]
        longest = max(e.shape[0] for e in per_sample)
        embeds = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], e.shape[1])]) for e in per_sample])
        text_mask = torch.stack([
            torch.cat([torch.ones(e.shape[0], dtype=torch.bool, device=e.device),
                       torch.zeros(longest - e.shape[0], dtype=torch.bool, device=e.device)]) for e in per_sample
        ])
        image_mask = torch.stack([torch.cat([s, s.new_zeros(longest - s.shape[0])]) for s in slots])
        return PromptEmbeds(embeds=embeds, image_mask=image_mask, text_mask=None if text_mask.all() else text_mask)
