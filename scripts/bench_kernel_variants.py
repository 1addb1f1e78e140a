"""bench_kernels' variants: kernel flags a GPU run times beside each family's default (a compile
each), and the table that reads each against its default ("Variants against their default").

- Triton decode, 16-bit pages: 2 and 3 pipeline stages, forced. The default follows the grid
  (decode.decode_stages: 3 stages on sm_90 when the grid fits one wave of 2 programs per SM, as at
  8 x 32k; else 2): its row equals one of them.
- Triton decode, fp8 pages: the old 2 stages (the default is 3 since issue 66); V pages stored
  transposed (`vT`: cache_ops' v_transposed layout, the full blocks without V's select, so fp8 V
  goes from shared memory into the MMA by ldmatrix; `vT,select`: every block selects, as the
  default does).
- Mosaic prefill (FlashAttention-3's choices): the mask only on the blocks a tile's diagonal
  crosses (`diag`), 128-key blocks (`keys=128`: 176 KB of shared memory, 1 program per SM instead
  of 2), and both; two warpgroups sharing the K/V stages (`2wg`: mosaic_wide.py, 128 rows a
  program, the diagonal-only mask), at 64 and 128 keys.
- Mosaic decode, 16-bit and fp8 pages: the output's staging buffer in the loop buffers' memory
  (`2/SM`: 93 KB of shared memory instead of 124 KB, 2 programs per SM instead of 1), alone and
  with only each split's last block masked. fp8 pages, V transposed (`vT,page=32`: PV as an fp8
  wgmma on the TMA's stage, p in e4m3; Mosaic takes it at pages of a multiple of 32 keys), beside
  the default kernel on the same pages of 32 (`page=32`), which tells the page size's share.
"""

import jax
import jax.numpy as jnp

VARIANTS = {"pallas[stages=2]": dict(num_stages=2), "pallas[stages=3]": dict(num_stages=3)}
FP8_VARIANTS = {"pallas[stages=2]": dict(num_stages=2)}
FP8_VT_VARIANTS = {"pallas[vT]": dict(v_transposed=True, peel_tail=True), "pallas[vT,select]": dict(v_transposed=True)}
MOSAIC_PREFILL_VARIANTS = {"mosaic[diag]": dict(mask_diagonal_only=True), "mosaic[keys=128]": dict(block_keys=128),
                           "mosaic[keys=128,diag]": dict(block_keys=128, mask_diagonal_only=True),
                           "mosaic[2wg,diag]": dict(wide=True), "mosaic[2wg,keys=128,diag]": dict(wide=True, block_keys=128)}
MOSAIC_DECODE_VARIANTS = {"mosaic[2/SM]": dict(share_smem=True),
                          "mosaic[2/SM,diag]": dict(share_smem=True, mask_diagonal_only=True)}
MOSAIC_VT_PAGE = 32  # the least page Mosaic's transposed-V decode takes
MOSAIC_FP8_PAGE_VARIANTS = {f"mosaic[page={MOSAIC_VT_PAGE}]": dict(),
                            f"mosaic[vT,page={MOSAIC_VT_PAGE}]": dict(v_transposed=True)}
VARIANT_MIN_CONTEXT = 4096  # the quick grid's points


def decode_variants(args, fp8_args, kv_cache_dtype, interpret, fp8_inputs_at):
    """name -> (jitted fn, its arguments) for a decode point: `args` the 16-bit pages' (q, k, v,
    tables, lens), `fp8_args` the same pages in fp8 (None without --kv-cache-dtype);
    fp8_inputs_at(page) -> (q, k, v, tables, lens) in fp8 at another page size (new data, same
    shape), made only when a variant needs it."""
    from pallas_kernels.cache_ops import transpose_v_pages
    from pallas_kernels.decode import paged_attention_pallas
    from pallas_kernels.mosaic import paged_attention_mosaic

    def variant(kernel, kw):
        return jax.jit(lambda *a: kernel(*a, interpret=interpret, **kw))

    def v_transposed(a):
        return (*a[:2], transpose_v_pages(a[2]), *a[3:])

    impls = {name: (variant(paged_attention_pallas, kw), args) for name, kw in VARIANTS.items()}
    impls |= {name: (variant(paged_attention_mosaic, kw), args) for name, kw in MOSAIC_DECODE_VARIANTS.items()}
    if fp8_args is None:
        return impls
    suffix = f" {kv_cache_dtype}"
    impls |= {name + suffix: (variant(paged_attention_pallas, kw), fp8_args) for name, kw in FP8_VARIANTS.items()}
    transposed = v_transposed(fp8_args)
    impls |= {name + suffix: (variant(paged_attention_pallas, kw), transposed) for name, kw in FP8_VT_VARIANTS.items()}
    impls |= {name + suffix: (variant(paged_attention_mosaic, kw), fp8_args)
              for name, kw in MOSAIC_DECODE_VARIANTS.items()}
    paged = fp8_inputs_at(MOSAIC_VT_PAGE)
    impls |= {name + suffix: (variant(paged_attention_mosaic, kw), v_transposed(paged) if kw else paged)
              for name, kw in MOSAIC_FP8_PAGE_VARIANTS.items()}
    return impls


def prefill_variants(paged, interpret):
    """name -> (jitted fn, arguments) for a prefill point over `paged` (ragged_paged_attention's)."""
    from pallas_kernels import mosaic, mosaic_wide

    def prefill_variant(wide=False, **kw):
        fn = mosaic_wide.ragged_paged_attention_mosaic_wide if wide else mosaic.ragged_paged_attention_mosaic
        return jax.jit(lambda *a: fn(*a, interpret=interpret, **kw))

    return {name: (prefill_variant(**kw), paged) for name, kw in MOSAIC_PREFILL_VARIANTS.items()}


def default_stages(batch, context, kv_heads, grid, itemsize):
    """(num_stages, programs) the Triton decode kernel's default picks for a point (decode.decode_stages
    over its grid, on the GPU jax runs on)."""
    from pallas_kernels import blocks, decode, tiling

    per_iter = max(1, blocks.KEYS_PER_ITER // grid["page"])
    programs = batch * kv_heads * tiling.auto_num_splits(batch * kv_heads, context // grid["page"], per_iter)
    return decode.decode_stages(programs, itemsize, *decode._target()), programs


def print_variants(rows, grid):
    """Each variant (an impl named `family[...]`, fp8 ones with the dtype after) against its family's
    default at the same point: time and ratio (below 1: the variant is faster), and for Triton decode
    the depth its default took there."""
    variants = [r for r in rows if "[" in r["impl"]]
    if not variants:
        return
    print("\nVariants against their default (ratio < 1: the variant is faster)")
    print("| phase | batch x context | variant | µs | default | default µs | variant / default |")
    print("|---|---|---|---|---|---|---|")
    for r in variants:
        base = r["impl"][:r["impl"].index("[")] + r["impl"][r["impl"].index("]") + 1:]
        ref = next((x for x in rows if x["kind"] == r["kind"] and x["impl"] == base
                    and (x["batch"], x["context"]) == (r["batch"], r["context"])), None)
        label = base
        if base.startswith("pallas") and r["kind"] == "decode":
            itemsize = 1 if base != "pallas" else jnp.dtype(grid["dtype"]).itemsize
            stages, programs = default_stages(r["batch"], r["context"], r["kv_heads"], grid, itemsize)
            label = f"{base} (stages={stages}, {programs} programs)"
        ok = ref is not None and not isinstance(ref["seconds"], str) and not isinstance(r["seconds"], str)
        cells = (f"{r['seconds'] * 1e6:.1f} | {label} | {ref['seconds'] * 1e6:.1f} | {r['seconds'] / ref['seconds']:.3f}"
                 if ok else f"{r['seconds'] if isinstance(r['seconds'], str) else '-'} | {label} | - | -")
        print(f"| {r['kind']} | {r['batch']} x {r['context']} | {r['impl']} | {cells} |")
