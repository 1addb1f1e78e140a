"""The scheduler's side of the encoder cache (vLLM's encoder budget): the images one step's
prefill chunks cover must all be in the device encoder cache at once (multimodal/runner.py pins
them while it builds the step), so a chunk stops before an image that would overflow it; the
image's tokens go in a later step. Host only, no jax: the scheduler imports it.

A group with images carries `mm_items` (processing.MMItem: offset, length, mm_hash) and
`encoder_cache_rows` (the cache's size), both set when the request is added."""


def encoder_chunk(seq_group, start: int, chunk: int, step_images: dict) -> int:
    """`chunk` tokens from position `start`, cut before the first image that would take the step's
    cached images (`step_images`: {mm_hash: rows} so far this step) past the cache's rows; 0 when
    that image starts before `start` (its remaining tokens wait for a step with room)."""
    rows = seq_group.encoder_cache_rows
    used = sum(step_images.values())
    for item in seq_group.mm_items:
        if item.offset >= start + chunk:
            break
        if item.offset + item.length <= start or item.mm_hash in step_images:
            continue
        if used + item.rows > rows:
            return max(item.offset - start, 0)
        used += item.rows
    return chunk


def take_encoder_rows(seq_group, start: int, chunk: int, step_images: dict):
    """Count the images positions [start, start + chunk) cover into this step's `step_images`."""
    for item in seq_group.mm_items:
        if item.offset < start + chunk and start < item.offset + item.length:
            step_images[item.mm_hash] = item.rows
