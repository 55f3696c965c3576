"""The prompt template as token ids, with the user's prompt read as text only.

Qwen3-VL's processor tokenizes the whole template string, so text in a prompt that spells one of the tokenizer's
added tokens becomes that token: `<|image_pad|>` or `<|video_pad|>` then fails the processor's count of images
(a transformers ValueError), and `<|im_end|>` would end the user's turn early. Here the template's own added tokens
are taken by id, and every stretch of text between them, the user's prompt included, goes through the tokenizer's
normalizer, pre-tokenizer and model with no added-token matching. `tokenizers` cuts its input at added tokens and
runs those three stages on each stretch itself, so a prompt without such text gets exactly the processor's ids (a
test compares them). Each reference image's pad is repeated as the processor repeats it, once per merged patch.
"""

from __future__ import annotations

import re

import torch

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"


class TemplateTokenizer:
    """Token ids for `before + prompt + after`, where only `before` and `after` (the template) hold control tokens."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.backend = self.tokenizer.backend_tokenizer
        added = sorted(self.tokenizer.added_tokens_encoder, key=len, reverse=True)  # a longer token wins
        self._added = re.compile("(" + "|".join(map(re.escape, added)) + ")")
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.video_token_id = self.tokenizer.convert_tokens_to_ids(VIDEO_PAD)

    def text_ids(self, text: str) -> list[int]:
        """`text` tokenized as text, whatever it spells."""
        if not text:
            return []
        if self.backend.normalizer is not None:
            text = self.backend.normalizer.normalize_str(text)
        pieces = [text] if self.backend.pre_tokenizer is None else [
            piece for piece, _ in self.backend.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for piece in pieces for token in self.backend.model.tokenize(piece)]

    def ids(self, before: str, prompt: str, after: str, image_tokens=()) -> list[int]:
        """The template's ids around `prompt`; the k-th image pad of the template repeated `image_tokens[k]` times
        (once when not given)."""
        ids, text, pads = [], "", iter(image_tokens)
        for part, is_template in ((before, True), (prompt, False), (after, True)):
            pieces = self._added.split(part) if is_template else [part]
            for i, piece in enumerate(pieces):
                if i % 2 == 0:  # text, joined with the text around it as `tokenizers` would see it
                    text += piece
                    continue
                ids += self.text_ids(text)
                text = ""
                token = self.tokenizer.convert_tokens_to_ids(piece)
                ids += [token] * (next(pads, 1) if token == self.image_token_id else 1)
        return ids + self.text_ids(text)

    def batch(self, templates: list[tuple[str, str, str]], images: list, device) -> dict:
        """The model's inputs for one template per prompt, each with the same `images` (PIL): what the processor
        returns for the joined strings (left padding), built from `ids`."""
        inputs = {}
        image_tokens = []
        if images:
            vision = self.processor.image_processor(images=[img for _ in templates for img in images],
                                                    return_tensors="pt")
            inputs.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
            merge = self.processor.image_processor.merge_size ** 2
            image_tokens = [int(thw.prod()) // merge for thw in vision["image_grid_thw"]]
        rows = []
        for i, template in enumerate(templates):
            rows.append(self.ids(*template, image_tokens=image_tokens[i * len(images):(i + 1) * len(images)]))
        longest = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (longest - len(r)) + r for r in rows], dtype=torch.long)
        inputs["input_ids"] = input_ids
        inputs["attention_mask"] = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows],
                                                dtype=torch.long)
        if "mm_token_type_ids" in self.processor.model_input_names:
            kinds = torch.zeros_like(input_ids)
            kinds[input_ids == self.image_token_id] = 1
            kinds[input_ids == self.video_token_id] = 2
            inputs["mm_token_type_ids"] = kinds
        return {name: value.to(device) for name, value in inputs.items()}
