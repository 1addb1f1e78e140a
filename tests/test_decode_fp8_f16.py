"""The Triton decode kernel's fp8 path (issue 66): with bf16 queries it widens fp8 pages to f16 and
runs its dots in f16, q over a power of two that keeps it within f16's range; the next block's page
ids ride the loop carry (so Triton can pipeline the K/V copies); num_stages 2 and 3 (the rule and
bench_kernels' variants) compute the same. Against the float64 reference, on
poisoned pages (NaN in every slot no sequence owns), in interpret mode off-GPU."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import FP8, INTERPRET, attend, check_close, gather_seq, make_cache, rng

from pallas_kernels import blocks
from pallas_kernels.decode import paged_attention_pallas


def test_compute_dtype():
    assert blocks.fp8_compute_dtype(jnp.bfloat16, jnp.float8_e4m3fn) == jnp.float16
    assert blocks.fp8_compute_dtype(jnp.bfloat16, jnp.float8_e5m2) == jnp.float16
    assert blocks.fp8_compute_dtype(jnp.bfloat16, jnp.uint8) == jnp.float16  # e4m3 bytes (below sm_89)
    assert blocks.fp8_compute_dtype(jnp.bfloat16, jnp.bfloat16) == jnp.bfloat16
    assert blocks.fp8_compute_dtype(jnp.float32, jnp.float8_e4m3fn) == jnp.float32
    assert blocks.fp8_compute_dtype(jnp.float16, jnp.float8_e4m3fn) == jnp.float16


@pytest.mark.parametrize("amax", [0.0, 1.0, 32767.0, 32768.0, 3e5, 1e30])
def test_to_f16_range_is_exact_and_in_range(amax):
    q = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.bfloat16)
    q = q / jnp.max(jnp.abs(q)).astype(jnp.bfloat16) * jnp.bfloat16(amax) if amax else q * 0
    q16, factor = blocks.to_f16_range(q)
    f = float(factor[0])
    assert q16.dtype == jnp.float16 and factor.shape == (1,)
    assert f >= 1 and np.log2(f) == int(np.log2(f))  # a power of two, never scaling up
    back = np.asarray(q16, np.float64) * f
    assert np.isfinite(back).all() and np.abs(np.asarray(q16, np.float64)).max() < 2**15
    assert (f == 1) == (float(jnp.max(jnp.abs(q.astype(jnp.float32)))) < 2**15)
    # exact wherever q / factor is a normal f16 (bf16's 8 mantissa bits fit f16's 11)
    q64 = np.asarray(q, np.float64)
    normal = np.abs(q64 / f) >= 2.0**-14
    np.testing.assert_array_equal(back[normal], q64[normal])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("q_amax, num_stages", [(None, None), (1e5, None), (None, 2)])
def test_decode_fp8_pages_bf16_q(fp8, q_amax, num_stages):
    """Contexts on and off the 64-key block boundary (no tail block, only a tail, both) with split-K
    and a sliding window; |q| up to 1e5 (past f16's largest) comes back through the power of two;
    2 stages (bench_kernels' variant) on the same poisoned pages."""
    page, heads, kv_heads, head_dim = 16, 8, 2, 64
    lens = [64, 128, 63, 65, 1, 0, 200, 256 + 17]
    seed = int(rng.integers(1 << 30))
    print(f"seed {seed} lens {lens}")
    local = np.random.default_rng(seed)
    k, v, tables, k64, v64 = make_cache(lens, kv_heads, page, head_dim, FP8[fp8])
    q64 = local.standard_normal((len(lens), heads, head_dim))
    if q_amax:
        q64 = q64 / np.abs(q64).max() * q_amax
    q = jnp.asarray(q64, jnp.bfloat16)
    q64 = np.asarray(q, np.float64)
    scale = 0.7 / np.sqrt(head_dim) / (q_amax or 1.0)  # keep the softmax away from one-hot
    tables_np = np.asarray(tables)
    for splits, window in ((1, None), (2, None), (None, 70)):
        out = paged_attention_pallas(q, k, v, tables, jnp.asarray(lens, jnp.int32), scale=scale, num_splits=splits,
                                     interpret=INTERPRET, sliding_window=window, num_stages=num_stages)
        assert out.dtype == jnp.bfloat16
        ref = []
        for s, n in enumerate(lens):
            kk, vv = gather_seq(k64, tables_np[s], n), gather_seq(v64, tables_np[s], n)
            lo = 0 if window is None else max(0, n - window)
            ref.append(attend(q64[s], kk[:, lo:], vv[:, lo:], scale))
        check_close(out, np.stack(ref), "bf16", f"{fp8} q_amax={q_amax} stages={num_stages} splits={splits} window={window}")


@pytest.mark.skipif(not __import__("test_kernels").mosaic_runs(),
                    reason="Mosaic GPU kernels need sm_90+, or jax >= 0.11 off-GPU")
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("q_amax", [None, 1e5])
def test_mosaic_decode_fp8_pages_bf16_q(fp8, q_amax):
    """The Mosaic decode kernel's fp8 path: pages widened to f16 in shared memory, wgmma in f16, q
    over the same power of two (GPU interpret mode off-GPU, jax >= 0.11)."""
    import pallas_kernels as pk

    page, heads, kv_heads, head_dim = 16, 8, 2, 64
    lens = [64, 63, 65, 1, 0, 200]
    k, v, tables, k64, v64 = make_cache(lens, kv_heads, page, head_dim, FP8[fp8])
    q64 = rng.standard_normal((len(lens), heads, head_dim))
    if q_amax:
        q64 = q64 / np.abs(q64).max() * q_amax
    q = jnp.asarray(q64, jnp.bfloat16)
    q64 = np.asarray(q, np.float64)
    scale = 0.7 / np.sqrt(head_dim) / (q_amax or 1.0)
    tables_np = np.asarray(tables)
    ref = np.stack([attend(q64[s], gather_seq(k64, tables_np[s], n), gather_seq(v64, tables_np[s], n), scale)
                    for s, n in enumerate(lens)])
    for splits in (1, 2):
        out = pk.paged_attention(q, k, v, tables, jnp.asarray(lens, jnp.int32), scale=scale, num_splits=splits,
                                 backend="mosaic")
        assert out.dtype == jnp.bfloat16
        check_close(out, ref, "bf16", f"mosaic {fp8} q_amax={q_amax} splits={splits}")


@pytest.mark.parametrize("pages", ["e4m3", "e5m2", "e4m3-bytes"])
@pytest.mark.parametrize("q_amax", [None, 1e5])
def test_prefill_fp8_pages_bf16_q(pages, q_amax):
    """The Triton ragged prefill kernel takes the same f16 path: causal prompts over poisoned fp8 pages
    (typed, or as bytes below sm_89), small query tiles so prompts span several."""
    from test_kernels import prefill_seqs

    from pallas_kernels.prefill import ragged_paged_attention_pallas

    page, heads, kv_heads, head_dim = 16, 8, 2, 64
    seqs = prefill_seqs(page)
    ctx, qlens = [c for c, _ in seqs], [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    k, v, tables, k64, v64 = make_cache(ctx, kv_heads, page, head_dim, FP8[pages.split("-")[0]])
    q64 = rng.standard_normal((int(qsl[-1]) + 2, heads, head_dim))
    if q_amax:
        q64 = q64 / np.abs(q64).max() * q_amax
    q = jnp.asarray(q64, jnp.bfloat16)
    q64 = np.asarray(q, np.float64)
    scale = 0.7 / np.sqrt(head_dim) / (q_amax or 1.0)
    out = ragged_paged_attention_pallas(q, k, v, tables, jnp.asarray(ctx, jnp.int32), jnp.asarray(qsl), scale=scale,
                                        interpret=INTERPRET, q_tile=4, fp8_as_bits=pages.endswith("bytes"))
    assert out.dtype == jnp.bfloat16
    ref = np.zeros_like(q64)
    tables_np = np.asarray(tables)
    for s, (c, n) in enumerate(seqs):
        kk, vv = gather_seq(k64, tables_np[s], c), gather_seq(v64, tables_np[s], c)
        for j in range(n):
            pos = c - n + j
            ref[qsl[s] + j] = attend(q64[qsl[s] + j], kk[:, : pos + 1], vv[:, : pos + 1], scale)
    check_close(out, ref, "bf16", f"prefill {pages} q_amax={q_amax}")
