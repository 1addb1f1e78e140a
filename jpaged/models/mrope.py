"""Multimodal rotary positions (M-RoPE) of Qwen2-VL and Qwen2.5-VL's language model.

Every token has three positions: temporal, height and width. A text token has the same value in
all three (its ordinary position, counted on from the previous item). The tokens of an image of
(t, h, w) merged patches, starting at position s, have (s + frame, s + row, s + column), and
the text after it goes on from s + max(h, w) (t = 1 for an image): a prompt's positions run
behind its length by a fixed "delta", which every later (generated) token keeps: position
p + delta in all three.

The rotation splits the head's frequencies into `mrope_section` (e.g. [16, 24, 24] of 64): the
first section turns with the temporal position, the next with the height, the last with the
width. With all three equal this is the ordinary rotary embedding.

`mrope_positions` is the host-side (numpy) counterpart of HF's `get_rope_index`, for one sequence.
"""

import jax.numpy as jnp
import numpy as np


def mrope_positions(input_ids, grids, image_token_id: int, spatial_merge_size: int, *,
                    video_token_id: int | None = None, video_grids=(), video_time_intervals=None
                    ) -> tuple[np.ndarray, int]:
    """The positions int64[3, len(input_ids)] of one prompt whose images (`grids` [(t, h, w)] in
    patches, in order) fill the runs of `image_token_id`, and its delta (positions past the
    prompt: the token's index + delta in all three). Videos likewise with `video_grids`, their
    temporal positions spaced by `video_time_intervals` (Qwen2.5-VL: tokens_per_second *
    second_per_grid; default 1). ValueError when the placeholders and the grids disagree."""
    ids = np.asarray(input_ids).reshape(-1)
    kinds = np.zeros(len(ids), np.int8)
    kinds[ids == image_token_id] = 1
    if video_token_id is not None:
        kinds[ids == video_token_id] = 2
    items = {1: [(tuple(int(v) for v in g), 1.0) for g in grids],
             2: [(tuple(int(v) for v in g), t) for g, t in
                 zip(video_grids, video_time_intervals or [1.0] * len(video_grids))]}
    used = {1: 0, 2: 0}
    merge = spatial_merge_size
    parts, pos, i = [], 0, 0
    while i < len(ids):
        kind = kinds[i]
        j = i
        while j < len(ids) and kinds[j] == kind:
            j += 1
        if kind == 0:
            parts.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
            pos += j - i
            i = j
            continue
        # A run of placeholders: the next image's tokens (adjacent images follow one another).
        name = "image" if kind == 1 else "video"
        if used[kind] >= len(items[kind]):
            raise ValueError(f"the prompt has more {name} placeholder tokens than {name}s")
        (t, h, w), interval = items[kind][used[kind]]
        used[kind] += 1
        gt, gh, gw = t, h // merge, w // merge
        n = gt * gh * gw
        if n > j - i:
            raise ValueError(f"{name} {used[kind] - 1} needs {n} placeholder tokens, the prompt has {j - i}")
        tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        temporal = (tt.ravel() * interval).astype(np.int64) + pos
        parts.append(np.stack([temporal, hh.ravel() + pos, ww.ravel() + pos]))
        pos += max(gh, gw)
        i += n
    for kind, name in ((1, "image"), (2, "video")):
        if used[kind] != len(items[kind]):
            raise ValueError(f"{len(items[kind])} {name}s but placeholder tokens for {used[kind]}")
    positions = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions.astype(np.int64), delta


def text_positions(start: int, count: int, delta: int) -> np.ndarray:
    """The positions int64[3, count] of tokens start .. start + count - 1 past the images (generated
    tokens, or a prompt's text tail): index + delta in all three."""
    return np.broadcast_to(np.arange(start, start + count, dtype=np.int64) + delta, (3, count)).copy()


def section_axes(mrope_section) -> np.ndarray:
    """Which of the three positions turns each frequency: int32[sum(mrope_section)]."""
    return np.concatenate([np.full(n, i % 3, np.int32) for i, n in enumerate(mrope_section)])


def apply_mrope(x, positions, inv_freq, mrope_section):
    """Rotate-half rotary embedding of x [tokens, heads, head_dim] at positions int[3, tokens]
    (or int[tokens]: the three equal), each frequency by the position its section names."""
    half = inv_freq.shape[-1]
    axes = section_axes(mrope_section)
    if len(axes) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must add up to head_dim / 2 = {half}")
    pos = positions.astype(jnp.float32)
    if pos.ndim == 1:
        freqs = pos[:, None] * inv_freq[None, :]
    else:
        freqs = pos[axes, :].T * inv_freq[None, :]  # [tokens, half]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def step_mrope_positions(positions: np.ndarray, lens, tables) -> np.ndarray:
    """A step's M-RoPE positions int32[3, tokens] from its 1-D ones (int32[tokens]: each token's
    position in its sequence, the step's sequences one after another, `lens` tokens each, then
    padding): sequence i's token at position p takes column p of tables[i] = (positions [3, L],
    delta) when p < L (its prompt), else p + delta in all three; a sequence whose table is None
    (a text-only prompt) and the padding keep p in all three."""
    positions = np.asarray(positions)
    out = np.broadcast_to(positions.astype(np.int32), (3, len(positions))).copy()
    start = 0
    for n, table in zip(lens, tables):
        if table is not None:
            prompt, delta = table
            p = positions[start:start + n].astype(np.int64)
            inside = p < prompt.shape[1]
            out[:, start:start + n] = np.where(inside[None], prompt[:, np.minimum(p, max(prompt.shape[1] - 1, 0))],
                                               (p + delta)[None])
        start += n
    return out
