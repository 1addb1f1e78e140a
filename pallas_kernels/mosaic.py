"""Pallas (Mosaic GPU lowering) decode and ragged prefill kernels, for sm_90+ (Hopper and newer).

One warpgroup per program works on a [ROWS=64, head_dim] block of queries in shared
memory -- the query heads of one kv head, stacked so wgmma's M dimension is filled:
decode stacks a GQA group's heads (padded to 64 rows), prefill a tile of tokens times the
group's heads (head-major rows, as prefill.py). It walks the sequence's block table
BLOCK_KEYS keys at a time: each page of K and V comes into shared memory with its own TMA
copy (the page id read from the block table), two stages deep so the next block's pages
load while this one computes; QK^T and PV run on wgmma with fp32 accumulators, and an
online softmax in fp32 sits between them.

Decode splits long tables into `num_splits` programs (split-K, flash-decoding) that
write fp32 partials (out, max, sumexp) merged by tiling.combine_splits. Prefill's tiles
come from tiling.ragged_tiles, as in prefill.py and the XLA twin.

fp8 pages (the fp8 KV cache) land by TMA in fp8 stages, and a warpgroup widens each block to
q's dtype in a second shared-memory buffer before its wgmma: wgmma's fp8 form wants both
operands fp8 and K-major, which p @ V is not, so the matmuls stay bf16/fp16 and fp8 halves
the bytes read from HBM, which is what decode is bound by.

Limits (ValueError otherwise; the Triton kernels cover the rest): bf16/fp16 queries, pages in
q's dtype or fp8 (e4m3fn, e5m2), head_dim a multiple of 64, at most 64 query heads per kv head.
Off-GPU the kernels run in Mosaic GPU's interpret mode (jax >= 0.11), which simulates TMA,
barriers and wgmma on the CPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import blocks, tiling
from pallas_kernels.cache_ops import FP8
from pallas_kernels.xla import default_scale

ROWS = 64  # wgmma's M for one warpgroup
MIN_BLOCK_KEYS = 64  # keys per pipeline step (more when one page is larger)
STAGES = 2
MASK_VALUE = -1e30  # finite: a fully masked row never computes inf - inf
LOG2E = 1.4426950408889634
# Transposed fp8 V pages (v_transposed): p goes to its wgmma in e4m3, scaled by 2**P_SHIFT (exp2 of the
# scores minus the row max plus P_SHIFT: at most 256, below e4m3's 448) so that p down to 2**-14 keeps
# e4m3's normal precision; the sums l carry the same factor, which the output's division cancels.
P_SHIFT = 8.0


def check_supported(q, k_pages):
    """ValueError naming what the Mosaic kernels cannot take."""
    group = q.shape[1] // k_pages.shape[0]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype not in (q.dtype, *FP8):
        raise ValueError(f"attention_backend='mosaic' needs bf16 or fp16 q and pages in q's dtype or fp8, got "
                         f"{q.dtype} and {k_pages.dtype}: use 'pallas'")
    if q.shape[-1] % 64:
        raise ValueError(f"attention_backend='mosaic' needs head_dim % 64 == 0, got {q.shape[-1]}: use 'pallas'")
    if group > ROWS:
        raise ValueError(f"attention_backend='mosaic' takes at most {ROWS} query heads per kv head, got {group}")


def _interpret_params(interpret):
    if not interpret:
        return None
    if not hasattr(plgpu, "InterpretGPUParams"):
        raise NotImplementedError("Mosaic GPU kernels run off-GPU only in jax >= 0.11's GPU interpret mode")
    return plgpu.InterpretGPUParams()


def _attend(q_smem, k_ref, v_ref, table_ref, kv_head, first_page, num_keys, scale, causal, scratch, num_full=0,
            row_limits=False, team=None, v_transposed=False):
    """Online-softmax attention of q_smem's rows over keys [0, num_keys) of the pages listed in
    table_ref[first_page:]. causal = (pos0, tile) (prefill): row r is the query at position
    pos0 + r % tile (head-major rows) and sees keys up to its own position. The first `num_full`
    blocks (a traced int: blocks every row sees whole, below the diagonal and before num_keys) run
    without the mask's arithmetic, as FlashAttention-3 does; 0 masks every block. row_limits: the
    mask compares each score's column with its row's key count in the block (one compare and select
    per score, one iota); else key and row iotas over the block (sm_90: 255 registers and spills at
    128-key blocks, 216 at 64). team = (wg, consumed, sync) (mosaic_wide.py): two warpgroups share
    the K/V stages; warpgroup 0 issues the copies once both have arrived on `consumed` (a barrier per
    stage) after their PV, and zeroes the last block's dead V slots before both pass `sync`.
    causal = (pos0, tile, row0): the rows are rows row0.. of the tile's (0 when absent).
    v_transposed: fp8 V pages [head_dim, page_size] each, landing whole in a [pages, head_dim, page_size]
    stage (a TMA copy needs contiguous shared memory): per page, p @ V's B operand is K-major, so one
    fp8 wgmma per page runs on the stage itself (p in e4m3, P_SHIFT), with no widening.
    Returns fp32 (out [ROWS, d] unnormalised, max [ROWS] in log2 units, sumexp [ROWS])."""
    k_smem, v_smem, p_smem, k_bar, v_bar, *wide = scratch
    page_size = k_ref.shape[2]
    block = k_smem.shape[1]
    pages_per_block = block // page_size
    head_dim = q_smem.shape[1]
    dtype = q_smem.dtype

    def fetch(i, slot):
        for j in range(pages_per_block):  # one TMA copy per page, all on the stage's barriers
            page = table_ref[first_page + i * pages_per_block + j]
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[kv_head, page], k_smem.at[slot, rows], k_bar.at[slot])
            v_dst = v_smem.at[slot, j] if v_transposed else v_smem.at[slot, rows]
            plgpu.copy_gmem_to_smem(v_ref.at[kv_head, page], v_dst, v_bar.at[slot])

    num_blocks = tiling.cdiv(num_keys, block)
    wg, consumed, sync = team or (0, None, None)
    pos0, tile, row0 = (*causal, 0)[:3] if causal is not None else (None, None, None)

    @pl.when((num_blocks > 0) & (wg == 0))
    def _():
        fetch(0, 0)

    wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), wgmma_rows)
    l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), wgmma_rows)
    acc = plgpu.layout_cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def body(i, carry, masked):
        acc, m, l = carry
        slot = lax.rem(i, STAGES)

        @pl.when((i + 1 < num_blocks) & (wg == 0))  # the other stage was consumed by step i - 1's wgmmas
        def _():
            if team:  # ... of both warpgroups
                @pl.when(i >= 1)
                def _():
                    plgpu.barrier_wait(consumed.at[1 - slot])
            fetch(i + 1, 1 - slot)

        plgpu.barrier_wait(k_bar.at[slot])
        k_op = _widened(k_smem.at[slot], wide[0], dtype) if wide else k_smem.at[slot]

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_op.transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, block), jnp.float32))
        if masked and row_limits:  # one compare per score against its row's key count in this block
            col = plgpu.broadcasted_iota(jnp.int32, (ROWS, block), 1, layout=plgpu.Layout.WGMMA)
            if causal is not None:
                row = row0 + plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=wgmma_rows)
                limit = jnp.minimum(num_keys, pos0 + lax.rem(row, tile) + 1) - i * block
                ok = col < lax.broadcast_in_dim(limit, s.shape, [0])
            else:
                ok = col < num_keys - i * block
            s = jnp.where(ok, s * (scale * LOG2E), MASK_VALUE)
        elif masked:
            key = i * block + plgpu.broadcasted_iota(jnp.int32, (ROWS, block), 1, layout=plgpu.Layout.WGMMA)
            ok = key < num_keys
            if causal is not None:
                row = row0 + plgpu.broadcasted_iota(jnp.int32, (ROWS, block), 0, layout=plgpu.Layout.WGMMA)
                ok = ok & (key <= pos0 + lax.rem(row, tile))
            s = jnp.where(ok, s * (scale * LOG2E), MASK_VALUE)  # log2 units: exp2 below
        else:  # a block every row sees whole
            s = s * (scale * LOG2E)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new - P_SHIFT if v_transposed else m_new, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        v_op = _widened(v_smem.at[slot], wide[1], dtype) if wide and not v_transposed else v_smem.at[slot]

        if masked:
            # The last block's slots past num_keys may hold anything (even NaN): 0 * NaN would
            # reach the output through p @ v, so zero them in shared memory first.
            @pl.when((i + 1) * block > num_keys)
            def _():
                @pl.when(wg == 0)
                def _():
                    if v_transposed:  # pages [head_dim, page_size]: keys along the columns
                        col = plgpu.broadcasted_iota(jnp.int32, (head_dim, page_size), 1, layout=plgpu.Layout.WGMMA)
                        for j in range(pages_per_block):
                            page = v_op.at[j]
                            live = i * block + j * page_size + col < num_keys
                            # (no 8-bit select: through f16, exact for fp8; the last block only)
                            x = page[...].astype(jnp.float16)
                            page[...] = jnp.where(live, x, jnp.zeros((), x.dtype)).astype(page.dtype)
                    else:
                        row = plgpu.broadcasted_iota(jnp.int32, (block, head_dim), 0, layout=plgpu.Layout.WGMMA)
                        v_op[...] = jnp.where(i * block + row < num_keys, v_op[...], jnp.zeros((), dtype))
                    plgpu.commit_smem()

                if team:  # the other warpgroup's PV waits for the zeroes
                    plgpu.barrier_arrive(sync)
                    plgpu.barrier_wait(sync)

        # p goes through shared memory: the one wgmma form GPU interpret mode simulates, so
        # the path tested on the CPU is the path compiled (registers would save a round trip).
        p_smem[...] = p.astype(p_smem.dtype)  # e4m3 with transposed fp8 V
        plgpu.commit_smem()

        def pv(acc_ref):
            if v_transposed:  # one fp8 wgmma per page: its keys are a K group of p's columns
                for j in range(pages_per_block):
                    plgpu.wgmma(acc_ref, p_smem.at[:, pl.ds(j * page_size, page_size)], v_op.at[j].transpose((1, 0)))
            else:
                plgpu.wgmma(acc_ref, p_smem, v_op)
            return acc_ref[...]

        # A fresh accumulator, added in registers (interpret mode has no run_state over ACC refs).
        acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
        if team:  # this warpgroup's wgmmas are done with the stage
            plgpu.barrier_arrive(consumed.at[slot])
        return acc, m_new, l

    carry = (acc, m, l)
    if not isinstance(num_full, int) or num_full:
        num_full = jnp.minimum(num_full, num_blocks)
        carry = lax.fori_loop(0, num_full, functools.partial(body, masked=False), carry)
    else:
        num_full = 0
    carry = lax.fori_loop(num_full, num_blocks, functools.partial(body, masked=True), carry)
    if team:  # warpgroup 0 observes the last two blocks' consumption too (every phase it waits on)

        @pl.when(wg == 0)
        def _():
            def drain(k, _):
                plgpu.barrier_wait(consumed.at[lax.rem(k, STAGES)])

            lax.fori_loop(jnp.maximum(num_blocks - STAGES, 0), num_blocks, drain, None)
    return carry


def _widened(stage, wide, dtype):
    """An fp8 stage's block copied into `wide` in `dtype`, ready for wgmma. Through f32: sm_90's
    converts take fp8 to f16 only, and fp8 values are exact in f32, f16 and bf16 alike."""
    x = stage[...]
    wide[...] = x.astype(jnp.float16) if dtype == jnp.float16 else x.astype(jnp.float32).astype(dtype)
    plgpu.commit_smem()
    return wide


def _wgmma_smem(shape, dtype, swizzle=None):
    """A wgmma (or TMA) operand in shared memory: swizzled (8, swizzle / itemsize) tiles, the
    swizzle (bytes) as wide as a row up to 128 bytes unless given (jax 0.10 wants them spelled out;
    0.11 would infer them)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = swizzle or min(128, shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def _block_keys(page_size, block_keys=None):
    """Keys per pipeline step: `block_keys` (default MIN_BLOCK_KEYS; a multiple of 64), at least a
    page, and a whole number of pages."""
    block = max(block_keys or MIN_BLOCK_KEYS, page_size)
    if block % 64 or block % page_size:
        raise ValueError(f"block_keys={block_keys} with page size {page_size}: need a multiple of 64 and of the page")
    return block


def _scratch(head_dim, page_size, dtype, page_dtype, block, v_transposed=False):
    """q, K and V stages (in the pages' dtype), p, the stages' barriers, and for fp8 pages the
    K and V blocks widened to q's dtype. v_transposed: V stages [pages, head_dim, page_size] and p in
    e4m3, both swizzled by a page's row of keys (wgmma takes one swizzle for both operands), and K's
    widened block only."""
    pages = _wgmma_smem((STAGES, block, head_dim), page_dtype)
    # Every page's copy arrives on its stage's barrier: it completes when all have landed.
    barrier = plgpu.Barrier(num_arrivals=block // page_size, num_barriers=STAGES)
    if v_transposed:
        swizzle = min(128, page_size)  # bytes: fp8
        v_pages = _wgmma_smem((STAGES, block // page_size, head_dim, page_size), page_dtype, swizzle)
        p = _wgmma_smem((ROWS, block), jnp.float8_e4m3fn, swizzle)
        return (_wgmma_smem((ROWS, head_dim), dtype), pages, v_pages, p, barrier, barrier,
                _wgmma_smem((block, head_dim), dtype))
    wide = () if page_dtype == dtype else (_wgmma_smem((block, head_dim), dtype),) * 2
    return (_wgmma_smem((ROWS, head_dim), dtype), pages, pages, _wgmma_smem((ROWS, block), dtype), barrier, barrier,
            *wide)


def check_v_transposed(k_pages, v_pages):
    """ValueError unless the pages can take the transposed fp8 V path: fp8 pages, V
    [kv heads, pages, head_dim, page_size] with pages of a multiple of 32 keys (a page's row of
    keys is a whole swizzle row for TMA and fp8 wgmma, which has no 16-byte swizzle)."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    if k_pages.dtype not in FP8 or v_pages.shape != (num_kv_heads, num_pages, head_dim, page_size):
        raise ValueError(f"v_transposed takes fp8 pages, V as [kv heads, pages, head_dim, page]; got {k_pages.dtype} "
                         f"K {k_pages.shape}, V {v_pages.shape}")
    if page_size % 32:
        raise ValueError(f"Mosaic's v_transposed needs a page size that is a multiple of 32 (fp8 wgmma's "
                         f"swizzle), got {page_size}: use 'pallas'")


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "interpret", "mask_diagonal_only", "share_smem",
                                             "v_transposed"))
def paged_attention_mosaic(q, k_pages, v_pages, block_tables, context_lens, *, scale=None, num_splits=None,
                           interpret=False, mask_diagonal_only=False, share_smem=False, v_transposed=False):
    """Decode attention (see pallas_kernels.paged_attention) on Mosaic GPU. Variants for
    bench_kernels: mask_diagonal_only (only the block holding a split's last key is masked, with the
    per-row mask), share_smem (the K/V stages, p and the fp8 widening buffers live in a scope of
    their own, and the f32 output's 32 KB staging buffer reuses their memory after the loop:
    sm_90 compile for head_dim 128, 93 KB of shared memory instead of 124 KB, 2 programs per SM
    instead of 1), v_transposed (fp8 V pages stored [head_dim, page_size]: the PV wgmma in fp8 on
    the TMA's stage, p in e4m3; check_v_transposed)."""
    check_supported(q, k_pages)
    if v_transposed:
        check_v_transposed(k_pages, v_pages)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    block = _block_keys(page_size)
    pages_per_block = block // page_size
    tables, splits, per_split = tiling.split_tables(block_tables, num_pages, num_seqs * num_kv_heads, pages_per_block,
                                                    num_splits)
    qp = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))
    scale = default_scale(scale, head_dim)
    # fp8 pages with bf16 q: widen to f16 and run wgmma in f16 (sm_90 converts two fp8 values to f16
    # in one instruction; bf16 took a cvt to f32 per value and a pack more), q over a power of two
    # in f16's range (blocks.to_f16_range), taken back in the scores.
    if blocks.fp8_compute_dtype(q.dtype, k_pages.dtype) != q.dtype:
        qp, factor = blocks.to_f16_range(qp)
    else:
        factor = jnp.ones((1,), jnp.float32)

    q_type, *loop_types = _scratch(head_dim, page_size, qp.dtype, k_pages.dtype, block, v_transposed)
    out_types = (plgpu.SMEM((ROWS, head_dim), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32),
                 plgpu.SMEM((ROWS,), jnp.float32))

    def kernel(ctx_ref, factor_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *scratch):
        h, s, split = lax.axis_index("kv_head"), lax.axis_index("seq"), lax.axis_index("split")
        span = per_split * page_size
        num_keys = jnp.clip(ctx_ref[s] - split * span, 0, span)

        def attend(q_smem, *loop_scratch):
            return _attend(q_smem, k_ref, v_ref, table_ref.at[s], h, split * per_split, num_keys,
                           scale * factor_ref[0], None, loop_scratch,
                           num_full=num_keys // block if mask_diagonal_only else 0, row_limits=mask_diagonal_only,
                           v_transposed=v_transposed)

        def write(acc, m, l, o_smem, m_smem, l_smem):
            o_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[split, s, h])
            plgpu.copy_smem_to_gmem(m_smem, m_ref.at[split, s, h])
            plgpu.copy_smem_to_gmem(l_smem, l_ref.at[split, s, h])
            plgpu.wait_smem_to_gmem(0)

        if share_smem:  # the loop's buffers, then the output's, in the same memory
            q_bar, q_smem = scratch
        else:
            *out_smem, q_bar, q_smem = scratch[:5]
        plgpu.copy_gmem_to_smem(q_ref.at[s, h], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        if share_smem:
            acc, m, l = pl.run_scoped(functools.partial(attend, q_smem), *loop_types)
            pl.run_scoped(functools.partial(write, acc, m, l), *out_types)
        else:
            write(*attend(q_smem, *scratch[5:]), *out_smem)

    stat = jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, ROWS), jnp.float32)
    out, m, l = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, group, head_dim), jnp.float32), stat, stat),
        scratch_types=((plgpu.Barrier(), q_type) if share_smem else (*out_types, plgpu.Barrier(), q_type, *loop_types)),
        grid=(num_kv_heads, num_seqs, splits),
        grid_names=("kv_head", "seq", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(interpret),
        kernel_name="jpaged_decode_mosaic",
    )(context_lens.astype(jnp.int32), factor, tables, qp, k_pages, v_pages)
    # m is in log2 units: the merge only compares and exponentiates differences.
    out = tiling.combine_splits(out, m[..., :group] / LOG2E, l[..., :group])
    return out.reshape(q.shape).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_keys", "mask_diagonal_only"))
def ragged_paged_attention_mosaic(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale=None,
                                  interpret=False, block_keys=None, mask_diagonal_only=False):
    """Ragged prefill (see pallas_kernels.ragged_paged_attention) on Mosaic GPU. Variants for
    bench_kernels to time (FlashAttention-3's choices): block_keys (keys per pipeline step, default
    MIN_BLOCK_KEYS; 128 halves the per-block overheads but needs 176 KB of shared memory, one program
    per SM instead of two) and mask_diagonal_only (blocks that every row of a tile sees whole, all
    below the tile's first query, skip the mask's iota, compares and selects). Either takes the
    per-row mask (_attend's row_limits); the default is the kernel as measured on 2026-11-28."""
    check_supported(q, k_pages)
    head_dim, (num_kv_heads, _, page_size, _) = q.shape[2], k_pages.shape
    tables, seq, pos0, num_keys, qt, tile, block = query_tiles(
        q, k_pages, block_tables, context_lens, query_start_loc, ROWS, block_keys)
    num_tiles = seq.shape[0]
    qt = qt.reshape(num_tiles, num_kv_heads, ROWS, head_dim)
    scale = default_scale(scale, head_dim)

    def kernel(seq_ref, pos0_ref, keys_ref, table_ref, q_ref, k_ref, v_ref, o_ref, o_smem, q_bar, q_smem, *scratch):
        h, j = lax.axis_index("kv_head"), lax.axis_index("tile")
        plgpu.copy_gmem_to_smem(q_ref.at[j, h], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        num_keys = keys_ref[j]
        # Keys up to the tile's first position are seen by every row (num_keys is past it for a
        # tile with a real row, 0 for an empty one).
        num_full = jnp.minimum(pos0_ref[j] + 1, num_keys) // block if mask_diagonal_only else 0
        acc, _, l = _attend(q_smem, k_ref, v_ref, table_ref.at[seq_ref[j]], h, 0, num_keys, scale,
                            (pos0_ref[j], tile), scratch, num_full=num_full,
                            row_limits=mask_diagonal_only or block_keys is not None)
        l = jnp.where(l > 0, l, 1.0)  # empty tiles stay zero
        o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[j, h])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        scratch_types=(_wgmma_smem((ROWS, head_dim), q.dtype), plgpu.Barrier(),
                       *_scratch(head_dim, page_size, q.dtype, k_pages.dtype, block)),
        grid=(num_kv_heads, num_tiles),
        grid_names=("kv_head", "tile"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(interpret),
        kernel_name="jpaged_ragged_prefill_mosaic",
    )(seq, pos0, num_keys, tables, qt, k_pages, v_pages)
    return tokens_from_tiles(out, q, query_start_loc, tile)


def query_tiles(q, k_pages, block_tables, context_lens, query_start_loc, rows: int, block_keys):
    """A ragged prefill's plan in tiles of `rows` query rows (tile = rows / next_pow2(group) tokens
    times the group's heads, head-major, the group padded to a power of two): the tables, each
    tile's sequence, first position and keys, the query tiles [tiles, kv heads, padded group,
    tile, head_dim], the tile's tokens and the keys per pipeline block."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    gp = tiling.next_pow2(group)
    tile = rows // gp
    block = _block_keys(page_size, block_keys)
    tables, (seq, tok0, pos0, n_rows), num_keys, _ = tiling.ragged_plan(
        block_tables, num_pages, page_size, block // page_size, query_start_loc, context_lens, num_tokens, tile)
    num_tiles = seq.shape[0]
    qt = tiling.gather_query_tiles(q, tok0, n_rows, tile)
    qt = qt.reshape(num_tiles, tile, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, gp - group), (0, 0), (0, 0)))
    return tables, seq, pos0, num_keys, qt, tile, block


def tokens_from_tiles(out, q, query_start_loc, tile: int):
    """query_tiles' layout back to q's [tokens, heads, head_dim] (the padded heads dropped)."""
    num_tokens, num_heads, head_dim = q.shape
    num_tiles, num_kv_heads = out.shape[:2]
    group = num_heads // num_kv_heads
    out = out.reshape(num_tiles, num_kv_heads, tiling.next_pow2(group), tile, head_dim)[:, :, :group]
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_tiles, tile, num_heads, head_dim)
    return tiling.scatter_tiles_to_tokens(out, query_start_loc, num_tokens, tile)
