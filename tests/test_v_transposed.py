"""V pages stored transposed ([head_dim, page_size] per page: cache_ops' `v_transposed` variant
layout for fp8 KV caches, issue 66) against the float64 reference on poisoned pages: NaN in every
slot no sequence owns (and garbage block-table entries), so any read of a slot that should be
masked shows up as NaN. The writer against the standard layout's writer; the XLA twins, the Triton
decode kernel (with and without `peel_tail`) and ragged prefill in interpret mode; the Mosaic decode
kernel (PV as an fp8 wgmma, p in e4m3) in GPU interpret mode off-GPU (jax >= 0.11). Contexts of 1,
on and off the page and 64-key block boundaries, GQA, split-K, fp8 scales as jpaged applies them
(K's folded into q, V's into the output). Seeded (the seed is printed)."""

import jax.numpy as jnp
import numpy as np
import pytest
import test_kernels
from test_kernels import FP8, INTERPRET, attend, check_close, gather_seq, make_cache, needs_mosaic

import pallas_kernels as pk
from pallas_kernels.cache_ops import transpose_v_pages
from pallas_kernels.decode import paged_attention_pallas
from pallas_kernels.prefill import ragged_paged_attention_pallas

# p goes to Mosaic's fp8 PV wgmma in e4m3 (4 significant bits, as FlashAttention-3's fp8 path):
# the output is within ~1e-2 of the reference whatever q's dtype (f16's 5e-3 is for f16 p).
MOSAIC_TOL = 2e-2


@pytest.fixture
def rng(monkeypatch):
    """A seed drawn from conftest's seeded generator, printed; test_kernels' fixtures draw from it too."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"seed {seed}")
    monkeypatch.setattr(test_kernels, "rng", np.random.default_rng(seed))
    return np.random.default_rng(seed + 1)


def decode_lens(page):
    """1 key, a page's end and its neighbours, an empty row, exactly two 64-key blocks (no tail
    block), a block and one key, and a long context with a partial last page."""
    return [1, page - 1, page, page + 1, 0, 128, 65, 20 * page + 3]


def reference(q64, k64, v64, tables, lens, scale):
    tables = np.asarray(tables)
    return np.stack([attend(q64[s], gather_seq(k64, tables[s], n), gather_seq(v64, tables[s], n), scale)
                     for s, n in enumerate(lens)])


def decode_case(rng, page, heads, kv_heads, head_dim, page_dtype, q_dtype, lens=None):
    lens = decode_lens(page) if lens is None else lens
    print(f"lens {lens}")
    k, v, tables, k64, v64 = make_cache(lens, kv_heads, page, head_dim, page_dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), q_dtype)
    scale = 0.7 / np.sqrt(head_dim)
    ref = reference(np.asarray(q, np.float64), k64, v64, tables, lens, scale)
    return (q, k, transpose_v_pages(v), tables, jnp.asarray(lens, jnp.int32)), scale, ref


# (q dtype, page, heads, kv_heads, head_dim, num_splits): GQA 4, 1 (MHA), 3 and 8 (MQA-like),
# head_dim 128, 64 and 80 (padded to 128 in the Triton kernel), split-K forced and automatic.
DECODE_CASES = [
    ("bf16", 16, 8, 2, 128, None),
    ("f16", 8, 4, 4, 64, 2),
    ("bf16", 32, 6, 2, 80, 3),
    ("f32", 16, 8, 1, 64, None),
]


@pytest.mark.parametrize("impl", ["xla", "pallas", "pallas-peel", "pallas-e4m3-bytes"])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_transposed_v(rng, impl, fp8, case):
    dtype_name, page, heads, kv_heads, head_dim, splits = case
    if impl == "pallas-e4m3-bytes" and fp8 != "e4m3":
        pytest.skip("bytes are e4m3's path (below sm_89)")
    args, scale, ref = decode_case(rng, page, heads, kv_heads, head_dim, FP8[fp8], test_kernels.DTYPES[dtype_name])
    if impl == "xla":
        out = pk.paged_attention(*args, scale=scale, backend="xla", v_transposed=True)
    else:
        out = paged_attention_pallas(*args, scale=scale, num_splits=splits, interpret=INTERPRET, v_transposed=True,
                                     peel_tail=impl == "pallas-peel", fp8_as_bits=impl == "pallas-e4m3-bytes")
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    check_close(out, ref, dtype_name, f"{impl} {fp8} {case}")


def test_decode_transposed_v_16bit_pages_through_dispatch(rng):
    """The layout is not fp8's alone for Triton and the XLA twin: bf16 pages, through pk.paged_attention."""
    args, scale, ref = decode_case(rng, 16, 8, 2, 64, jnp.bfloat16, jnp.bfloat16)
    for backend in ("pallas", "xla"):
        out = pk.paged_attention(*args, scale=scale, backend=backend, interpret=INTERPRET, v_transposed=True)
        check_close(out, ref, "bf16", f"{backend} bf16 pages")


def write_pages(rng, lens, kv_heads, page, head_dim, fp8, k_scale, v_scale, kv_dtype=None):
    """Every sequence's K/V (random, some K far past fp8's range) written by write_kv into NaN-poisoned
    pages, V transposed; returns (k, v_t, tables, k64, v64): the pages and their dequantized float64
    values (the fp8 values times their scales) in the standard layout."""
    k, v, tables, _, _ = make_cache(lens, kv_heads, page, head_dim, fp8)  # NaN where no sequence writes
    tables_np = np.asarray(tables)
    slots = np.concatenate([tables_np[s, np.arange(n) // page] * page + np.arange(n) % page
                            for s, n in enumerate(lens)]).astype(np.int32)
    new_k = rng.standard_normal((len(slots), kv_heads, head_dim)) * 3
    new_v = rng.standard_normal((len(slots), kv_heads, head_dim))
    new_k[0, 0, 0] = 1e6  # saturates at fp8's largest value
    slot_mapping = np.concatenate([slots, [-1, -1]]).astype(np.int32)  # padding tokens write nothing
    new_k, new_v = (np.concatenate([x, np.full((2, *x.shape[1:]), np.nan)]) for x in (new_k, new_v))
    k_t, v_t = k, transpose_v_pages(v)
    if kv_dtype is not None:  # raw pools (the CPU engine's): the pages hold fp8 bits as uint8
        k_t, v_t = (jnp.asarray(x).view(jnp.uint8) for x in (k_t, v_t))
    k_t, v_t = pk.write_kv(k_t, v_t, jnp.asarray(new_k, jnp.float32), jnp.asarray(new_v, jnp.float32),
                           jnp.asarray(slot_mapping), k_scale, v_scale, kv_dtype=kv_dtype, v_transposed=True)
    typed_k, typed_v = pk.as_dtype(k_t, kv_dtype), pk.as_dtype(v_t, kv_dtype)
    k64 = np.asarray(typed_k.astype(jnp.float32), np.float64) * float(k_scale)
    v64 = np.asarray(transpose_v_pages(typed_v).astype(jnp.float32), np.float64) * float(v_scale)
    return k_t, v_t, tables, k64, v64


@pytest.mark.parametrize("fp8", FP8)
def test_write_kv_transposed_matches_the_standard_layout(rng, fp8):
    """write_kv(v_transposed=True) stores exactly the standard writer's V, transposed, and the same K;
    padding (-1) and out-of-range slots write nothing; raw (uint8) pools get the same bits."""
    dtype = FP8[fp8]
    kvh, pages, page, d, tokens = 2, 5, 16, 32, 40
    k_pages = jnp.asarray(rng.standard_normal((kvh, pages, page, d)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((kvh, pages, page, d)), dtype)
    slots = rng.permutation(pages * page)[:tokens]
    slots[rng.random(tokens) < 0.2] = -1
    slots[0] = pages * page + 3  # past the pool: dropped
    k = jnp.asarray(rng.standard_normal((tokens, kvh, d)) * 4, jnp.float32)
    v = jnp.asarray(rng.standard_normal((tokens, kvh, d)), jnp.float32)
    k_scale, v_scale = np.float32(rng.uniform(0.05, 2)), np.float32(rng.uniform(0.05, 2))
    slots = jnp.asarray(slots, jnp.int32)
    want_k, want_v = pk.write_kv(k_pages, v_pages, k, v, slots, k_scale, v_scale)
    got_k, got_v = pk.write_kv(k_pages, transpose_v_pages(v_pages), k, v, slots, k_scale, v_scale, v_transposed=True)
    assert got_v.shape == (kvh, pages, d, page) and got_v.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got_k).view(np.uint8), np.asarray(want_k).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint8),
                                  np.asarray(transpose_v_pages(want_v)).view(np.uint8))
    assert (np.asarray(got_v).view(np.uint8) != np.asarray(transpose_v_pages(v_pages)).view(np.uint8)).any()
    raw_k, raw_v = pk.write_kv(k_pages.view(jnp.uint8), transpose_v_pages(v_pages).view(jnp.uint8), k, v, slots,
                               k_scale, v_scale, kv_dtype=dtype, v_transposed=True)
    np.testing.assert_array_equal(np.asarray(raw_v), np.asarray(got_v).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(raw_k), np.asarray(got_k).view(np.uint8))


@pytest.mark.parametrize("impl", ["xla", "xla-raw", "pallas", "mosaic"])
def test_written_pages_with_scales_decode(rng, impl):
    """write_kv then decode, as jpaged runs an fp8 cache: K / k_scale and V / v_scale in e4m3 pages,
    the kernels given q * k_scale and their output times v_scale; the reference attends over the
    dequantized values. Pages of 32 (Mosaic's least), GQA 4, a context of 1 and partial pages."""
    if impl == "mosaic" and not test_kernels.mosaic_runs():
        pytest.skip("Mosaic GPU kernels need sm_90+, or jax >= 0.11 off-GPU")
    lens = [1, 31, 33, 64, 200]
    page, heads, kv_heads, head_dim = 32, 8, 2, 64
    k_scale, v_scale = np.float32(rng.uniform(0.02, 0.5)), np.float32(rng.uniform(0.02, 0.5))
    kv_dtype = jnp.float8_e4m3fn if impl == "xla-raw" else None
    k, v_t, tables, k64, v64 = write_pages(rng, lens, kv_heads, page, head_dim, jnp.float8_e4m3fn, k_scale, v_scale,
                                           kv_dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), jnp.bfloat16)
    scale = 1 / np.sqrt(head_dim)
    ref = reference(np.asarray(q, np.float64), k64, v64, tables, lens, scale)
    q_scaled = (q.astype(jnp.float32) * k_scale).astype(jnp.bfloat16)  # K's scale folded into q, as jpaged does
    out = pk.paged_attention(q_scaled, k, v_t, tables, jnp.asarray(lens, jnp.int32), scale=scale,
                             backend=impl.split("-")[0], interpret=INTERPRET, kv_dtype=kv_dtype, v_transposed=True)
    out = out.astype(jnp.float32) * v_scale
    # bf16 rounds q * k_scale (2**-9 relative); Mosaic's p in e4m3 adds its own
    check_close(out, ref, "bf16", f"{impl} written with scales {k_scale:.3f} / {v_scale:.3f}")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("fp8", FP8)
def test_ragged_prefill_transposed_v(rng, impl, fp8):
    """Ragged prefill over transposed V: fresh prompts, chunks starting mid-page, a query alone
    after full pages, an empty row; query tiles of 8 tokens so sequences span several."""
    page, heads, kv_heads, head_dim = 16, 8, 2, 64
    seqs = [(5, 5), (3 * page + 5, 2 * page + 3), (2 * page, page), (page + 1, 1), (0, 0), (4 * page, 1), (130, 130)]
    seqs = [seqs[i] for i in rng.permutation(len(seqs))]
    print(f"seqs {seqs}")
    ctx, qlens = [c for c, _ in seqs], [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    k, v, tables, k64, v64 = make_cache(ctx, kv_heads, page, head_dim, FP8[fp8])
    q = jnp.asarray(rng.standard_normal((int(qsl[-1]) + 2, heads, head_dim)), jnp.bfloat16)
    q64 = np.asarray(q, np.float64)
    args = (q, k, transpose_v_pages(v), tables, jnp.asarray(ctx, jnp.int32), jnp.asarray(qsl))
    if impl == "xla":
        out = pk.ragged_paged_attention(*args, backend="xla", v_transposed=True)
    else:
        out = ragged_paged_attention_pallas(*args, interpret=INTERPRET, q_tile=8, v_transposed=True)
    ref = np.zeros_like(q64)
    tables_np, scale = np.asarray(tables), 1 / np.sqrt(head_dim)
    for s, (c, n) in enumerate(seqs):
        kk, vv = gather_seq(k64, tables_np[s], c), gather_seq(v64, tables_np[s], c)
        for j in range(n):
            ref[qsl[s] + j] = attend(q64[qsl[s] + j], kk[:, : c - n + j + 1], vv[:, : c - n + j + 1], scale)
    check_close(out, ref, "bf16", f"{impl} prefill {fp8}")


# Mosaic: (q dtype, page, heads, kv_heads, head_dim, num_splits, variant). Pages of 32 (two per
# 64-key block: two fp8 wgmmas), 64 and 128 (a 128-key block); GQA 4, 1 and 8.
MOSAIC_CASES = [
    ("bf16", 32, 8, 2, 128, None, {}),
    ("f16", 64, 4, 4, 64, 2, {}),
    ("bf16", 128, 8, 1, 64, 3, {}),
    ("bf16", 32, 8, 2, 64, None, dict(share_smem=True, mask_diagonal_only=True)),
]


@needs_mosaic
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("case", MOSAIC_CASES, ids=str)
def test_mosaic_decode_transposed_v(rng, fp8, case):
    """Each page's TMA lands whole in the stage, the PV wgmma runs in fp8 on it with p in e4m3 (e5m2
    pages: the e4m3 x e5m2 form), the last block's dead V slots zeroed through f16."""
    from pallas_kernels.mosaic import paged_attention_mosaic

    dtype_name, page, heads, kv_heads, head_dim, splits, variant = case
    args, scale, ref = decode_case(rng, page, heads, kv_heads, head_dim, FP8[fp8], test_kernels.DTYPES[dtype_name])
    out = paged_attention_mosaic(*args, scale=scale, num_splits=splits, interpret=INTERPRET, v_transposed=True,
                                 **variant)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert not np.isnan(out).any()
    err = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"mosaic vT {fp8} {case}: max rel err {err:.2e}")
    assert err <= MOSAIC_TOL, err


def test_mosaic_transposed_v_refuses_what_it_cannot_take():
    """Pages of 16 (a page's keys are 16 bytes; fp8 wgmma has no 16-byte swizzle), 16-bit pages, V in
    the standard layout; and no Mosaic prefill over transposed V."""
    from pallas_kernels.mosaic import check_v_transposed

    def pages(page, dtype, transposed):
        return jnp.zeros((2, 4, 64, page) if transposed else (2, 4, page, 64), dtype)

    e4m3 = jnp.float8_e4m3fn
    check_v_transposed(pages(32, e4m3, False), pages(32, e4m3, True))
    with pytest.raises(ValueError, match="multiple of 32"):
        check_v_transposed(pages(16, e4m3, False), pages(16, e4m3, True))
    with pytest.raises(ValueError, match="fp8 pages"):
        check_v_transposed(pages(32, jnp.bfloat16, False), pages(32, jnp.bfloat16, True))
    with pytest.raises(ValueError, match="fp8 pages"):
        check_v_transposed(pages(64, e4m3, False), pages(64, e4m3, False)[:, :, :, :32])
    q = jnp.zeros((3, 8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="transposed V"):
        pk.ragged_paged_attention(q, pages(32, e4m3, False), pages(32, e4m3, True), jnp.zeros((1, 2), jnp.int32),
                                  jnp.asarray([3]), jnp.asarray([0, 3], jnp.int32), backend="mosaic",
                                  v_transposed=True)
