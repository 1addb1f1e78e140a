"""A step's key limits for a model whose image tokens attend to each other both ways (vLLM's
"mm prefix LM": `is_mm_prefix_lm`, Gemma 3), on the host.

Transformers' Gemma 3 gives each image's tokens (`token_type_ids` 1) a bidirectional block: an
image token sees every token of its own image, later ones included, and causally everything
before; text tokens stay causal. The paged kernels take that as a per-token key limit
(AttentionMetadata.key_limits, pallas_kernels.ragged_paged_attention): the position of the
image's last token for each of its tokens in the step, -1 (causal) for every other token. Those
later keys must be in the pages when the chunk attends, so the scheduler never ends a chunk inside
such an image (encoder_budget.encoder_chunk, `disable_chunked_mm_input`).

Prefix caching stays exact: a cached block holding part of an image was computed with the
whole image in view (the image ends in the chunk that computed it), and its hash covers the
image's mm_hash, which fixes the rest of the image (its tokens and embeddings). A hit that stops
inside an image is therefore reused as is, and the next chunk computes the image's remaining
tokens, up to its end, seeing the cached ones.
"""

import dataclasses

import numpy as np


def step_key_limits(batch, query_start_loc: np.ndarray, num_tokens: int) -> np.ndarray:
    """int32[num_tokens]: for each token of `batch` (a StepBatch) inside an image, the position
    of that image's last token; -1 elsewhere (padding included)."""
    limits = np.full(num_tokens, -1, np.int32)
    for scheduled, first, _ in batch.groups:
        items = getattr(scheduled.seq_group, "mm_items", None)
        if not items:
            continue
        for j in range(first, first + len(scheduled.seqs)):
            start = batch.start_pos[j]
            end = start + len(batch.token_ids[j])
            for item in items:
                lo, hi = max(start, item.offset), min(end, item.offset + item.length)
                if lo < hi:
                    at = int(query_start_loc[j]) - start
                    limits[at + lo:at + hi] = item.offset + item.length - 1
    return limits


def with_key_limits(batch, inputs):
    """The step's StepInputs (numpy, from prepare_step) with its key limits."""
    attn = inputs.attn
    limits = step_key_limits(batch, attn.query_start_loc, len(inputs.input_ids))
    return dataclasses.replace(inputs, attn=dataclasses.replace(attn, key_limits=limits))
