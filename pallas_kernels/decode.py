"""Pallas (Triton lowering) decode kernel: one query token per sequence.

Grid (num_seqs, num_kv_heads, num_splits). A program takes all query heads of
one kv head ([group rows, head_dim], rows zero-padded to a power of two >= 16
because Triton's dot needs dims >= 16), so each K/V page is read once per kv
head. It walks its range of the sequence's block table `pages_per_iter`
pages at a time (gathered with one vector load, ~64 keys per step), with an
online softmax in fp32.

Split-K (flash-decoding): with num_splits > 1 each split covers a slice of the
block table and writes a partial (out, max, sumexp); `_combine` merges them in
jnp. Splits are chosen when num_seqs * num_kv_heads is too small to fill the
GPU and the table is long.

head_dim that is not a power of two (80, 96, ...) is handled with the K/V
block padded to the next power of two and masked loads, so the page arrays
are never copied; q is padded in the wrapper (it is small). Compiled, the
page size must be a power of two (Triton tensor shapes); interpret mode and
the XLA twin take any page size.

With a sliding window w the query (at position context_len - 1) sees keys
from context_len - w on; each split starts its loop at the first block
holding one.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks, tiling
from pallas_kernels.xla import default_scale

def _decode_kernel(ctx_ref, window_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *stat_refs, scale, head_dim,
                   pages_per_iter, soft_cap):
    seq, split = pl.program_id(0), pl.program_id(2)
    page_size = k_ref.shape[1]
    rows, dp = q_ref.shape
    span = table_ref.shape[0] * page_size  # keys covered by this split
    first = split * span
    block = pages_per_iter * page_size
    context = ctx_ref[seq]
    num_keys = jnp.clip(context - first, 0, span)
    start = jnp.clip(context - window_ref[0] - first, 0, num_keys)  # first key in the window, this split
    q = q_ref[...]

    def body(i, carry):
        ids = table_ref[pl.ds(i * pages_per_iter, pages_per_iter)]
        k = blocks.load_pages(k_ref, ids, head_dim, q.dtype)  # fp8 pages: widened in registers
        v = blocks.load_pages(v_ref, ids, head_dim, q.dtype)
        key = i * block + jnp.arange(block)
        return blocks.attend_block(carry, q, k, v, (key >= start) & (key < num_keys), scale, soft_cap=soft_cap)

    out, m, l = lax.fori_loop(start // block, tiling.cdiv(num_keys, block), body, blocks.init_carry(rows, dp))
    if stat_refs:  # split-K partial: combined outside
        m_ref, l_ref = stat_refs
        o_ref[...] = out
        m_ref[...] = m
        l_ref[...] = l
    else:
        o_ref[...] = blocks.normalize(out, l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "interpret", "logits_soft_cap", "fp8_as_bits"))
def paged_attention_pallas(
    q, k_pages, v_pages, block_tables, context_lens, *, scale=None, num_splits=None, interpret=False,
    sliding_window=None, logits_soft_cap=None, fp8_as_bits=None
):
    """fp8_as_bits: e4m3 pages read as bytes and widened by arithmetic (None: below sm_89 only)."""
    k_pages, v_pages = blocks.pages_for_triton(k_pages, fp8_as_bits), blocks.pages_for_triton(v_pages, fp8_as_bits)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    rows = max(16, tiling.next_pow2(group))
    dp = max(16, tiling.next_pow2(head_dim))
    pages_per_iter = max(1, blocks.KEYS_PER_ITER // page_size)
    tables, splits, per_split = tiling.split_tables(block_tables, num_pages, num_seqs * num_kv_heads, pages_per_iter,
                                                    num_splits)
    qp = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, rows - group), (0, dp - head_dim)))

    part = splits > 1
    out_dtype = jnp.float32 if part else q.dtype
    out_shape = [jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, rows, dp), out_dtype)]
    out_specs = [pl.BlockSpec((None, None, None, rows, dp), lambda s, h, k: (k, s, h, 0, 0))]
    if part:
        stat = jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, rows), jnp.float32)
        stat_spec = pl.BlockSpec((None, None, None, rows), lambda s, h, k: (k, s, h, 0))
        out_shape += [stat, stat]
        out_specs += [stat_spec, stat_spec]
    page_spec = pl.BlockSpec((None, num_pages, page_size, dp), lambda s, h, k: (h, 0, 0, 0))
    kernel = functools.partial(
        _decode_kernel, scale=default_scale(scale, head_dim), head_dim=head_dim, pages_per_iter=pages_per_iter,
        soft_cap=logits_soft_cap,
    )
    window = jnp.full((1,), blocks.NO_WINDOW if sliding_window is None else sliding_window, jnp.int32)
    res = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((num_seqs,), lambda s, h, k: (0,)),
            pl.BlockSpec((1,), lambda s, h, k: (0,)),
            pl.BlockSpec((None, per_split), lambda s, h, k: (s, k)),
            pl.BlockSpec((None, None, rows, dp), lambda s, h, k: (s, h, 0, 0)),
            page_spec,
            page_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jpaged_decode",
    )(context_lens.astype(jnp.int32), window, tables, qp, k_pages, v_pages)
    out = tiling.combine_splits(*res) if part else res[0][0]
    out = out[:, :, :group, :head_dim].reshape(q.shape)
    return out.astype(q.dtype)
