"""XLA (gather + dense masked softmax) twins of the attention kernels.

These run on every backend and are the CPU engine's hot path, the models'
"xla" attention backend and the tests' second reference. Layouts are those of
the package (see pallas_kernels/__init__.py):

  k_pages, v_pages  [num_kv_heads, num_pages, page_size, head_dim]
  block_tables      int32[num_seqs, max_blocks] (entries past a sequence's
                    length are garbage: clamped, and their keys masked)

Decode gathers each sequence's pages once ([kvh, S, max_blocks*page, d]).
Ragged prefill cuts every sequence's new tokens into query tiles (see
tiling.py) and gathers K/V per tile, so memory is O(num_tiles * L * d) for K/V
and O((T + S*tile) * heads * L) for the scores -- never K/V per token.
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


def _masked_softmax_av(scores, mask, v, equation):
    """softmax(scores masked) @ v with fp32 statistics; empty rows -> 0."""
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum(equation, p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=_HIGHEST)
    return out / jnp.where(denom > 0, denom, 1.0)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_xla(q, k_pages, v_pages, block_tables, context_lens, *, scale=None):
    """Decode attention: q [S, H, d] -> [S, H, d]; see paged_attention."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_pages = k_pages.shape[:2]
    group = num_heads // num_kv_heads
    tables = tiling.clamp_block_tables(block_tables, num_pages)
    k = _gather_pages(k_pages, tables)
    v = _gather_pages(v_pages, tables)
    key_ok = jnp.arange(k.shape[2])[None, :] < context_lens[:, None]  # [S, L]
    # Masking V too keeps non-finite garbage in unused slots out of 0 * x.
    v = jnp.where(key_ok[None, :, :, None], v, jnp.zeros((), v.dtype))
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = jnp.einsum("skgd,ksld->skgl", qg, k, preferred_element_type=jnp.float32, precision=_HIGHEST)
    scores = scores * default_scale(scale, head_dim)
    out = _masked_softmax_av(scores, key_ok[:, None, None, :], v, "skgl,ksld->skgd")
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
    num_kv_heads, num_pages = k_pages.shape[:2]
    group = num_heads // num_kv_heads
    tile = xla_query_tile(num_tokens, block_tables.shape[0])
    seq, tok0, pos0, rows = tiling.ragged_tiles(query_start_loc, context_lens, num_tokens, tile)
    nt = seq.shape[0]
    qt = tiling.gather_query_tiles(q, tok0, rows, tile)
    qt = qt.reshape(nt, tile, num_kv_heads, group, head_dim)
    tables = tiling.clamp_block_tables(block_tables, num_pages)[seq]
    k = _gather_pages(k_pages, tables)  # [kvh, NT, L, d]
    v = _gather_pages(v_pages, tables)
    key = jnp.arange(k.shape[2], dtype=jnp.int32)
    row = jnp.arange(tile, dtype=jnp.int32)
    key_ok = key[None, :] < context_lens[seq][:, None]  # [NT, L]
    v = jnp.where(key_ok[None, :, :, None], v, jnp.zeros((), v.dtype))
    causal = key[None, None, :] <= (pos0[:, None] + row[None, :])[:, :, None]
    mask = causal & key_ok[:, None, :] & (row[None, :] < rows[:, None])[:, :, None]
    scores = jnp.einsum("ntkgd,knld->nkgtl", qt, k, preferred_element_type=jnp.float32, precision=_HIGHEST)
    scores = scores * default_scale(scale, head_dim)
    out = _masked_softmax_av(scores, mask[:, None, None], v, "nkgtl,knld->nkgtd")
    out = out.transpose(0, 3, 1, 2, 4).reshape(nt, tile, num_heads, head_dim)
    out = tiling.scatter_tiles_to_tokens(out, query_start_loc, num_tokens, tile)
    return out.astype(q.dtype)
