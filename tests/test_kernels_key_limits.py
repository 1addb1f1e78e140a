"""Per-query key limits in ragged prefill (`key_limits`: query t sees keys up to
max(position, key_limits[t]); Gemma 3's image tokens attend to each other both ways) against a
float64 numpy reference: the XLA twin, the Pallas Triton kernel (interpret mode on a CPU) and the
batch-invariant attention, with and without a sliding window.

Spans (images) sit anywhere in a chunk: at its start, its end, across query tiles and pages, and
starting before the chunk (a prefix-cache hit that stopped inside an image). Every slot no
sequence owns holds NaN and unused block-table entries garbage (test_kernels.make_cache): a key
read past a limit's context shows up as NaN. The reference differs from the causal one by far more
than the tolerance in every case (checked), so a kernel that ignores the limits fails."""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.invariant import ragged_paged_attention_invariant
from pallas_kernels.prefill import ragged_paged_attention_pallas
from test_kernels import DTYPES, INTERPRET, check_close, make_cache, random_q

SEED = int(np.random.default_rng().integers(2**31))


def attend(q, k, v, scale):
    """q [H, d] over k, v [kvh, n, d] (GQA) in float64."""
    group = q.shape[0] // k.shape[0]
    out = np.zeros_like(q)
    for h in range(q.shape[0]):
        if k.shape[1]:
            s = k[h // group] @ q[h] * scale
            p = np.exp(s - s.max())
            out[h] = p @ v[h // group] / p.sum()
    return out


def keys(pages64, table, lo, hi):
    ps = pages64.shape[2]
    pos = np.arange(lo, hi)
    return pages64[:, table[pos // ps], pos % ps]


def spans_and_limits(rng, seqs, qsl, num_tokens):
    """Random spans [first, last] per sequence, each reaching into its chunk and ending in it
    (the scheduler keeps an image's end in the chunk that computes any of it); the limits array:
    the span's last position for its tokens in the chunk, a random value <= its own position
    (causal) for the others and for padding."""
    limits = np.full(num_tokens, -1, np.int64)
    spans = []
    for s, (c, n) in enumerate(seqs):
        first_new = c - n
        for j in range(n):  # causal tokens: anything up to their own position means "their own"
            limits[qsl[s] + j] = rng.integers(-3, first_new + j + 1)
        at = first_new - int(rng.integers(0, 4)) if n else c  # may start before the chunk (a prefix hit)
        while n and at < c:
            first = max(at, 0)
            last = min(c - 1, max(first, first_new) + int(rng.integers(0, 12)))
            if rng.random() < 0.8 and last >= first_new:
                spans.append((s, first, last))
                for pos in range(max(first, first_new), last + 1):
                    limits[qsl[s] + pos - first_new] = last
            at = last + 1 + int(rng.integers(0, 6))
    return spans, jnp.asarray(limits, jnp.int32)


def reference(q64, k64, v64, tables, seqs, qsl, spans, scale, window, bidirectional=True):
    ref = np.zeros_like(q64)
    for s, (c, n) in enumerate(seqs):
        for j in range(n):
            pos = c - n + j
            last = pos
            if bidirectional:
                last = max([pos] + [b for (t, a, b) in spans if t == s and a <= pos <= b])
            lo = max(0, pos - window + 1) if window else 0
            t = qsl[s] + j
            ref[t] = attend(q64[t], keys(k64, tables[s], lo, last + 1), keys(v64, tables[s], lo, last + 1), scale)
    return ref


# (dtype, page, heads, kv_heads, head_dim, window, q_tile)
CASES = [("f32", 8, 4, 2, 32, None, 4), ("f32", 16, 8, 1, 64, 7, 8), ("bf16", 8, 4, 4, 32, None, None),
         ("f32", 32, 6, 2, 32, 20, 16)]


@pytest.mark.parametrize("impl", ["xla", "pallas", "invariant", "auto"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_ragged_prefill_key_limits(impl, case):
    dtype_name, page, heads, kv_heads, head_dim, window, q_tile = case
    rng = np.random.default_rng([SEED, CASES.index(case)])
    print(f"seed {SEED} case {case}")
    seqs = [(3 * page + 5, 2 * page + 3), (21, 21), (page + 1, 1), (0, 0), (5 * page, page + 2), (9, 4)]
    seqs = [seqs[i] for i in rng.permutation(len(seqs))]
    ctx = [c for c, _ in seqs]
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    num_tokens = int(qsl[-1]) + 3
    k, v, tables, k64, v64 = make_cache(ctx, kv_heads, page, head_dim, DTYPES[dtype_name])
    q, q64 = random_q((num_tokens, heads, head_dim), DTYPES[dtype_name])
    spans, limits = spans_and_limits(rng, seqs, qsl, num_tokens)
    scale = 1 / np.sqrt(head_dim)
    args = (q, k, v, tables, jnp.asarray(ctx, jnp.int32), jnp.asarray(qsl))
    opts = dict(scale=scale, sliding_window=window, key_limits=limits)
    if impl == "xla":
        out = pk.ragged_paged_attention_xla(*args, **opts)
    elif impl == "pallas":
        out = ragged_paged_attention_pallas(*args, interpret=INTERPRET, q_tile=q_tile, **opts)
    elif impl == "invariant":
        out = ragged_paged_attention_invariant(*args, tiles=(1, 8), **opts)
    else:  # the dispatching entry point, the engine's (on a CPU: the XLA twin)
        out = pk.ragged_paged_attention(*args, backend="auto", interpret=INTERPRET, **opts)
    t = np.asarray(tables)
    ref = reference(q64, k64, v64, t, seqs, qsl, spans, scale, window)
    causal = reference(q64, k64, v64, t, seqs, qsl, spans, scale, window, bidirectional=False)
    assert np.abs(ref - causal).max() > 0.05, "the spans must change the result"
    check_close(out, ref, dtype_name, f"{impl} {case} seqs={seqs} spans={spans}")


def test_limits_at_own_position_are_the_causal_kernel():
    """key_limits that extend nothing give the causal result, bit for bit, in the XLA twin and
    the Triton kernel."""
    seqs = [(29, 29), (40, 7), (3, 1)]
    ctx = [c for c, _ in seqs]
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    k, v, tables, _, _ = make_cache(ctx, 2, 8, 32, jnp.float32)
    q, _ = random_q((int(qsl[-1]), 4, 32), jnp.float32)
    args = (q, k, v, tables, jnp.asarray(ctx, jnp.int32), jnp.asarray(qsl))
    limits = jnp.full((q.shape[0],), -1, jnp.int32)
    for fn in (pk.ragged_paged_attention_xla,
               lambda *a, **kw: ragged_paged_attention_pallas(*a, interpret=INTERPRET, q_tile=4, **kw)):
        np.testing.assert_array_equal(np.asarray(fn(*args, key_limits=limits)), np.asarray(fn(*args)))
