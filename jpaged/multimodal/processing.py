"""A multimodal prompt -> what the engine runs: token ids with each image's placeholder tokens
expanded (by the checkpoint's own transformers processor, `AutoProcessor`), each image's pixel
inputs, its content hash (vLLM's mm_hash) and the range of prompt positions its tokens fill.

The sequence keeps the placeholder token's real id at those positions (so the vocabulary check,
penalties and prompt logprobs see real ids); the engine swaps them for encoder-cache rows in the
step's inputs (multimodal/runner.py), and the prefix cache adds the hash to the keys of the blocks
that hold them (core/block_manager.py).

Families differ in a `FamilySpec`: which token id is the placeholder, and how the processor's
batched pixel inputs split into one image's.
"""

import dataclasses
import hashlib
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class MMItem:
    """One image of a prompt."""

    mm_hash: str  # sha256 of the image's mode, size and pixels (hex)
    offset: int  # its first placeholder token's prompt position
    length: int  # its placeholder tokens (its embeddings' first rows)
    pixel_inputs: dict  # name -> np.ndarray, one image's (batch 1), what the model's embed_image takes
    cache_rows: int = 0  # encoder-cache rows its encode writes (a padded bucket's: more than length); 0: length

    @property
    def rows(self) -> int:
        return self.cache_rows or self.length


@dataclasses.dataclass
class ProcessedPrompt:
    """A prompt ready for LLMEngine.add_request (which takes it in place of a str or token ids)."""

    token_ids: list[int]
    items: list[MMItem]
    prompt: str | None = None  # the text, as RequestOutput.prompt reports it

    @property
    def mm_ranges(self) -> tuple:
        """(offset, length, mm_hash) per image: what the block manager's hashes read."""
        return tuple((item.offset, item.length, item.mm_hash) for item in self.items)


def split_batched(name: str) -> Callable[[dict, int], dict]:
    """Image i's inputs: row i of the batched array `name` (LLaVA, Gemma 3)."""
    return lambda processed, i: {name: np.asarray(processed[name][i:i + 1], np.float32)}


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    placeholder_id: Callable  # hf_config -> the image placeholder token's id
    pixel_inputs: Callable[[dict, int], dict]  # (the processor's output, image index) -> that image's inputs


FAMILIES = {
    "llava": FamilySpec(lambda cfg: cfg.image_token_index, split_batched("pixel_values")),
    "gemma3": FamilySpec(lambda cfg: cfg.image_token_index, split_batched("pixel_values")),
    # Qwen2-VL's pixel inputs come from the model (`pixel_inputs`: image i's patch rows, padded to a bucket).
    "qwen2_vl": FamilySpec(lambda cfg: cfg.image_token_id, split_batched("pixel_values")),
    "qwen2_5_vl": FamilySpec(lambda cfg: cfg.image_token_id, split_batched("pixel_values")),
}


def family_of(hf_config) -> FamilySpec:
    spec = FAMILIES.get(hf_config.model_type)
    if spec is None:
        raise ValueError(f"no multimodal processing for model_type {hf_config.model_type!r}")
    return spec


def image_hash(image) -> str:
    """vLLM's mm_hash of a PIL image: its mode, size and raw pixels (not the file's bytes: the same
    picture in PNG and in WebP hashes the same)."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def placeholder_runs(token_ids: list[int], placeholder: int, lengths: list[int]) -> list[int]:
    """The first position of each image's placeholder tokens: images in order, each `lengths[i]`
    consecutive placeholder ids (adjacent images make one longer run). ValueError when the prompt's
    placeholders do not add up to the images'."""
    ids = np.asarray(token_ids)
    positions = np.flatnonzero(ids == placeholder)
    if len(positions) != sum(lengths):
        raise ValueError(f"multi_modal_data: the prompt has {len(positions)} image placeholder tokens "
                         f"for {len(lengths)} image(s) of {sum(lengths)} tokens in all; put one image "
                         "placeholder (e.g. <image>) in the prompt per image")
    offsets, at = [], 0
    for n in lengths:
        run = positions[at:at + n]
        if n and run[-1] - run[0] != n - 1:
            raise ValueError("multi_modal_data: an image's placeholder tokens are not consecutive in the prompt")
        offsets.append(int(run[0]) if n else 0)
        at += n
    return offsets


def process_prompt(processor, hf_config, prompt: str, images: list, num_tokens: Callable[[dict], int],
                   pixel_inputs: Callable[[dict, int], dict] | None = None,
                   output_rows: Callable[[dict], int] | None = None) -> ProcessedPrompt:
    """Run the checkpoint's processor over `prompt` (one placeholder per image, e.g. LLaVA's
    "<image>") and `images` (PIL). The model's: `num_tokens(pixel_inputs)`, an image's placeholder
    tokens; `pixel_inputs(processed, i)`, image i's inputs (default: the family's split);
    `output_rows(pixel_inputs)`, the rows its encode writes (default: num_tokens). ValueError
    naming multi_modal_data when the prompt and the images do not match."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt: a multimodal prompt must be a non-empty string with one image placeholder "
                         "per image")
    spec = family_of(hf_config)
    try:
        processed = processor(text=prompt, images=images or None, return_tensors="np")
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"multi_modal_data: the processor refused the prompt and its images "
                         f"({' '.join(str(e).split())[:200]})") from None
    token_ids = [int(t) for t in np.asarray(processed["input_ids"])[0]]
    pixels = [(pixel_inputs or spec.pixel_inputs)(processed, i) for i in range(len(images))]
    lengths = [num_tokens(p) for p in pixels]
    offsets = placeholder_runs(token_ids, spec.placeholder_id(hf_config), lengths)
    items = [MMItem(image_hash(image), offset, n, p, output_rows(p) if output_rows else 0)
             for image, offset, n, p in zip(images, offsets, lengths, pixels)]
    return ProcessedPrompt(token_ids, items, prompt)


def process_token_prompt(processor, hf_config, token_ids: list[int], images: list, num_tokens: Callable[[dict], int],
                         pixel_inputs: Callable[[dict, int], dict] | None = None,
                         output_rows: Callable[[dict], int] | None = None) -> ProcessedPrompt:
    """vLLM's {"prompt_token_ids": ..., "multi_modal_data": ...}: the images through the
    processor's image processor; the ids hold each image's placeholder token once (expanded here
    to its tokens) or already expanded. ValueError naming multi_modal_data otherwise."""
    spec = family_of(hf_config)
    placeholder = spec.placeholder_id(hf_config)
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        raise ValueError("multi_modal_data: the checkpoint's processor has no image processor")
    try:
        processed = dict(image_processor(images=images, return_tensors="np"))
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"multi_modal_data: the image processor refused the images "
                         f"({' '.join(str(e).split())[:200]})") from None
    pixels = [(pixel_inputs or spec.pixel_inputs)(processed, i) for i in range(len(images))]
    lengths = [num_tokens(p) for p in pixels]
    if token_ids.count(placeholder) == len(images) != sum(lengths):  # one placeholder an image: expand each
        each = iter(lengths)
        token_ids = [t for token in token_ids for t in ([token] * next(each) if token == placeholder else [token])]
    offsets = placeholder_runs(token_ids, placeholder, lengths)
    items = [MMItem(image_hash(image), offset, n, p, output_rows(p) if output_rows else 0)
             for image, offset, n, p in zip(images, offsets, lengths, pixels)]
    return ProcessedPrompt(list(token_ids), items, None)
