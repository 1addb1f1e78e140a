"""Qwen2-VL's prompt processing without transformers' Qwen2VLProcessor.

transformers 5's Qwen2VLProcessor (and Qwen2.5-VL's) cannot be built without torchvision: its
video processor's class check fails (AttributeError) even when no video processor is given, so
AutoProcessor fails on these checkpoints on a machine without torchvision. The processor's image
work is its image processor's (AutoImageProcessor, which falls back to the pillow backend) and
the rest is small: each image placeholder "<|image_pad|>" of the text becomes t * h * w / merge^2
of them (the image's grid), then the tokenizer runs. This class does exactly that, with the
interface the engine uses (`__call__(text=..., images=..., return_tensors="np")`,
`apply_chat_template`, `tokenizer`, `image_processor`).
"""

import logging
import os

import numpy as np

logger = logging.getLogger(__name__)
IMAGE_PAD = "<|image_pad|>"


class Qwen2VLPromptProcessor:
    """`max_patches` (the model's largest vision bucket): the image processor's max_pixels is lowered
    so that no image has more patches (a larger image is resized down, as max_pixels does), and no
    image needs an encoder that was not compiled."""

    def __init__(self, tokenizer, image_processor, chat_template: str | None = None, max_patches: int | None = None):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        size = getattr(image_processor, "size", None)  # a SizeDict (or a dict): longest_edge is max_pixels
        longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        if max_patches is not None and longest:
            limit = max_patches * int(getattr(image_processor, "patch_size", 14)) ** 2
            if longest > limit:
                logger.warning("images are resized to at most %d pixels (max_pixels was %d): the vision encoder is "
                               "compiled for up to %d patches", limit, longest, max_patches)
                image_processor.size = type(size)(**{**dict(size), "longest_edge": limit})
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.merge = int(getattr(image_processor, "merge_size", 2))

    @classmethod
    def from_pretrained(cls, model_dir: str, max_patches: int | None = None) -> "Qwen2VLPromptProcessor":
        from transformers import AutoImageProcessor, AutoTokenizer

        template = None
        for name in ("chat_template.jinja", "chat_template.json"):
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                from jpaged.file_safety import read_json

                if name.endswith(".json"):
                    loaded = read_json(path, path)
                    template = loaded.get("chat_template") if isinstance(loaded, dict) else None
                else:
                    with open(path, encoding="utf-8") as f:
                        template = f.read(1 << 20)
                break
        return cls(AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir), template,
                   max_patches)

    def __call__(self, text: str, images=None, return_tensors: str = "np", **kwargs) -> dict:
        """input_ids [1, L] with each image's placeholders expanded, pixel_values [patches, dim] and
        image_grid_thw [images, 3] (when images are given), mm_token_type_ids [1, L]."""
        if not isinstance(text, str):
            raise ValueError("text: one prompt string")
        images = list(images or [])
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(images):
            raise ValueError(f"the prompt has {len(parts) - 1} {self.image_token} placeholder(s) for "
                             f"{len(images)} image(s)")
        out = {}
        expanded = parts[0]
        if images:
            pixels = self.image_processor(images=images, return_tensors="np")
            grids = np.asarray(pixels["image_grid_thw"]).reshape(-1, 3)
            out["pixel_values"] = np.asarray(pixels["pixel_values"])
            out["image_grid_thw"] = grids
            for part, grid in zip(parts[1:], grids):
                expanded += self.image_token * (int(np.prod(grid)) // self.merge ** 2) + part
        ids = self.tokenizer(expanded)["input_ids"]  # (special tokens as the tokenizer adds them, as HF's processor)
        out["input_ids"] = np.asarray([ids], np.int64)
        out["mm_token_type_ids"] = (out["input_ids"] == self.image_token_id).astype(np.int32)
        return out

    def apply_chat_template(self, messages, chat_template: str | None = None, **kwargs):
        return self.tokenizer.apply_chat_template(messages, chat_template=chat_template or self.chat_template,
                                                  **kwargs)
