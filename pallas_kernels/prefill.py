"""Pallas (Triton lowering) ragged prefill kernel.

q [num_tokens, num_heads, head_dim] packs the new tokens of all sequences;
sequence i owns q[query_start_loc[i]:query_start_loc[i+1]] and those tokens
are the last q_len_i of its context_lens[i] tokens (their K/V are already in
the pages), so new token j sits at position context_lens[i] - q_len_i + j and
sees keys at positions <= its own.

Grid (num_tiles, num_kv_heads). Each sequence's new tokens are cut into query
tiles of `tile` tokens; tiling.ragged_tiles maps tile -> (sequence, first
token, first position, rows) with jnp ops before the call, and the number of
tiles is a static bound ((T - m) // tile + m, m = min(S, T)), so the grid
never depends on data. Tiles past the last real one have zero rows and exit
at once. Triton has no scalar prefetch, so the per-tile scalars are small
int32 arrays read with a scalar load.

A program holds the tile's queries for every head of one kv head as a
[group * tile, dp] block (head-major rows: row r is token r % tile), loops
over the sequence's pages up to the last key its last token can see, and
applies the causal mask per row. Queries are gathered into tiles and outputs
scattered back to tokens with XLA gathers around the kernel (cheap next to
the attention itself). With a sliding window w, row r sees keys in
(pos_r - w, pos_r] and the loop starts at the first block the tile's first
token sees. With `key_limits` (int32[tokens]; Gemma 3's images) row r sees keys
up to max(pos_r, key_limits[token_r]) instead (still after pos_r - w), and the
loop runs to the furthest key any row sees; without them the kernel is the
causal one, unchanged (the limits are an input only when given).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks, tiling
from pallas_kernels.xla import default_scale

MAX_ROWS = 64  # query rows per program (group * tile): registers bound this


def query_tile(num_tokens: int, num_seqs: int, group_pow2: int) -> int:
    """Tokens per tile: ~ the average new tokens per sequence, with
    group * tile in [16, MAX_ROWS] (Triton dots need >= 16 rows)."""
    avg = tiling.next_pow2(tiling.cdiv(num_tokens, max(1, min(num_seqs, num_tokens))))
    smallest = max(1, 16 // group_pow2)
    return max(smallest, min(max(1, MAX_ROWS // group_pow2), avg))


def _prefill_kernel(
    seq_ref, pos0_ref, keys_ref, window_ref, factor_ref, table_ref, q_ref, k_ref, v_ref, *refs, scale, head_dim,
    tile, pages_per_iter, soft_cap, bidirectional, v_transposed=False
):
    # refs: (last_ref, o_ref) with per-row key limits (last_ref [rows]: each row's last key), else (o_ref,).
    last_ref, o_ref = refs if bidirectional else (None, *refs)
    j = pl.program_id(0)
    seq, pos0, num_keys = seq_ref[j], pos0_ref[j], keys_ref[j]
    page_size = k_ref.shape[1]
    rows, dp = q_ref.shape
    block = pages_per_iter * page_size
    q = q_ref[...]
    scale = scale * factor_ref[0]  # q came over a power of two (f16's range), 1 otherwise
    q_pos = pos0 + jnp.arange(rows) % tile
    q_last = last_ref[...] if bidirectional else q_pos  # the last key each row sees
    window = window_ref[0]
    start = jnp.clip(pos0 - window + 1, 0, num_keys)  # the first key the tile's first token sees

    def body(i, carry):
        ids = table_ref[seq, pl.ds(i * pages_per_iter, pages_per_iter)]
        k = blocks.load_pages(k_ref, ids, head_dim, q.dtype)  # fp8 pages: widened in registers
        load_v = blocks.load_pages_transposed if v_transposed else blocks.load_pages
        v = load_v(v_ref, ids, head_dim, q.dtype)
        k_pos = i * block + jnp.arange(block)
        visible = (k_pos[None, :] <= q_last[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        key_live = (k_pos >= start) & (k_pos < num_keys)
        return blocks.attend_block(carry, q, k, v, key_live, scale, visible, soft_cap, v_transposed)

    out, _, l = lax.fori_loop(start // block, tiling.cdiv(num_keys, block), body, blocks.init_carry(rows, dp))
    o_ref[...] = blocks.normalize(out, l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "q_tile", "logits_soft_cap", "fp8_as_bits",
                                             "v_transposed"))
def ragged_paged_attention_pallas(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale=None, interpret=False, q_tile=None,
    sliding_window=None, logits_soft_cap=None, fp8_as_bits=None, key_limits=None, v_transposed=False
):
    """q_tile overrides the tokens per tile (tests use it to cross tiles); fp8_as_bits: e4m3 pages
    read as bytes and widened by arithmetic (None: below sm_89 only); key_limits: int32[tokens],
    the last key each query sees when past its own position (pallas_kernels.ragged_paged_attention);
    v_transposed: v_pages [num_kv_heads, num_pages, head_dim, page_size] (decode.py)."""
    k_pages, v_pages = blocks.pages_for_triton(k_pages, fp8_as_bits), blocks.pages_for_triton(v_pages, fp8_as_bits)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    gp = tiling.next_pow2(group)
    dp = max(16, tiling.next_pow2(head_dim))
    tile = max(q_tile or query_tile(num_tokens, num_seqs, gp), 16 // gp, 1)
    rows = gp * tile
    pages_per_iter = max(1, blocks.KEYS_PER_ITER // page_size)
    tables, (seq, tok0, pos0, n_rows), num_keys, last_keys = tiling.ragged_plan(
        block_tables, num_pages, page_size, pages_per_iter, query_start_loc, context_lens, num_tokens, tile,
        key_limits)
    num_tiles = seq.shape[0]

    qt = tiling.gather_query_tiles(q, tok0, n_rows, tile)
    qt = qt.reshape(num_tiles, tile, num_kv_heads, group, head_dim)
    qt = qt.transpose(0, 2, 3, 1, 4)  # head-major rows within a kv head
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, gp - group), (0, 0), (0, dp - head_dim)))
    qt = qt.reshape(num_tiles, num_kv_heads, rows, dp)
    if blocks.fp8_compute_dtype(q.dtype, k_pages.dtype) != q.dtype:  # fp8 pages, bf16 q: dots in f16 (decode.py)
        qt, factor = blocks.to_f16_range(qt)
    else:
        factor = jnp.ones((1,), jnp.float32)

    scalar_spec = pl.BlockSpec((num_tiles,), lambda j, h: (0,))
    page_spec = pl.BlockSpec((None, num_pages, page_size, dp), lambda j, h: (h, 0, 0, 0))
    v_spec = pl.BlockSpec((None, num_pages, dp, page_size), lambda j, h: (h, 0, 0, 0)) if v_transposed else page_spec
    row_spec = pl.BlockSpec((None, None, rows, dp), lambda j, h: (j, h, 0, 0))
    kernel = functools.partial(
        _prefill_kernel,
        scale=default_scale(scale, head_dim),
        head_dim=head_dim,
        tile=tile,
        pages_per_iter=pages_per_iter,
        soft_cap=logits_soft_cap,
        bidirectional=key_limits is not None,
        v_transposed=v_transposed,
    )
    extra_specs, extra_args = [], []
    if key_limits is not None:  # each row's last key, head-major rows as q's (row r: token r % tile)
        extra_specs.append(pl.BlockSpec((None, rows), lambda j, h: (j, 0)))
        extra_args.append(jnp.tile(last_keys, (1, gp)))
    window = jnp.full((1,), blocks.NO_WINDOW if sliding_window is None else sliding_window, jnp.int32)
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=[
            scalar_spec,
            scalar_spec,
            scalar_spec,
            pl.BlockSpec((1,), lambda j, h: (0,)),
            pl.BlockSpec((1,), lambda j, h: (0,)),
            pl.BlockSpec(tables.shape, lambda j, h: (0, 0)),
            row_spec,
            page_spec,
            v_spec,
            *extra_specs,
        ],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jpaged_ragged_prefill",
    )(seq, pos0, num_keys, window, factor, tables, qt, k_pages, v_pages, *extra_args)
    out = out.reshape(num_tiles, num_kv_heads, gp, tile, dp)
    out = out[:, :, :group, :, :head_dim].transpose(0, 3, 1, 2, 4)
    out = out.reshape(num_tiles, tile, num_heads, head_dim)
    return tiling.scatter_tiles_to_tokens(out, query_start_loc, num_tokens, tile)
