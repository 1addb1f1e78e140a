"""Mosaic GPU ragged prefill with two consumer warpgroups per program (issue 66's variant, after
FlashAttention-3's layout): a program takes 128 query rows (a tile of 128 / next_pow2(group)
tokens times the GQA group's heads, head-major as in mosaic.py), and each of its two warpgroups
runs mosaic._attend on 64 of them over the SAME K/V stages. Per row the K/V copies are halved
against mosaic.py's 64-row programs. Both warpgroups walk the same blocks (the tile's keys): with
head-major rows and a group of 2 or more, each one holds whole heads of the same tokens.

Warpgroup 0 issues the TMA copies of the next block once both warpgroups have arrived on the
stage's `consumed` barrier after their PV wgmma. There is no producer warpgroup: that and p from
registers are the next steps if this pays. Each warpgroup keeps its own q and p in shared memory;
its q buffer stages its output after the loop.

16-bit pages only (the fp8 widening buffers would be shared too), the diagonal-only mask, and
block_keys as mosaic.py's. A variant for bench_kernels (`mosaic[2wg,...]`); nothing routes to it.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic import (ROWS, STAGES, _attend, _interpret_params, _wgmma_smem, check_supported,
                                    query_tiles, tokens_from_tiles)
from pallas_kernels.xla import default_scale

TEAM = 2  # consumer warpgroups per program


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_keys", "mask_diagonal_only"))
def ragged_paged_attention_mosaic_wide(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                                       scale=None, interpret=False, block_keys=None, mask_diagonal_only=True):
    """Ragged prefill (see pallas_kernels.ragged_paged_attention), two warpgroups sharing K/V."""
    check_supported(q, k_pages)
    if k_pages.dtype != q.dtype:
        raise ValueError(f"the two-warpgroup prefill takes pages in q's dtype, not {k_pages.dtype}")
    head_dim, (num_kv_heads, _, page_size, _) = q.shape[2], k_pages.shape
    tables, seq, pos0, num_keys, qt, tile, block = query_tiles(
        q, k_pages, block_tables, context_lens, query_start_loc, TEAM * ROWS, block_keys)
    num_tiles = seq.shape[0]
    qt = qt.reshape(num_tiles, num_kv_heads, TEAM, ROWS, head_dim)
    scale = default_scale(scale, head_dim)

    def kernel(seq_ref, pos0_ref, keys_ref, table_ref, q_ref, k_ref, v_ref, o_ref, q_smem, q_bar, k_smem, v_smem,
               p_smem, k_bar, v_bar, consumed, sync):
        wg, h, j = lax.axis_index("wg"), lax.axis_index("kv_head"), lax.axis_index("tile")
        mine = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[j, h, wg], mine, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        keys = keys_ref[j]
        num_full = jnp.minimum(pos0_ref[j] + 1, keys) // block if mask_diagonal_only else 0
        acc, _, l = _attend(mine, k_ref, v_ref, table_ref.at[seq_ref[j]], h, 0, keys, scale,
                            (pos0_ref[j], tile, wg * ROWS), (k_smem, v_smem, p_smem.at[wg], k_bar, v_bar),
                            num_full=num_full, row_limits=True, team=(wg, consumed, sync))
        l = jnp.where(l > 0, l, 1.0)  # empty tiles stay zero
        mine[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(mine.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(mine, o_ref.at[j, h, wg])
        plgpu.wait_smem_to_gmem(0)

    stages = _wgmma_smem((STAGES, block, head_dim), q.dtype)
    # Every page's copy arrives on its stage's barrier: it completes when all have landed.
    landed = plgpu.Barrier(num_arrivals=block // page_size, num_barriers=STAGES)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        scratch_types=(_wgmma_smem((TEAM, ROWS, head_dim), q.dtype), plgpu.Barrier(num_barriers=TEAM), stages, stages,
                       _wgmma_smem((TEAM, ROWS, block), q.dtype), landed, landed,
                       plgpu.Barrier(num_arrivals=TEAM, num_barriers=STAGES), plgpu.Barrier(num_arrivals=TEAM)),
        grid=(num_kv_heads, num_tiles),
        grid_names=("kv_head", "tile"),
        num_threads=TEAM,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(interpret),
        kernel_name="jpaged_ragged_prefill_mosaic_wide",
    )(seq, pos0, num_keys, tables, qt, k_pages, v_pages)
    return tokens_from_tiles(out, q, query_start_loc, tile)
