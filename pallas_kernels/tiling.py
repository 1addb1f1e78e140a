"""Index helpers shared by the Pallas kernels and their XLA twins.

Ragged prefill is tiled the same way by both implementations: each sequence's
new tokens are cut into query tiles of `tile` tokens, and tile j of the whole
batch is described by four int32 scalars computed here with jnp (no host sync):

  tile_seq[j]    which sequence the tile belongs to
  tile_tok0[j]   index into q (axis 0) of the tile's first token
  tile_pos0[j]   position (in its sequence) of the tile's first token
  tile_rows[j]   number of real tokens in the tile (0 for unused tiles)

The number of tiles is a static bound that depends only on the static shapes:
sum_i cdiv(q_len_i, tile) <= (T - m) // tile + m with m = min(S, T), because
each non-empty sequence wastes less than one tile.
"""

import jax.numpy as jnp


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a, b):
    """Ceil division for non-negative a (python or traced ints)."""
    return (a + b - 1) // b


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


# Split-K (flash-decoding) for the decode kernels: split long tables when few programs run.
TARGET_PROGRAMS = 256  # ~2 waves on a 108-132 SM GPU
MAX_SPLITS = 16


def auto_num_splits(num_programs: int, table_width: int, pages_per_iter: int) -> int:
    """Enough splits to reach TARGET_PROGRAMS, but >= 2 iterations each."""
    want = next_pow2(cdiv(TARGET_PROGRAMS, num_programs))
    most = max(1, table_width // (2 * pages_per_iter))
    return max(1, min(want, most, MAX_SPLITS))


def clamp_block_tables(block_tables, num_pages):
    """Garbage table entries (past a sequence's length) become valid page ids,
    so every gather/load stays in bounds; the keys they hold are masked out."""
    return jnp.clip(block_tables, 0, num_pages - 1).astype(jnp.int32)


def split_tables(block_tables, num_pages: int, num_programs: int, pages_per_iter: int, num_splits=None):
    """The decode kernels' split-K plan: (tables, splits, pages per split). Tables are clamped and
    padded so every split covers whole iterations of `pages_per_iter` pages."""
    width = block_tables.shape[1]
    splits = num_splits or auto_num_splits(num_programs, width, pages_per_iter)
    per_split = round_up(cdiv(width, splits), pages_per_iter)
    tables = jnp.pad(clamp_block_tables(block_tables, num_pages), ((0, 0), (0, splits * per_split - width)))
    return tables, splits, per_split


def ragged_plan(block_tables, num_pages: int, page_size: int, pages_per_iter: int, query_start_loc, context_lens,
                num_tokens: int, tile: int, key_limits=None):
    """The ragged prefill kernels' plan: tables clamped and padded to whole iterations of
    `pages_per_iter` pages, the query tiles (ragged_tiles), the keys a tile's queries see (the
    keys up to its last real token's, or up to the furthest of its `key_limits`: 0 for empty
    tiles) and, with `key_limits`, each tile row's last key (tile_last_keys; else None).
    Returns (tables, (seq, tok0, pos0, rows), num_keys, last_keys)."""
    width = block_tables.shape[1]
    padded_width = round_up(width, pages_per_iter)
    tables = jnp.pad(clamp_block_tables(block_tables, num_pages), ((0, 0), (0, padded_width - width)))
    seq, tok0, pos0, rows = ragged_tiles(query_start_loc, context_lens, num_tokens, tile)
    if key_limits is None:  # (the causal plan, op for op as before key limits existed)
        last_keys = None
        num_keys = jnp.minimum(context_lens[seq].astype(jnp.int32), pos0 + rows)
    else:
        last_keys = tile_last_keys(key_limits, tok0, pos0, rows, tile)
        num_keys = jnp.minimum(context_lens[seq].astype(jnp.int32), jnp.max(last_keys, axis=1) + 1)
    num_keys = jnp.where(rows > 0, jnp.clip(num_keys, 0, padded_width * page_size), 0)
    return tables, (seq, tok0, pos0, rows), num_keys, last_keys


def tile_last_keys(key_limits, tile_tok0, tile_pos0, tile_rows, tile: int):
    """The last key position each query of each tile sees, int32[NT, tile]: key_limits[token]
    where that is past the query's own position (a span of tokens that attend to each other both
    ways, as an image's tokens do in Gemma 3: vLLM's mm_prefix_range), its own position otherwise
    (causal; also for the rows past a tile's real tokens)."""
    r = jnp.arange(tile, dtype=jnp.int32)
    q_pos = tile_pos0[:, None] + r[None, :]
    limits = gather_query_tiles(key_limits.astype(jnp.int32), tile_tok0, tile_rows, tile)
    return jnp.where(r[None, :] < tile_rows[:, None], jnp.maximum(q_pos, limits), q_pos)


def num_ragged_tiles(num_tokens: int, num_seqs: int, tile: int) -> int:
    m = min(num_seqs, num_tokens)
    return max(1, (num_tokens - m) // tile + m)


def _seq_tiles(query_start_loc, tile: int, q_lens=None):
    """Per sequence: q_len and the [begin, end) range of its tiles. `q_lens` (default: from
    query_start_loc) may be smaller: those sequences' tokens are left out of the tiles."""
    qsl = query_start_loc.astype(jnp.int32)
    if q_lens is None:
        q_lens = jnp.maximum(qsl[1:] - qsl[:-1], 0)
    tile_end = jnp.cumsum(cdiv(q_lens, tile))
    return qsl, q_lens, tile_end - cdiv(q_lens, tile), tile_end


def ragged_tiles(query_start_loc, context_lens, num_tokens: int, tile: int, q_lens=None):
    """Returns (tile_seq, tile_tok0, tile_pos0, tile_rows), each int32[NT]. `q_lens`: as in
    _seq_tiles (a sequence given 0 gets no tile)."""
    num_seqs = query_start_loc.shape[0] - 1
    qsl, q_lens, tile_begin, tile_end = _seq_tiles(query_start_loc, tile, q_lens)
    nt = num_ragged_tiles(num_tokens, num_seqs, tile)
    j = jnp.arange(nt, dtype=jnp.int32)
    seq = jnp.searchsorted(tile_end, j, side="right").astype(jnp.int32)
    used = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    first = (j - tile_begin[seq]) * tile  # first token of the tile, seq-local
    rows = jnp.where(used, jnp.clip(q_lens[seq] - first, 0, tile), 0)
    tok0 = qsl[seq] + first
    pos0 = context_lens[seq].astype(jnp.int32) - q_lens[seq] + first
    return seq, tok0, pos0, rows.astype(jnp.int32)


def gather_query_tiles(q, tile_tok0, tile_rows, tile: int):
    """q [T, ...] -> [NT, tile, ...]; rows past tile_rows read token 0."""
    r = jnp.arange(tile, dtype=jnp.int32)
    idx = jnp.where(r[None, :] < tile_rows[:, None], tile_tok0[:, None] + r, 0)
    return q[jnp.clip(idx, 0, q.shape[0] - 1)]


def scatter_tiles_to_tokens(out_tiles, query_start_loc, num_tokens: int, tile: int, q_lens=None):
    """Inverse of gather_query_tiles: [NT, tile, ...] -> [num_tokens, ...].
    Padding tokens (outside query_start_loc[0]..[S]) get zeros. Written as a
    gather (each token finds its tile and row), which XLA does well."""
    num_seqs = query_start_loc.shape[0] - 1
    qsl, _, tile_begin, _ = _seq_tiles(query_start_loc, tile, q_lens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, num_seqs - 1)
    valid = (t >= qsl[0]) & (t < qsl[num_seqs])
    local = jnp.maximum(t - qsl[seq], 0)
    tile_idx = jnp.clip(tile_begin[seq] + local // tile, 0, out_tiles.shape[0] - 1)
    out = out_tiles[tile_idx, local % tile]
    mask = valid.reshape((-1,) + (1,) * (out.ndim - 1))
    return jnp.where(mask, out, jnp.zeros((), out.dtype))


def combine_splits(out, m, l):
    """Merge split partials: out [K, ..., R, dp], m/l [K, ..., R]. Splits that saw no key
    (l == 0) get weight 0 by selection: XLA may evaluate exp(m - m_all) as NaN when both are
    the mask value (seen on the CPU with m scaled from log2 units)."""
    m_all = jnp.max(m, axis=0)
    w = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)
    denom = jnp.sum(w * l, axis=0)
    num = jnp.sum(w[..., None] * out, axis=0)
    return num / jnp.where(denom > 0, denom, 1.0)[..., None]
