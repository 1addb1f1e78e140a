"""Batch-invariant attention (the engine's `batch_invariant` mode): each query row's output has the
same bits whatever else is in the call -- other sequences, the padded shapes, the query tile it
lands in, whether its keys were written by this step or an earlier one (chunked prefill, prefix
hits), and whether it is a decode or a prefill row.

Why the XLA twins are not: they pick the key chunk and the query tile from the batch
(`xla.chunk_pages`, `xla_query_tile`), and XLA's CPU dot sums an output element in an order it
chooses from the operand shapes (measured: a decode row differs by 6e-8 with and without
neighbours at a fixed chunk). Here every query tile has QUERY_TILE rows (decode rows too) and
keys are visited in chunks of CHUNK_KEYS keys from key 0, so every q.k and p.v product is a
batched dot of one shape, [QUERY_TILE * group, head_dim] x [head_dim, CHUNK_KEYS] (measured:
such a dot's elements do not change with the batch count or the row's place in the tile); other
sums are `tree_sum`, elementwise adds in a fixed pairwise order. A chunk that a row sees none
of changes its running (max, sum, acc) by exact identities (x * 1 + 0), so the number of chunks
visited (the longest context in the call) does not change a row's bits either.

`attend` is shared with `LLM.policy()` (dense K/V, a static number of chunks: differentiable),
so a trainer's forward has the engine's bits.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiling
from pallas_kernels.cache_ops import as_dtype
from pallas_kernels.xla import _gather_pages, default_scale, soft_cap

CHUNK_KEYS = 64  # keys per online-softmax step: fixed, never chosen from the batch
# Query rows per tile, decode rows included: fixed, never chosen from the batch. Small, since a
# decode row pays for the tile's empty rows; of 1, 2, 4, 8 and 16 rows, 4 gave the most tokens/s
# (bench_throughput, tiny, 64 requests; docs/PERF.md).
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


def chunk_pages(page_size: int) -> int:
    return max(1, CHUNK_KEYS // page_size)


def attend(qt, q_pos, q_ok, chunk, num_chunks, *, scale, sliding_window=None, logits_soft_cap=None):
    """Online softmax of query tiles over fixed chunks of keys.

    qt [N, tile, kvh, g, d]; q_pos int32[N, tile] (each query's position); q_ok bool[N, tile].
    chunk(i) -> (k, v [N, kvh, C, d], key int32[C] (positions), key_ok bool[N, C]) for chunk i.
    num_chunks: a Python int (lax.scan: differentiable) or a traced one (a loop that stops there).
    Returns fp32 [N, tile, kvh, g, d]; rows with no visible key give zeros.
    """
    n, tile, kvh, g, d = qt.shape
    q32 = qt.astype(jnp.float32)

    def dot(a, b, contract):  # [N, kvh, rows, x] . [N, kvh, y, z] as one batched dot of a fixed shape
        out = lax.dot_general(a.reshape((n * kvh,) + a.shape[2:]), b.reshape((n * kvh,) + b.shape[2:]),
                              (((2,), (contract,)), ((0,), (0,))), precision=lax.Precision.HIGHEST)
        return out.reshape((n, kvh, g, tile, out.shape[-1]))

    q_rows = q32.transpose(0, 2, 3, 1, 4).reshape(n, kvh, g * tile, d)

    def step(carry, i):
        m, l, acc = carry
        k, v, key, key_ok = chunk(i)
        scores = dot(q_rows, k.astype(jnp.float32), 2)  # [N, kvh, g, tile, C]
        scores = soft_cap(scores * scale, logits_soft_cap)
        visible = key_ok[:, None, None, None, :] & q_ok[:, None, None, :, None] & (
            key[None, None, None, None, :] <= q_pos[:, None, None, :, None])
        if sliding_window is not None:
            visible &= key[None, None, None, None, :] > q_pos[:, None, None, :, None] - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(visible, jnp.exp(scores - m_safe[..., None]), 0.0)
        rescale = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        v32 = jnp.where(key_ok[:, None, :, None], v.astype(jnp.float32), 0.0)  # garbage slots: no NaN * 0
        pv = dot(p.reshape(n, kvh, g * tile, -1), v32, 1)  # [N, kvh, g, tile, d]
        return (m_new, l * rescale + tree_sum(p), acc * rescale[..., None] + pv), None

    shape = (n, kvh, g, tile)
    carry = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (d,), jnp.float32))
    if isinstance(num_chunks, int):
        (_, l, acc), _ = lax.scan(step, carry, jnp.arange(num_chunks))
    else:
        _, l, acc = lax.fori_loop(0, num_chunks, lambda i, c: step(c, i)[0], carry)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.transpose(0, 3, 1, 2, 4)


@functools.partial(jax.jit, static_argnames=("scale", "logits_soft_cap", "kv_dtype", "num_chunks"))
def ragged_paged_attention_invariant(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale=None,
                                     sliding_window=None, logits_soft_cap=None, kv_dtype=None, num_chunks=None):
    """ragged_paged_attention (decode rows included) with batch-invariant bits: q [T, H, d] -> [T, H, d].
    `num_chunks` (static): visit that many chunks of CHUNK_KEYS keys (differentiable); None: up to
    the longest context."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = k_pages.shape[:3]
    group = num_heads // num_kv_heads
    tile = QUERY_TILE
    seq, tok0, pos0, rows = tiling.ragged_tiles(query_start_loc, context_lens, num_tokens, tile)
    qt = tiling.gather_query_tiles(q, tok0, rows, tile).reshape(-1, tile, num_kv_heads, group, head_dim)
    cp = chunk_pages(page_size)
    tables = tiling.clamp_block_tables(block_tables, num_pages)
    tables = jnp.pad(tables, ((0, 0), (0, (-tables.shape[1]) % cp)))[seq]
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
    if num_chunks is None:
        num_chunks = (jnp.max(tile_context) + keys_per_chunk - 1) // keys_per_chunk
    out = attend(qt, q_pos, q_ok, chunk, num_chunks, scale=default_scale(scale, head_dim),
                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    out = out.reshape(-1, tile, num_heads, head_dim)
    return tiling.scatter_tiles_to_tokens(out, query_start_loc, num_tokens, tile).astype(q.dtype)
