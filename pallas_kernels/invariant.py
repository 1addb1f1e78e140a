"""Batch-invariant attention (the engine's `batch_invariant` mode): each query row's output has the
same bits whatever else is in the call -- other sequences, the padded shapes, the query tile it
lands in, whether its keys were written by this step or an earlier one (chunked prefill, prefix
hits), and whether it is a decode or a prefill row.

Why the XLA twins are not: they pick the key chunk and the query tile from the batch
(`xla.chunk_pages`, `xla_query_tile`), and XLA's CPU dot sums an output element in an order it
chooses from the operand shapes (measured: a decode row differs by 6e-8 with and without
neighbours at a fixed chunk). Here keys are visited in chunks of CHUNK_KEYS keys from key 0 and
queries in tiles of a fixed number of rows, so every q.k and p.v product is a batched dot
[rows, head_dim] x [head_dim, CHUNK_KEYS] (measured: such a dot's elements do not change with the
batch count or the row's place in the tile); other sums are `tree_sum`, elementwise adds in a
fixed pairwise order. A chunk that a row sees none of changes its running (max, sum, acc) by
exact identities (x * 1 + 0), so the number of chunks visited (the longest context in the call)
does not change a row's bits either.

The reference tile is QUERY_TILE rows, for decode and prefill rows alike. Where the backend's dot
gives a row the same bits with fewer or more rows (XLA's CPU dot in jax 0.10.2: any count from 2
rows up), measured at load by `invariant_tiles`, decode rows get tiles of their own (no empty
rows to pay for) and prefill rows larger tiles (each key chunk gathered for fewer tiles).

`attend` is shared with `LLM.policy()` (dense K/V, a static number of chunks: differentiable),
so a trainer's forward has the engine's bits.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import tiling
from pallas_kernels.cache_ops import as_dtype
from pallas_kernels.xla import _gather_pages, default_scale, soft_cap

CHUNK_KEYS = 64  # keys per online-softmax step: fixed, never chosen from the batch
# Query rows per tile, decode rows included, where `invariant_tiles` finds no other size with the
# same bits: fixed, never chosen from the batch. Small, since a decode row pays for the tile's empty
# rows; of 1, 2, 4, 8 and 16 rows, 4 gave the most tokens/s (bench_throughput, tiny; docs/PERF.md).
QUERY_TILE = 4


def tree_sum(x):
    """Sum over the last axis in a fixed pairwise order (halves added elementwise until one is
    left): XLA's reduce picks its own order per shape, an elementwise add cannot reorder."""
    n = x.shape[-1]
    width = 1 << max(0, n - 1).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def separate(*xs):
    """The values as they are, each rounded to its dtype and kept apart from the op that uses it:
    XLA's CPU emitter contracts a multiply and an add that land in one fusion into one FMA (one
    rounding, not two), and which ops share a fusion depends on the program around them (the
    engine's decode step, its chunked prefill, LLM.policy()'s forward, the same forward inside
    jax.value_and_grad). A select on isnan, whose arms are the value and the value + 1 (the same
    NaN where it is NaN), stands between them: neither XLA nor LLVM folds it, so the add after it
    never sees the multiply. An optimization barrier does not do it (measured: XLA's CPU pipeline
    removes it before fusion; the product still contracts)."""
    out = tuple(jnp.where(jnp.isnan(x), x + 1, x) for x in xs)
    return out[0] if len(xs) == 1 else out


def full_width(f, x, width=16):
    """f(x) for an elementwise f (exp, log), computed on x broadcast to [..., width] and read back:
    XLA's CPU exp and log give an element other bits when its fused loop has under 8 elements
    (measured, jax 0.10.2: exp of 7 values, log of 3 to 7, one element each differs from the same
    value in a longer array), and how many a small array has depends on the batch (the sampler's
    rows, a step's query tiles). Each value here sits in a loop of `width` lanes whatever the batch."""
    wide = separate(jnp.broadcast_to(x[..., None], x.shape + (width,)))
    return separate(f(wide))[..., 0]


def chunk_pages(page_size: int) -> int:
    return max(1, CHUNK_KEYS // page_size)


def attend(qt, q_pos, q_ok, chunk, num_chunks, *, scale, sliding_window=None, logits_soft_cap=None, q_last=None):
    """Online softmax of query tiles over fixed chunks of keys.

    qt [N, tile, kvh, g, d]; q_pos int32[N, tile] (each query's position); q_ok bool[N, tile].
    chunk(i) -> (k, v [N, kvh, C, d], key int32[C] (positions), key_ok bool[N, C]) for chunk i.
    num_chunks: a Python int (lax.scan: differentiable) or a traced one (a loop that stops there).
    q_last int32[N, tile] or None: the last key each query sees (None: its own position).
    Returns fp32 [N, tile, kvh, g, d]; rows with no visible key give zeros.
    """
    q_last = q_pos if q_last is None else q_last
    n, tile, kvh, g, d = qt.shape
    # Scaled before the dot: its scores then come out of the dot, with no multiply left for the
    # softmax's subtract to contract with (`separate`).
    q32 = separate(qt.astype(jnp.float32) * scale)

    def dot(a, b, contract):  # [N, kvh, rows, x] . [N, kvh, y, z] as one batched dot of a fixed shape
        out = lax.dot_general(a.reshape((n * kvh,) + a.shape[2:]), b.reshape((n * kvh,) + b.shape[2:]),
                              (((2,), (contract,)), ((0,), (0,))), precision=lax.Precision.HIGHEST)
        return out.reshape((n, kvh, g, tile, out.shape[-1]))

    q_rows = q32.transpose(0, 2, 3, 1, 4).reshape(n, kvh, g * tile, d)

    def step(carry, i):
        m, l, acc = carry
        k, v, key, key_ok = chunk(i)
        scores = dot(q_rows, k.astype(jnp.float32), 2)  # [N, kvh, g, tile, C]
        if logits_soft_cap is not None:  # c * tanh(s / c): a product the subtract below would contract
            scores = separate(soft_cap(scores, logits_soft_cap))
        visible = key_ok[:, None, None, None, :] & q_ok[:, None, None, :, None] & (
            key[None, None, None, None, :] <= q_last[:, None, None, :, None])
        if sliding_window is not None:
            visible &= key[None, None, None, None, :] > q_pos[:, None, None, :, None] - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = separate(jnp.where(visible, jnp.exp(scores - m_safe[..., None]), 0.0))  # exp ends in a multiply
        rescale = full_width(jnp.exp, jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)  # [N, kvh, g, tile]: small
        v32 = jnp.where(key_ok[:, None, :, None], v.astype(jnp.float32), 0.0)  # garbage slots: no NaN * 0
        pv = dot(p.reshape(n, kvh, g * tile, -1), v32, 1)  # [N, kvh, g, tile, d]
        l_kept, acc_kept = separate(l * rescale, acc * rescale[..., None])
        return (m_new, l_kept + tree_sum(p), acc_kept + pv), None

    shape = (n, kvh, g, tile)
    carry = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (d,), jnp.float32))
    if isinstance(num_chunks, int):
        (_, l, acc), _ = lax.scan(step, carry, jnp.arange(num_chunks))
    else:
        _, l, acc = lax.fori_loop(0, num_chunks, lambda i, c: step(c, i)[0], carry)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.transpose(0, 3, 1, 2, 4)


def _tiles(q, k_pages, v_pages, tables, context_lens, tiles, tile, num_chunks, **opts):
    """`attend` over the query tiles (seq, tok0, pos0, rows) of `tile` rows: [NT, tile, H, d] fp32."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, num_pages, page_size = k_pages.shape[:3]
    kv_dtype, key_limits = opts.pop("kv_dtype"), opts.pop("key_limits")
    seq, tok0, pos0, rows = tiles
    qt = tiling.gather_query_tiles(q, tok0, rows, tile).reshape(-1, tile, num_kv_heads, num_heads // num_kv_heads,
                                                                  head_dim)
    cp = chunk_pages(page_size)
    tables = tables[seq]
    tile_context = jnp.where(rows > 0, context_lens[seq], 0)
    row = jnp.arange(tile, dtype=jnp.int32)
    q_pos = pos0[:, None] + row[None, :]
    q_ok = row[None, :] < rows[:, None]

    def chunk(i):
        ids = lax.dynamic_slice_in_dim(tables, i * cp, cp, axis=1)
        k = as_dtype(_gather_pages(k_pages, ids), kv_dtype).astype(q.dtype).transpose(1, 0, 2, 3)
        v = as_dtype(_gather_pages(v_pages, ids), kv_dtype).astype(q.dtype).transpose(1, 0, 2, 3)
        key = i * cp * page_size + jnp.arange(cp * page_size, dtype=jnp.int32)
        return k, v, key, key[None, :] < tile_context[:, None]

    keys_per_chunk = cp * page_size
    if num_chunks is None:  # up to the longest context among these tiles (none: no chunk at all)
        num_chunks = (jnp.max(tile_context) + keys_per_chunk - 1) // keys_per_chunk
    q_last = None if key_limits is None else tiling.tile_last_keys(key_limits, tok0, pos0, rows, tile)
    out = attend(qt, q_pos, q_ok, chunk, num_chunks, q_last=q_last, **opts)
    return out.reshape(-1, tile, num_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "logits_soft_cap", "kv_dtype", "num_chunks", "tiles"))
def ragged_paged_attention_invariant(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale=None,
                                     sliding_window=None, logits_soft_cap=None, kv_dtype=None, num_chunks=None,
                                     tiles=(QUERY_TILE, QUERY_TILE), key_limits=None):
    """ragged_paged_attention (decode rows included) with batch-invariant bits: q [T, H, d] -> [T, H, d].
    `num_chunks` (static): visit that many chunks of CHUNK_KEYS keys (differentiable); None: up to
    the longest context. `tiles` (decode, prefill): rows per tile for one-token sequences and for
    the others; other than QUERY_TILE only where `invariant_tiles` measured the same bits.
    `key_limits`: as pallas_kernels.ragged_paged_attention's."""
    num_tokens, _, head_dim = q.shape
    num_pages = k_pages.shape[1]
    cp = chunk_pages(k_pages.shape[2])
    tables = tiling.clamp_block_tables(block_tables, num_pages)
    tables = jnp.pad(tables, ((0, 0), (0, (-tables.shape[1]) % cp)))
    opts = dict(scale=default_scale(scale, head_dim), sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                kv_dtype=kv_dtype, key_limits=key_limits)
    decode_tile, tile = tiles
    if tiles == (QUERY_TILE, QUERY_TILE) or isinstance(num_chunks, int):  # LLM.policy(): whole sequences
        tile = QUERY_TILE
        plan = tiling.ragged_tiles(query_start_loc, context_lens, num_tokens, tile)
        out = _tiles(q, k_pages, v_pages, tables, context_lens, plan, tile, num_chunks, **opts)
        return tiling.scatter_tiles_to_tokens(out, query_start_loc, num_tokens, tile).astype(q.dtype)
    # Two passes, each visiting only the key chunks its own tiles need: the one-token sequences
    # (decode rows) in one tile each of `decode_tile` rows, the others in tiles of `tile` rows.
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = jnp.maximum(qsl[1:] - qsl[:-1], 0)
    single = q_lens == 1
    many = jnp.where(single, 0, q_lens)
    plan = tiling.ragged_tiles(qsl, context_lens, num_tokens, tile, q_lens=many)
    out = _tiles(q, k_pages, v_pages, tables, context_lens, plan, tile, num_chunks, **opts)
    out = tiling.scatter_tiles_to_tokens(out, qsl, num_tokens, tile, q_lens=many)
    num_seqs = q_lens.shape[0]
    plan = (jnp.arange(num_seqs, dtype=jnp.int32), qsl[:-1], context_lens.astype(jnp.int32) - 1, single.astype(jnp.int32))
    out1 = _tiles(q, k_pages, v_pages, tables, context_lens, plan, decode_tile, num_chunks, **opts)[:, 0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, num_seqs - 1)
    from_one = single[seq] & (t >= qsl[0]) & (t < qsl[num_seqs])
    return jnp.where(from_one[:, None, None], out1[seq], out).astype(q.dtype)


PREFILL_TILES = (16, 8)  # larger prefill tiles tried first: fewer copies of each key chunk


@functools.cache
def invariant_tiles(group: int, head_dim: int) -> tuple[int, int]:
    """(decode, prefill) rows per query tile for this backend: the fewest rows (at least 2 dot rows)
    for a one-token sequence and the most (of PREFILL_TILES) for the others whose q.k and p.v dots
    give the bits of QUERY_TILE-row tiles, row for row; QUERY_TILE where none does. XLA's CPU dot
    (jax 0.10.2) sums such an element one way for every row count from 2 up, measured to 128, and
    another way for 1 row, so a group of 1 takes 2 rows. Another backend or version may differ:
    measured at load, on random operands, never assumed."""
    rng = np.random.default_rng(0)
    rows, batch = max(PREFILL_TILES) * group, 5
    q, k, v = (rng.standard_normal((batch, n, head_dim), np.float32) for n in (rows, CHUNK_KEYS, CHUNK_KEYS))
    p = rng.uniform(size=(batch, rows, CHUNK_KEYS)).astype(np.float32)
    operands = ((q, k, 2), (p, v, 1))
    step = QUERY_TILE * group  # the reference: every row in a QUERY_TILE-row tile
    ref = [np.concatenate([np.asarray(_probe_dot(a[:, i:i + step], b, c)) for i in range(0, rows, step)], axis=1)
           for a, b, c in operands]

    def same(tile):
        n = tile * group
        return all(np.array_equal(np.asarray(_probe_dot(a[:, :n], b, c)), r[:, :n]) for (a, b, c), r in zip(operands, ref))

    decode = -(-2 // group)
    decode = decode if decode < QUERY_TILE and same(decode) else QUERY_TILE
    prefill = next((t for t in PREFILL_TILES if same(t)), QUERY_TILE)
    return decode, prefill


@functools.partial(jax.jit, static_argnums=2)
def _probe_dot(a, b, contract):
    return lax.dot_general(a, b, (((2,), (contract,)), ((0,), (0,))), precision=lax.Precision.HIGHEST)
