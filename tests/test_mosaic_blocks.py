"""The Mosaic GPU kernels' block variants (issue 66): prefill with 128-key blocks and with the mask
applied only on the blocks that hold a tile's diagonal (FlashAttention-3's split of the key loop),
decode with only the last block masked. Against the float64 reference on poisoned pages (NaN in
every slot no sequence owns), prompt lengths on and off the block boundaries (1, 127, 128, 129,
255, chunks that start mid-block), seeded (the seed is printed), in GPU interpret mode off-GPU
(jax >= 0.11). The Mosaic kernels take no sliding window or soft cap (pallas_kernels routes those
calls to Triton), so there are no such cases here."""

import jax.numpy as jnp
import numpy as np
import pytest
import test_kernels
from test_kernels import FP8, attend, check_close, gather_seq, make_cache, needs_mosaic

pytestmark = needs_mosaic

# (context_len, q_len): fresh prompts at the block boundaries, chunks whose tiles start mid-block,
# a query alone after a full block, an empty row.
BOUNDARY_SEQS = [(1, 1), (127, 127), (128, 128), (129, 129), (255, 255), (300, 45), (256, 128), (129, 1), (0, 0)]
VARIANTS = [dict(), dict(mask_diagonal_only=True), dict(block_keys=128), dict(block_keys=128, mask_diagonal_only=True),
            dict(wide=True), dict(wide=True, block_keys=128)]  # wide: mosaic_wide.py, two warpgroups sharing K/V


def seeded(monkeypatch):
    """A fresh seed for test_kernels' fixtures (make_cache draws from its module rng), printed."""
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"seed {seed}")
    monkeypatch.setattr(test_kernels, "rng", np.random.default_rng(seed))
    return np.random.default_rng(seed + 1)


def run_prefill(seqs, heads, kv_heads, head_dim, page, dtype, page_dtype, variant, rng, pad_tokens=2):
    from pallas_kernels.mosaic import ragged_paged_attention_mosaic
    from pallas_kernels.mosaic_wide import ragged_paged_attention_mosaic_wide

    variant = dict(variant)
    kernel = ragged_paged_attention_mosaic_wide if variant.pop("wide", False) else ragged_paged_attention_mosaic
    ctx, qlens = [c for c, _ in seqs], [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    k, v, tables, k64, v64 = make_cache(ctx, kv_heads, page, head_dim, page_dtype)
    q = jnp.asarray(rng.standard_normal((int(qsl[-1]) + pad_tokens, heads, head_dim)), dtype)
    q64 = np.asarray(q, np.float64)
    out = kernel(q, k, v, tables, jnp.asarray(ctx, jnp.int32), jnp.asarray(qsl), interpret=True, **variant)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = np.zeros_like(q64)
    tables_np = np.asarray(tables)
    scale = 1 / np.sqrt(head_dim)
    for s, (c, n) in enumerate(seqs):
        kk, vv = gather_seq(k64, tables_np[s], c), gather_seq(v64, tables_np[s], c)
        for j in range(n):
            pos = c - n + j
            ref[qsl[s] + j] = attend(q64[qsl[s] + j], kk[:, : pos + 1], vv[:, : pos + 1], scale)
    assert not np.asarray(out[int(qsl[-1]):], np.float64).any(), "padding tokens must stay zero"
    return out, ref


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("heads, kv_heads, page", [(8, 2, 16), (2, 2, 64)], ids=["tile16-page16", "tile64-page64"])
def test_prefill_block_variants(monkeypatch, variant, heads, kv_heads, page):
    """Query tiles of 16 tokens (GQA group 4) and of 64 (group 1), 32 and 128 with two warpgroups, so
    tiles start on and off the 64- and 128-key block boundaries; pages of 16 (8 TMA copies a 128-key
    block) and 64 (2)."""
    rng = seeded(monkeypatch)
    seqs = [BOUNDARY_SEQS[i] for i in rng.permutation(len(BOUNDARY_SEQS))]
    print(f"seqs {seqs}")
    out, ref = run_prefill(seqs, heads, kv_heads, 64, page, jnp.bfloat16, jnp.bfloat16, variant, rng)
    check_close(out, ref, "bf16", f"mosaic prefill {variant} heads {heads}/{kv_heads} page {page}")


@pytest.mark.parametrize("fp8", FP8)
def test_prefill_block_variants_fp8_pages(monkeypatch, fp8):
    """fp8 pages widened to f16 in shared memory, 128-key blocks, the diagonal-only mask."""
    rng = seeded(monkeypatch)
    seqs = [(129, 129), (300, 45), (1, 1), (256, 128)]
    out, ref = run_prefill(seqs, 8, 2, 64, 16, jnp.bfloat16, FP8[fp8], dict(block_keys=128, mask_diagonal_only=True),
                           rng)
    check_close(out, ref, "bf16", f"mosaic prefill {fp8} keys=128 diagonal")


def decode_case(monkeypatch, lens, head_dim, page_dtype):
    """A seeded decode batch over pages of `page_dtype` (16-token pages, 8 heads over 2 KV heads)
    and its float64 reference."""
    rng = seeded(monkeypatch)
    page, heads, kv_heads = 16, 8, 2
    k, v, tables, k64, v64 = make_cache(lens, kv_heads, page, head_dim,
                                        jnp.bfloat16 if page_dtype == "bf16" else FP8[page_dtype])
    q = jnp.asarray(rng.standard_normal((len(lens), heads, head_dim)), jnp.bfloat16)
    q64 = np.asarray(q, np.float64)
    tables_np = np.asarray(tables)
    ref = np.stack([attend(q64[s], gather_seq(k64, tables_np[s], n), gather_seq(v64, tables_np[s], n),
                           1 / np.sqrt(head_dim)) for s, n in enumerate(lens)])
    return q, k, v, tables, ref


@pytest.mark.parametrize("page_dtype", ["bf16", "e4m3"])
def test_decode_mask_diagonal_only(monkeypatch, page_dtype):
    """Decode with only the block holding a split's last key masked: contexts on and off the 64-key
    boundary, split-K forced (each split's last block is its own)."""
    from pallas_kernels.mosaic import paged_attention_mosaic

    lens = [1, 63, 64, 65, 128, 0, 200, 255]
    q, k, v, tables, ref = decode_case(monkeypatch, lens, 64, page_dtype)
    for splits in (1, 2):
        out = paged_attention_mosaic(q, k, v, tables, jnp.asarray(lens, jnp.int32), num_splits=splits, interpret=True,
                                     mask_diagonal_only=True)
        check_close(out, ref, "bf16", f"mosaic decode diagonal-only {page_dtype} splits={splits}")


def test_wide_prefill_refuses_fp8_pages():
    from pallas_kernels.mosaic_wide import ragged_paged_attention_mosaic_wide

    q = jnp.zeros((4, 4, 64), jnp.bfloat16)
    pages = jnp.zeros((2, 4, 16, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="pages in q's dtype"):
        ragged_paged_attention_mosaic_wide(q, pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.asarray([4], jnp.int32),
                                           jnp.asarray([0, 4], jnp.int32), interpret=True)


def test_block_keys_must_be_whole_pages():
    from pallas_kernels.mosaic import _block_keys

    assert _block_keys(16) == 64 and _block_keys(16, 128) == 128 and _block_keys(256, 128) == 256
    with pytest.raises(ValueError, match="multiple of 64"):
        _block_keys(16, 96)


@pytest.mark.parametrize("page_dtype", ["bf16", "e4m3", "e5m2"])
def test_decode_share_smem(monkeypatch, page_dtype):
    """The decode kernel with the output's staging buffer in the loop buffers' memory (2 programs per
    SM on sm_90), alone and with the diagonal-only mask, split-K forced."""
    from pallas_kernels.mosaic import paged_attention_mosaic

    lens = [1, 63, 64, 65, 0, 200]
    q, k, v, tables, ref = decode_case(monkeypatch, lens, 128, page_dtype)
    for splits, diagonal in ((1, False), (2, True)):
        out = paged_attention_mosaic(q, k, v, tables, jnp.asarray(lens, jnp.int32), num_splits=splits, interpret=True,
                                     share_smem=True, mask_diagonal_only=diagonal)
        check_close(out, ref, "bf16", f"mosaic decode share_smem {page_dtype} splits={splits} diagonal={diagonal}")
