"""XLA (gather + dense masked softmax) twins of the attention kernels.

These run on every backend and are the CPU engine's hot path, the models'
"xla" attention backend and the tests' second reference. Layouts are those of
the package (see pallas_kernels/__init__.py):

  k_pages, v_pages  [num_kv_heads, num_pages, page_size, head_dim]
  block_tables      int32[num_seqs, max_blocks] (entries past a sequence's
                    length are garbage: clamped, and their keys masked)

Decode attends each sequence to its pages; ragged prefill cuts every sequence's
new tokens into query tiles (see tiling.py) and gathers K/V per tile -- never
K/V per token. Both visit the keys CHUNK_PAGES pages at a time with an online
softmax in a loop that stops after the longest context in the call, so the
cost follows the real contexts and not the block tables' width: callers may
pass tables padded to the maximum width and compile one shape.
Softmax is computed in fp32; rows with no visible key give zeros, not NaN.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiling

_HIGHEST = lax.Precision.HIGHEST  # no TF32 for fp32 inputs on GPU


def default_scale(scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _gather_pages(pages, tables):
    """pages [kvh, P, ps, d], tables int32[N, W] (in range) -> [kvh, N, W*ps, d]."""
    kvh, _, ps, d = pages.shape
    n, w = tables.shape
    return pages[:, tables].reshape(kvh, n, w * ps, d)


# Keys are visited in chunks of this many pages; a loop with a run-time trip count stops after the
# longest context, so the cost follows the contexts, not the block tables' padded width.
CHUNK_PAGES = 8


def _attend_in_chunks(tables, max_context, page_size, chunk_scores, av_equation, out_shape):
    """Online-softmax attention over the table's pages, CHUNK_PAGES at a time, up to `max_context`.

    chunk_scores(table_chunk [N, C], first_key) -> (fp32 scores [..., keys], mask, v) for that
    chunk's keys; `av_equation` contracts probabilities with v into `out_shape`. Empty rows -> 0.
    """
    chunk = min(CHUNK_PAGES, tables.shape[1])
    tables = jnp.pad(tables, ((0, 0), (0, (-tables.shape[1]) % chunk)))
    num_chunks = (max_context + chunk * page_size - 1) // (chunk * page_size)

    def step(i, carry):
        m, l, acc = carry
        scores, mask, v = chunk_scores(lax.dynamic_slice_in_dim(tables, i * chunk, chunk, axis=1),
                                       i * chunk * page_size)
        scores = jnp.where(mask, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[..., None])
        rescale = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        pv = jnp.einsum(av_equation, p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=_HIGHEST)
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

    init = (jnp.full(out_shape[:-1], -jnp.inf, jnp.float32), jnp.zeros(out_shape[:-1], jnp.float32),
            jnp.zeros(out_shape, jnp.float32))
    _, l, acc = lax.fori_loop(0, num_chunks, step, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, *, scale=None):
    """Decode attention: q [S, H, d] -> [S, H, d]; see paged_attention."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = k_pages.shape[:3]
    group = num_heads // num_kv_heads
    tables = tiling.clamp_block_tables(block_tables, num_pages)
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    scale = default_scale(scale, head_dim)

    def chunk_scores(chunk_tables, first_key):
        k = _gather_pages(k_pages, chunk_tables)  # [kvh, S, keys, d]
        v = _gather_pages(v_pages, chunk_tables)
        key_ok = first_key + jnp.arange(k.shape[2])[None, :] < context_lens[:, None]  # [S, keys]
        # Masking V too keeps non-finite garbage in unused slots out of 0 * x.
        v = jnp.where(key_ok[None, :, :, None], v, jnp.zeros((), v.dtype))
        scores = jnp.einsum("skgd,ksld->skgl", qg, k, preferred_element_type=jnp.float32, precision=_HIGHEST)
        return scores * scale, key_ok[:, None, None, :], v

    out = _attend_in_chunks(tables, jnp.max(context_lens), page_size, chunk_scores, "skgl,ksld->skgd",
                            (num_seqs, num_kv_heads, group, head_dim))
    return out.reshape(q.shape).astype(q.dtype)


def xla_query_tile(num_tokens: int, num_seqs: int) -> int:
    """Tile ~ average new tokens per sequence: bounds both the padding waste
    (S * tile rows) and the number of K/V gathers (T / tile + S)."""
    avg = tiling.cdiv(num_tokens, max(1, min(num_seqs, num_tokens)))
    return min(128, tiling.next_pow2(avg))


@functools.partial(jax.jit, static_argnames=("scale",))
def ragged_paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale=None):
    """Ragged prefill: q [T, H, d] -> [T, H, d]; see ragged_paged_attention."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = k_pages.shape[:3]
    group = num_heads // num_kv_heads
    tile = xla_query_tile(num_tokens, block_tables.shape[0])
    seq, tok0, pos0, rows = tiling.ragged_tiles(query_start_loc, context_lens, num_tokens, tile)
    nt = seq.shape[0]
    qt = tiling.gather_query_tiles(q, tok0, rows, tile)
    qt = qt.reshape(nt, tile, num_kv_heads, group, head_dim)
    tables = tiling.clamp_block_tables(block_tables, num_pages)[seq]
    tile_context = jnp.where(rows > 0, context_lens[seq], 0)  # [NT]
    row = jnp.arange(tile, dtype=jnp.int32)
    scale = default_scale(scale, head_dim)

    def chunk_scores(chunk_tables, first_key):
        k = _gather_pages(k_pages, chunk_tables)  # [kvh, NT, keys, d]
        v = _gather_pages(v_pages, chunk_tables)
        key = first_key + jnp.arange(k.shape[2], dtype=jnp.int32)
        key_ok = key[None, :] < tile_context[:, None]  # [NT, keys]
        v = jnp.where(key_ok[None, :, :, None], v, jnp.zeros((), v.dtype))
        causal = key[None, None, :] <= (pos0[:, None] + row[None, :])[:, :, None]
        mask = causal & key_ok[:, None, :] & (row[None, :] < rows[:, None])[:, :, None]
        scores = jnp.einsum("ntkgd,knld->nkgtl", qt, k, preferred_element_type=jnp.float32, precision=_HIGHEST)
        return scores * scale, mask[:, None, None], v

    out = _attend_in_chunks(tables, jnp.max(tile_context), page_size, chunk_scores, "nkgtl,knld->nkgtd",
                            (nt, num_kv_heads, group, tile, head_dim))
    out = out.transpose(0, 3, 1, 2, 4).reshape(nt, tile, num_heads, head_dim)
    out = tiling.scatter_tiles_to_tokens(out, query_start_loc, num_tokens, tile)
    return out.astype(q.dtype)
