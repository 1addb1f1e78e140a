"""XLA (gather + dense masked softmax) twins of the attention kernels.

These run on every backend and are the CPU engine's hot path, the models'
"xla" attention backend and the tests' second reference. Layouts are those of
the package (see pallas_kernels/__init__.py):

  k_pages, v_pages  [num_kv_heads, num_pages, page_size, head_dim]
  block_tables      int32[num_seqs, max_blocks] (entries past a sequence's
                    length are garbage: clamped, and their keys masked)

Decode attends each sequence to its pages; ragged prefill cuts every sequence's
new tokens into query tiles (see tiling.py) and gathers K/V per tile -- never
K/V per token. Both visit the keys a few pages at a time (chunk_pages) with an online
softmax in a loop that stops after the longest context in the call, so the
cost follows the real contexts and not the block tables' width: callers may
pass tables padded to the maximum width and compile one shape.
Softmax is computed in fp32; rows with no visible key give zeros, not NaN.
fp8 pages are widened to q's dtype as they are gathered (the caller folds the
K scale into q and the V scale into the output). `kv_dtype`: the pages hold that
dtype's raw bits (cache_ops.write_kv), reinterpreted as they are gathered.
`v_transposed`: v_pages in cache_ops' variant layout [kvh, P, head_dim, page_size].

Optional, as the kernels: `sliding_window` w (an int or a traced int32 scalar)
lets a query at position p see only keys in (p - w, p], and the loop starts at
the first chunk any query sees; `logits_soft_cap` c maps scores to
c * tanh(score / c) (Gemma 2). Ragged prefill also takes `key_limits` (int32[tokens]): a
query sees keys up to max(its position, key_limits[token]) (Gemma 3's images), the loop still
ending at the longest context; None keeps the causal code as it was.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiling
from pallas_kernels.cache_ops import as_dtype

_HIGHEST = lax.Precision.HIGHEST  # no TF32 for fp32 inputs on GPU


def default_scale(scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _gather_pages(pages, tables, transposed=False):
    """pages [kvh, P, ps, d] ([kvh, P, d, ps] when `transposed`: cache_ops' V variant), tables
    int32[N, W] (in range) -> [kvh, N, W*ps, d]."""
    n, w = tables.shape
    if transposed:
        kvh, _, d, ps = pages.shape
        return jnp.swapaxes(pages[:, tables], -1, -2).reshape(kvh, n, w * ps, d)
    kvh, _, ps, d = pages.shape
    return pages[:, tables].reshape(kvh, n, w * ps, d)


# Keys are visited in chunks of pages; a loop with a run-time trip count stops after the longest
# context, so the cost follows the contexts, not the block tables' padded width. A chunk gathers
# about CHUNK_BYTES of keys over all rows (2 to 8 pages): measured on the 2-core CPU, a 256-sequence
# decode step of a small model (4 kv heads of 32) took 2.3 ms with 2 pages, 5.4 with 8, while 8
# sequences of 8k context with 8 kv heads of 64 took 36 ms with 8 pages, 59 with 2.
CHUNK_BYTES = 4 << 20
MIN_CHUNK_PAGES, MAX_CHUNK_PAGES = 2, 8


def chunk_pages(num_rows: int, pages) -> int:
    """Pages per chunk for `num_rows` rows each gathering from `pages` [kvh, P, page_size, d]."""
    kvh, _, page_size, head_dim = pages.shape
    page_bytes = num_rows * kvh * page_size * head_dim * pages.dtype.itemsize
    fit = max(1, CHUNK_BYTES // page_bytes)
    return min(MAX_CHUNK_PAGES, max(MIN_CHUNK_PAGES, 1 << (fit.bit_length() - 1)))


def soft_cap(scores, cap):
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def _attend_in_chunks(tables, pages, chunk_scores, av_equation, out_shape, max_context, first_key=0):
    """Online-softmax attention over the table's pages (of `pages`), chunk_pages() at a time,
    from the chunk holding `first_key` (the first key any query sees) up to `max_context`.

    chunk_scores(table_chunk [N, C], first_key) -> (fp32 scores [..., keys], mask, v) for that
    chunk's keys; `av_equation` contracts probabilities with v into `out_shape`. Empty rows -> 0.
    """
    page_size = pages.shape[2]
    chunk = min(chunk_pages(tables.shape[0], pages), tables.shape[1])
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
    _, l, acc = lax.fori_loop(first_key // (chunk * page_size), num_chunks, step, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _first_key(starts, contexts):
    """The first key any non-empty row sees (0 when every row is empty)."""
    live = contexts > 0
    return jnp.where(jnp.any(live), jnp.min(jnp.where(live, starts, jnp.iinfo(jnp.int32).max)), 0)


@functools.partial(jax.jit, static_argnames=("scale", "logits_soft_cap", "kv_dtype", "v_transposed"))
def paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, *, scale=None, sliding_window=None,
                        logits_soft_cap=None, kv_dtype=None, v_transposed=False):
    """Decode attention: q [S, H, d] -> [S, H, d]; see paged_attention."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = k_pages.shape[:3]
    group = num_heads // num_kv_heads
    tables = tiling.clamp_block_tables(block_tables, num_pages)
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    scale = default_scale(scale, head_dim)

    def chunk_scores(chunk_tables, first_key):
        k = as_dtype(_gather_pages(k_pages, chunk_tables), kv_dtype).astype(q.dtype)  # [kvh, S, keys, d]; fp8 pages widened
        v = as_dtype(_gather_pages(v_pages, chunk_tables, v_transposed), kv_dtype).astype(q.dtype)
        key = first_key + jnp.arange(k.shape[2])[None, :]
        key_ok = (key < context_lens[:, None]) & (key >= window_start[:, None])  # [S, keys]
        # Masking V too keeps non-finite garbage in unused (or freed) slots out of 0 * x.
        v = jnp.where(key_ok[None, :, :, None], v, jnp.zeros((), v.dtype))
        scores = jnp.einsum("skgd,ksld->skgl", qg, k, preferred_element_type=jnp.float32, precision=_HIGHEST)
        return soft_cap(scores * scale, logits_soft_cap), key_ok[:, None, None, :], v

    # The one query of sequence s sits at context_lens[s] - 1 and sees keys >= window_start[s].
    window_start = jnp.zeros_like(context_lens) if sliding_window is None else jnp.maximum(
        context_lens - sliding_window, 0)
    out = _attend_in_chunks(tables, k_pages, chunk_scores, "skgl,ksld->skgd", (num_seqs, num_kv_heads, group, head_dim),
                            jnp.max(context_lens), _first_key(window_start, context_lens))
    return out.reshape(q.shape).astype(q.dtype)


def xla_query_tile(num_tokens: int, num_seqs: int) -> int:
    """Tile ~ average new tokens per sequence: bounds both the padding waste
    (S * tile rows) and the number of K/V gathers (T / tile + S)."""
    avg = tiling.cdiv(num_tokens, max(1, min(num_seqs, num_tokens)))
    return min(128, tiling.next_pow2(avg))


@functools.partial(jax.jit, static_argnames=("scale", "logits_soft_cap", "kv_dtype", "v_transposed"))
def ragged_paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale=None,
                               sliding_window=None, logits_soft_cap=None, kv_dtype=None, key_limits=None,
                               v_transposed=False):
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
    q_last = None if key_limits is None else tiling.tile_last_keys(key_limits, tok0, pos0, rows, tile)[:, :, None]

    def chunk_scores(chunk_tables, first_key):
        k = as_dtype(_gather_pages(k_pages, chunk_tables), kv_dtype).astype(q.dtype)  # [kvh, NT, keys, d]; fp8 pages widened
        v = as_dtype(_gather_pages(v_pages, chunk_tables, v_transposed), kv_dtype).astype(q.dtype)
        key = first_key + jnp.arange(k.shape[2], dtype=jnp.int32)
        key_ok = (key[None, :] < tile_context[:, None]) & (key[None, :] >= tile_start[:, None])  # [NT, keys]
        v = jnp.where(key_ok[None, :, :, None], v, jnp.zeros((), v.dtype))
        q_pos = (pos0[:, None] + row[None, :])[:, :, None]
        causal = key[None, None, :] <= (q_pos if q_last is None else q_last)
        if sliding_window is not None:
            causal &= key[None, None, :] > q_pos - sliding_window
        mask = causal & key_ok[:, None, :] & (row[None, :] < rows[:, None])[:, :, None]
        scores = jnp.einsum("ntkgd,knld->nkgtl", qt, k, preferred_element_type=jnp.float32, precision=_HIGHEST)
        return soft_cap(scores * scale, logits_soft_cap), mask[:, None, None], v

    # The first key the tile's first query sees (every later query sees less far back).
    tile_start = jnp.zeros_like(pos0) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    out = _attend_in_chunks(tables, k_pages, chunk_scores, "nkgtl,knld->nkgtd", (nt, num_kv_heads, group, tile, head_dim),
                            jnp.max(tile_context), _first_key(tile_start, tile_context))
    out = out.transpose(0, 3, 1, 2, 4).reshape(nt, tile, num_heads, head_dim)
    out = tiling.scatter_tiles_to_tokens(out, query_start_loc, num_tokens, tile)
    return out.astype(q.dtype)
