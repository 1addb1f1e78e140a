"""The encoder-output cache: image embeddings on the device, and which image holds which rows.

A multimodal model owns `encoder_cache`, an `EncoderCache` variable [rows, text hidden] in its
state (as LoRA slots live in the projections' state). The engine writes an image's embeddings
there once (`multimodal/runner.py`: one jitted encode per image), and a step's placeholder tokens
are sent as ids `vocab_size + row`: the model's embedding (`embed_with_cache`) reads rows of the
cache for them and the text table for the rest. So the forward keeps its signature and its
executables, and an image's embeddings stay on the device across the steps that prefill its
tokens (chunked prefill may cut through an image).

`EncoderCacheManager` (host side) keeps which image (by content hash, vLLM's mm_hash) holds which
rows, least recently used first out, with a budget in tokens (rows) as vLLM's
`encoder_cache_size`. An image a step needs is never evicted during that step; an image evicted
before all its tokens are prefilled (or after a preemption by recompute) is encoded again.
"""

import collections

import jax.numpy as jnp
from flax import nnx


class EncoderCache(nnx.Variable):
    """[rows, hidden] image embeddings (not a weight: never read from a checkpoint)."""


def embed_with_cache(embed_tokens, encoder_cache, input_ids, vocab_size: int):
    """Each token's input embedding: ids < vocab_size from the text table (`embed_tokens`, a
    function of ids), ids >= vocab_size row `id - vocab_size` of the encoder cache."""
    cache = encoder_cache[...]
    is_image = input_ids >= vocab_size
    text = embed_tokens(jnp.where(is_image, 0, input_ids))
    image = jnp.take(cache, jnp.clip(input_ids - vocab_size, 0, cache.shape[0] - 1), axis=0)
    return jnp.where(is_image[:, None], image.astype(text.dtype), text)


class EncoderCacheFull(RuntimeError):
    """The images one step needs do not fit in the encoder cache together."""


class EncoderCacheManager:
    """Which image holds which rows of the device cache: {mm_hash: (first row, rows)}, LRU order."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.entries: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        self.num_encoded = 0  # images encoded so far (a test's view of re-encodes)

    def lookup(self, mm_hash: str) -> int | None:
        """The first row of a cached image (now the most recently used), or None."""
        entry = self.entries.get(mm_hash)
        if entry is None:
            return None
        self.entries.move_to_end(mm_hash)
        return entry[0]

    def allocate(self, mm_hash: str, num_rows: int, pinned: set[str]) -> int:
        """Rows for a new image: the first gap that fits, evicting least recently used images
        that are not `pinned` (needed by the step being built) until one does."""
        if num_rows > self.num_rows:
            raise EncoderCacheFull(f"an image of {num_rows} tokens is larger than the encoder cache "
                                   f"({self.num_rows} tokens)")
        while True:
            row = self._first_fit(num_rows)
            if row is not None:
                self.entries[mm_hash] = (row, num_rows)
                return row
            victim = next((h for h in self.entries if h not in pinned), None)
            if victim is None:
                raise EncoderCacheFull(f"the images of one step need more than the encoder cache's "
                                       f"{self.num_rows} tokens")
            del self.entries[victim]

    def _first_fit(self, n: int) -> int | None:
        start = 0
        for row, size in sorted(self.entries.values()):
            if row - start >= n:
                return start
            start = max(start, row + size)
        return start if self.num_rows - start >= n else None

    def clear(self):
        self.entries.clear()
