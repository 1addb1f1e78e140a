"""Sliding-window attention and logit soft-capping in pallas_kernels (XLA twins and Pallas
kernels in interpret mode) against a float64 numpy reference.

Pages that fell out of every query's window are treated as freed: their slots hold NaN and
their block-table entries garbage, so any read of them shows up as NaN in the output."""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.prefill import ragged_paged_attention_pallas
from test_kernels import DTYPES, INTERPRET, check_close, make_cache, random_q, rng


def attend(q, k, v, scale, cap=None):
    """q [H, d] over k, v [kvh, n, d] in float64, with optional soft-capping."""
    group = q.shape[0] // k.shape[0]
    out = np.zeros_like(q)
    for h in range(q.shape[0]):
        if k.shape[1] == 0:
            continue
        s = k[h // group] @ q[h] * scale
        if cap is not None:
            s = cap * np.tanh(s / cap)
        p = np.exp(s - s.max())
        out[h] = p @ v[h // group] / p.sum()
    return out


def free_out_of_window(k, v, k64, v64, tables, first_visible, page):
    """Garbage (NaN slots, bogus table entries) before each sequence's first visible key."""
    k, v, tables = np.array(k, np.float32), np.array(v, np.float32), np.array(tables)
    k64, v64 = k64.copy(), v64.copy()
    for s, first in enumerate(first_visible):
        for pos in range(first):
            p, o = tables[s, pos // page], pos % page
            for arr in (k, v, k64, v64):
                arr[:, p, o] = np.nan
        tables[s, : first // page] = rng.integers(-5, 10**6, size=first // page)
    return jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), k64, v64


def keys(pages64, table, lo, hi):
    ps = pages64.shape[2]
    pos = np.arange(lo, hi)
    return pages64[:, table[pos // ps], pos % ps]


# (page, heads, kv_heads, head_dim, window, soft cap)
CASES = [(8, 4, 2, 32, 5, None), (16, 4, 4, 64, 16, 5.0), (8, 8, 1, 16, 37, None), (8, 4, 2, 32, None, 2.0),
         (32, 6, 2, 32, 1, None)]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_window(impl, case):
    page, heads, kv_heads, head_dim, window, cap = case
    lens = [1, page - 1, page + 1, 0, 9 * page + 3, 3 * page]
    k, v, tables, k64, v64 = make_cache(lens, kv_heads, page, head_dim, jnp.float32)
    first = [max(0, n - window) if window else 0 for n in lens]
    # The keys read mid-page stay; whole pages before the window are freed.
    k, v, tables_j, k64, v64 = free_out_of_window(k, v, k64, v64, tables, first, page)
    q, q64 = random_q((len(lens), heads, head_dim), jnp.float32)
    scale = 0.5 / np.sqrt(head_dim)
    ctx = jnp.asarray(lens, jnp.int32)
    if impl == "xla":
        out = pk.paged_attention_xla(q, k, v, tables_j, ctx, scale=scale, sliding_window=window, logits_soft_cap=cap)
    else:
        out = pk.paged_attention(q, k, v, tables_j, ctx, scale=scale, interpret=INTERPRET, num_splits=2,
                                 sliding_window=window, logits_soft_cap=cap)
    t = np.asarray(tables_j)
    ref = np.stack([attend(q64[s], keys(k64, t[s], first[s], n), keys(v64, t[s], first[s], n), scale, cap)
                    for s, n in enumerate(lens)])
    check_close(out, ref, "f32", f"{impl} {case} lens={lens}")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_window(impl, case):
    page, heads, kv_heads, head_dim, window, cap = case
    seqs = [(5, 5), (3 * page + 5, 2 * page + 3), (6 * page, page), (page + 1, 1), (0, 0), (4 * page, 3)]
    seqs = [seqs[i] for i in rng.permutation(len(seqs))]
    ctx, qlens = [c for c, _ in seqs], [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + 3
    k, v, tables, k64, v64 = make_cache(ctx, kv_heads, page, head_dim, DTYPES["f32"])
    first = [max(0, c - n - window + 1) if window else 0 for c, n in seqs]
    k, v, tables_j, k64, v64 = free_out_of_window(k, v, k64, v64, tables, first, page)
    q, q64 = random_q((num_tokens, heads, head_dim), jnp.float32)
    scale = 1 / np.sqrt(head_dim)
    args = (q, k, v, tables_j, jnp.asarray(ctx, jnp.int32), jnp.asarray(qsl))
    if impl == "xla":
        out = pk.ragged_paged_attention_xla(*args, scale=scale, sliding_window=window, logits_soft_cap=cap)
    else:
        out = ragged_paged_attention_pallas(*args, scale=scale, interpret=INTERPRET, q_tile=4, sliding_window=window,
                                            logits_soft_cap=cap)
    t = np.asarray(tables_j)
    ref = np.zeros_like(q64)
    for s, (c, n) in enumerate(seqs):
        for j in range(n):
            pos = c - n + j
            lo = max(0, pos - window + 1) if window else 0
            ref[qsl[s] + j] = attend(q64[qsl[s] + j], keys(k64, t[s], lo, pos + 1), keys(v64, t[s], lo, pos + 1),
                                     scale, cap)
    check_close(out, ref, "f32", f"{impl} {case} seqs={seqs}")


def test_traced_window_matches_static():
    """A window given as a traced scalar (per scanned layer) equals the same window as an int."""
    import jax

    lens = [30, 7]
    k, v, tables, _, _ = make_cache(lens, 2, 8, 32, jnp.float32)
    q, _ = random_q((2, 4, 32), jnp.float32)
    ctx = jnp.asarray(lens, jnp.int32)
    traced = jax.jit(lambda w: pk.paged_attention_xla(q, k, v, tables, ctx, sliding_window=w))(jnp.int32(6))
    np.testing.assert_allclose(traced, pk.paged_attention_xla(q, k, v, tables, ctx, sliding_window=6), atol=1e-5)
