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

Slots past the context may hold anything (NaN too), so each block zeroes
them in V before p @ V. (A variant that skipped that select in the blocks
holding only the sequence's keys, `peel_tail`, measured 1.3-2x slower on an
H200 at 32k contexts: 145 registers, 3 programs per SM. It is back as an option for transposed
V pages, `v_transposed`, where the unselected fp8 V goes into the MMA by ldmatrix: 128 registers,
4 programs per SM; docs/PERF.md, "fp8 V pages stored transposed".)
fp8 pages with bf16 queries run their dots in f16
(blocks.fp8_compute_dtype: one conversion per two values instead of three
instructions per value through bf16), q brought within f16's range by a
power of two that the scores take back.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks, tiling
from pallas_kernels.targets import gpu_device
from pallas_kernels.xla import default_scale

# Triton's pipelining depth. With the next block's page ids carried through the loop, 3 stages keep
# one block's K/V copies in flight while the previous one computes (sm_90 SASS: the loop waits with
# `DEPBAR.LE SB0, 0x2` instead of 0x0). fp8 pages: 55 KB of shared memory, 98 registers, 4 programs
# per SM, always 3 stages. 16-bit pages at 3 stages need 88 KB (2 programs per SM instead of 4), so
# their depth follows the grid (decode_stages).
STAGES = 2
FP8_STAGES = 3
DEEP_STAGES = 3
# Measured basis (H200, 132 SMs, jax 0.11.2, bench_kernels --quick, 2026-11-28 17:27 UTC; docs/PERF.md
# "Second GPU run"): bf16 pages, 32/8 heads, head_dim 128, page 16. At batch 8 x 32k the grid is
# 8 x 8 x 4 splits = 256 programs: 3 stages took 352.7 us against 2 stages' 382.3 (8% faster). At
# 64 x 32k it is 64 x 8 x 1 = 512 programs: 3 stages took 2,628.9 us against 2,462.8 (7% slower).
# At 3 stages an SM holds 2 programs (88 KB each), so up to 2 x SMs programs (264 on an H200) run in
# one wave: there the deeper pipeline costs no occupancy that the grid would have used; past it,
# 4 programs per SM at 2 stages hide more latency. Applied on sm_90 only, where it was measured.
DEEP_PROGRAMS_PER_SM = 2
HOPPER_SMS = 132  # an H100 / H200 SXM, when the device does not say


def decode_stages(num_programs: int, page_itemsize: int, gpu=None, sm_count=None) -> int:
    """Triton's num_stages for a decode grid of `num_programs` programs: FP8_STAGES for 1-byte pages;
    16-bit pages DEEP_STAGES on sm_90 (`gpu`: (kind, compute capability), targets.gpu_device()) when
    the grid fits one wave of DEEP_PROGRAMS_PER_SM programs per SM (`sm_count`, default HOPPER_SMS),
    else STAGES."""
    if page_itemsize == 1:
        return FP8_STAGES
    if gpu is None or not 9.0 <= gpu[1] < 10.0:
        return STAGES
    return DEEP_STAGES if num_programs <= DEEP_PROGRAMS_PER_SM * (sm_count or HOPPER_SMS) else STAGES


def _target():
    """(gpu, SM count) of the GPU being compiled for: (None, None) off a GPU."""
    gpu = gpu_device()
    if gpu is None:
        return None, None
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        device = jax.devices()[0]
        return gpu, getattr(device, "core_count", None)
    return gpu, getattr(device, "num_cores", None)


def _decode_kernel(ctx_ref, window_ref, factor_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *stat_refs, scale,
                   head_dim, pages_per_iter, soft_cap, v_transposed=False, peel_tail=False):
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
    scale = scale * factor_ref[0]  # q came over a power of two (f16's range), 1 otherwise

    last = table_ref.shape[0] // pages_per_iter - 1

    def body(i, state, mask_v=True):
        carry, ids = state
        # The next block's page ids, read now: its K/V copies need not wait for them, so Triton's
        # pipeline (num_stages 3) has them in flight while this block computes.
        next_ids = table_ref[pl.ds(jnp.minimum(i + 1, last) * pages_per_iter, pages_per_iter)]
        k = blocks.load_pages(k_ref, ids, head_dim, q.dtype)  # fp8 pages: widened in registers
        if v_transposed:
            v = blocks.load_pages_transposed(v_ref, ids, head_dim, q.dtype)
        else:
            v = blocks.load_pages(v_ref, ids, head_dim, q.dtype)
        key = i * block + jnp.arange(block)
        carry = blocks.attend_block(carry, q, k, v, (key >= start) & (key < num_keys), scale, soft_cap=soft_cap,
                                    v_transposed=v_transposed, mask_v=mask_v)
        return carry, next_ids

    first, end = start // block, tiling.cdiv(num_keys, block)
    ids = table_ref[pl.ds(jnp.minimum(first, last) * pages_per_iter, pages_per_iter)]
    state = (blocks.init_carry(rows, dp), ids)
    if peel_tail:  # blocks of the sequence's keys alone (V unselected: no slot past the context), then the last
        full = jnp.maximum(first, num_keys // block)
        state = lax.fori_loop(first, full, functools.partial(body, mask_v=False), state)
        first = full
    (out, m, l), _ = lax.fori_loop(first, end, body, state)
    if stat_refs:  # split-K partial: combined outside
        m_ref, l_ref = stat_refs
        o_ref[...] = out
        m_ref[...] = m
        l_ref[...] = l
    else:
        o_ref[...] = blocks.normalize(out, l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "interpret", "logits_soft_cap", "fp8_as_bits",
                                             "num_stages", "v_transposed", "peel_tail"))
def paged_attention_pallas(
    q, k_pages, v_pages, block_tables, context_lens, *, scale=None, num_splits=None, interpret=False,
    sliding_window=None, logits_soft_cap=None, fp8_as_bits=None, num_stages=None, v_transposed=False,
    peel_tail=False
):
    """fp8_as_bits: e4m3 pages read as bytes and widened by arithmetic (None: below sm_89 only).
    num_stages: Triton's software pipelining depth (None: decode_stages' rule for the grid and
    the target GPU); bench_kernels times 2 and 3 against it. v_transposed: v_pages are
    [num_kv_heads, num_pages, head_dim, page_size] (cache_ops.write_kv(v_transposed=True)), so
    p @ V's operand has its keys contiguous (K-major: ldmatrix for fp8, no byte loads). peel_tail:
    the blocks before the one holding the context's end run without V's select (module docstring;
    with v_transposed, fp8 V then goes from shared memory straight into the MMA's registers)."""
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
    if blocks.fp8_compute_dtype(q.dtype, k_pages.dtype) != q.dtype:  # fp8 pages, bf16 q: dots in f16
        qp, factor = blocks.to_f16_range(qp)
    else:
        factor = jnp.ones((1,), jnp.float32)

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
    v_spec = pl.BlockSpec((None, num_pages, dp, page_size), lambda s, h, k: (h, 0, 0, 0)) if v_transposed else page_spec
    kernel = functools.partial(
        _decode_kernel, scale=default_scale(scale, head_dim), head_dim=head_dim, pages_per_iter=pages_per_iter,
        soft_cap=logits_soft_cap, v_transposed=v_transposed, peel_tail=peel_tail,
    )
    window = jnp.full((1,), blocks.NO_WINDOW if sliding_window is None else sliding_window, jnp.int32)
    res = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((num_seqs,), lambda s, h, k: (0,)),
            pl.BlockSpec((1,), lambda s, h, k: (0,)),
            pl.BlockSpec((1,), lambda s, h, k: (0,)),
            pl.BlockSpec((None, per_split), lambda s, h, k: (s, k)),
            pl.BlockSpec((None, None, rows, dp), lambda s, h, k: (s, h, 0, 0)),
            page_spec,
            v_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=num_stages or decode_stages(
            num_seqs * num_kv_heads * splits, jnp.dtype(k_pages.dtype).itemsize, *_target())),
        interpret=interpret,
        name="jpaged_decode",
    )(context_lens.astype(jnp.int32), window, factor, tables, qp, k_pages, v_pages)
    out = tiling.combine_splits(*res) if part else res[0][0]
    out = out[:, :, :group, :head_dim].reshape(q.shape)
    return out.astype(q.dtype)
