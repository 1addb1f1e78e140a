"""The scheduler's side of the encoder cache (vLLM's encoder budget): the images one step's
prefill chunks cover must all be in the device encoder cache at once (multimodal/runner.py pins
them while it builds the step), so a chunk stops before an image that would overflow it; the
image's tokens go in a later step. Host only, no jax: the scheduler imports it.

With `disable_chunked_mm_input` (vLLM's; on for every group of a model whose image tokens attend
to each other both ways, Gemma 3: multimodal/mm_prefix.py) a chunk never ends inside an image
either: it stops before the image, or waits (0) when the image began before it (a prefix hit
that stopped inside the image) and the rest does not fit; the engine refuses an image larger
than the whole token budget up front (RequestValidator.check_whole_images).

A group with images carries `mm_items` (processing.MMItem: offset, length, mm_hash),
`encoder_cache_rows` (the cache's size) and `disable_chunked_mm_input`, set when the request is
added."""


def encoder_chunk(seq_group, start: int, chunk: int, step_images: dict) -> int:
    """`chunk` tokens from position `start`, cut before the first image that would take the step's
    cached images (`step_images`: {mm_hash: rows} so far this step) past the cache's rows; 0 when
    that image starts before `start` (its remaining tokens wait for a step with room). With the
    group's `disable_chunked_mm_input`, also cut before an image the chunk would end inside."""
    rows = seq_group.encoder_cache_rows
    used = sum(step_images.values())
    whole = getattr(seq_group, "disable_chunked_mm_input", False)
    for item in seq_group.mm_items:
        if item.offset >= start + chunk:
            break
        if item.offset + item.length <= start:
            continue
        if whole and start + chunk < item.offset + item.length:
            return max(item.offset - start, 0)
        if item.mm_hash in step_images:
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
