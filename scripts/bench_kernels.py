"""Benchmark the paged attention kernels against their peers.

Decode: for each (batch, context, heads/kv_heads) point it times, on the same data:
  pallas      pallas_kernels.paged_attention, Triton kernel (interpret mode off-GPU)
  mosaic      the Mosaic GPU kernel (sm_90+; off-GPU jax >= 0.11's GPU interpret mode)
  xla         pallas_kernels.paged_attention_xla (gather pages + attention)
  contiguous  dense einsum/softmax over contiguous [B, kvh, L, d] K/V (the
              paper's non-paged FasterTransformer-style comparison)
  contiguous cudnn  (GPU only) cuDNN's attention over contiguous [B, L, kvh, d] K/V,
              jax.nn.dot_product_attention(implementation="cudnn"); its error if cuDNN
              refuses the shape
  jax_peer    jax.experimental.pallas.ops.gpu.paged_attention, if importable
              (needs pages_per_seq % k_splits == 0; same page layout)
and prints a markdown table with microseconds, achieved GB/s (bytes read + written:
K/V once, q, the block tables and lengths, the output; / time) and that rate as % of
a device-to-device copy's, measured in the same run and counted the same way (bytes
read + written by an in-place `x + 1` over a 1 GiB buffer on a GPU, after a warm-up;
the median of several timed batches).

With --kv-cache-dtype, each kernel also decodes from the same pages in fp8 (`pallas fp8`, ...),
its GB/s counted on the fp8 bytes, and the table's `fp8/bf16` column gives its time over the same
kernel's on the 16-bit pages (fp8 halves the bytes: 0.5 is the bandwidth bound).

Prefill (ragged_paged_attention, one causal prompt per sequence, all of its K/V in the
pages): pallas, mosaic and xla against dense causal attention on contiguous K/V
(jax.nn.dot_product_attention with implementation="cudnn", cuDNN's flash attention, on a GPU
when it takes the shape and dtype (fp16/bf16); else implementation="xla", the table's row then
says `dense xla` and a note under it why), in TFLOP/s (causal: 2 * batch * heads * L^2 *
head_dim flops).

Last, a summary per point: each family's % of the copy rate and fp8/bf16 ratio, the faster
family measured here against the one attention_backend="auto" picks (pallas_kernels/choice.py's
table, from an earlier run: update it when they disagree), and prefill against cuDNN.

  python scripts/bench_kernels.py            # GPU grid (CPU: tiny grid)
  python scripts/bench_kernels.py --quick    # a few long-context points (scripts/gpu_check.sh)
  python scripts/bench_kernels.py --tiny     # seconds, any backend
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pallas_kernels as pk  # noqa: E402
from bench_kernel_variants import VARIANT_MIN_CONTEXT, decode_variants, prefill_variants, print_variants  # noqa: E402

# The KV cache's fp8 names (jpaged.config.KV_CACHE_DTYPES, jpaged.models.kv_cache.FP8_DTYPES), spelled
# out: importing jpaged needs packages a bare GPU image lacks (msgspec), and this runs there alone.
FP8_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}

GPU_GRID = dict(
    batch=[1, 8, 32, 64, 128, 256],
    context=[128, 1024, 4096, 16384, 32768],
    heads=[(32, 8), (64, 8)],
    head_dim=128,
    page=16,
    dtype=jnp.bfloat16,
    prefill=[(1, 2048), (1, 8192), (4, 2048), (2, 4096)],  # (batch, prompt length)
)
# One GPU call's worth (scripts/gpu_check.sh): long contexts, where decode is bandwidth-bound.
QUICK_GRID = dict(GPU_GRID, batch=[8, 64], context=[4096, 32768], heads=[(32, 8)], prefill=[(1, 2048), (1, 8192)])
# gpu_check's 1B workload (Llama-3.2-1B: head_dim 64; 512-token prompts, 128 sequences decoding at
# up to 640 tokens): the attention of issue 61's decode step at batch 128 and of its prefill chunks.
STEP_1B_GRID = dict(GPU_GRID, batch=[128], context=[640], heads=[(32, 8)], head_dim=64, prefill=[(4, 512)])
# bf16 and head_dim 64: shapes the Mosaic kernels take.
TINY_GRID = dict(batch=[1, 4], context=[32, 128], heads=[(4, 2)], head_dim=64, page=16, dtype=jnp.bfloat16,
                 prefill=[(2, 64)])


TIME_CAP_S = 0.5  # a point's timed calls stop at about this many seconds (slow rows: fewer calls)


def time_call(fn, *args, iters):
    """Mean seconds per call after warm-up (compile) calls: `iters` calls, fewer (at least 3) where
    they would take more than TIME_CAP_S."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    iters = max(3, min(iters, int(TIME_CAP_S / max(once, 1e-9))))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


COPY_BYTES = 1 << 30  # the copy reference's buffer on a GPU (smaller where less memory is free)


def copy_bytes(on_gpu: bool) -> int:
    """The copy reference's buffer size: 1 GiB on a GPU (at most a quarter of its free memory), 64 MiB
    off it (past any CPU cache, quick)."""
    if not on_gpu:
        return 64 << 20
    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return COPY_BYTES if free <= 0 else max(16 << 20, min(COPY_BYTES, free // 4))


def copy_bandwidth(nbytes, samples=10, reps=5, warmup_s=0.5):
    """Device memory rate of a copy in bytes/s, bytes read plus bytes written: `x + 1` over one
    buffer of `nbytes`, in place (donated: no allocation per call), after `warmup_s` seconds of the
    same (an idle GPU runs its memory clock low at first); the median of `samples` timings of
    `reps` calls each, each timing ended by block_until_ready."""
    step = jax.jit(lambda a: a + jnp.uint32(1), donate_argnums=0)
    x = jax.block_until_ready(jnp.zeros((nbytes // 4,), jnp.uint32))
    start = time.perf_counter()
    while True:  # compile, then warm up
        x = jax.block_until_ready(step(x))
        if time.perf_counter() - start >= warmup_s:
            break
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(reps):
            x = step(x)
        jax.block_until_ready(x)
        times.append((time.perf_counter() - start) / reps)
    moved = 2 * x.nbytes
    del x
    return moved / sorted(times)[len(times) // 2]


def contiguous_attention(q, k, v, lens):
    """q [B, H, d]; k, v [B, kvh, L, d]; dense masked softmax attention."""
    b, h, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d)
    s = jnp.einsum("bkgd,bkld->bkgl", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    s = jnp.where(jnp.arange(length) < lens[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgl,bkld->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, h, d).astype(q.dtype)


def contiguous_attention_cudnn(q, k, v, lens):
    """q [B, H, d]; k, v [B, L, kvh, d]: cuDNN's attention (jax.nn.dot_product_attention,
    implementation="cudnn"), keys past each sequence's length masked."""
    out = jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lens, implementation="cudnn")
    return out[:, 0]


def jax_peer(interpret, pages_per_seq):
    """jax's bundled Triton paged attention, or None (with the reason)."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as peer
    except ImportError as e:
        return None, f"import failed: {e}"
    splits = min(16, pages_per_seq & -pages_per_seq)  # largest pow2 divisor
    per_part = pages_per_seq // splits
    per_block = min(8, per_part & -per_part)

    def run(q, k_pages, v_pages, tables, lens):
        return peer.paged_attention(
            q, k_pages, v_pages, tables, lens, k_splits=splits, pages_per_compute_block=per_block, interpret=interpret
        )

    return jax.jit(run), None


def make_inputs(key, batch, context, heads, kv_heads, head_dim, page, dtype):
    pages_per_seq = context // page
    num_pages = batch * pages_per_seq
    kq, kk, kv, kp = jax.random.split(key, 4)
    shape = (kv_heads, num_pages, page, head_dim)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    q = jax.random.normal(kq, (batch, heads, head_dim), dtype)
    tables = jax.random.permutation(kp, num_pages).reshape(batch, pages_per_seq)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k_pages, v_pages, tables.astype(jnp.int32), lens


def time_impls(impls, iters):
    """name -> mean seconds, or the reason it failed (one failing must not stop the table)."""
    results = {}
    for name, (fn, args) in impls.items():
        try:
            results[name] = time_call(fn, *args, iters=iters)
        except Exception as e:
            results[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    return results


def dense_causal_attention(q, k, v, implementation="xla"):
    """q, k, v [B, L, heads or kv_heads, d] contiguous: jax.nn.dot_product_attention, causal."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def dense_reference(args, on_gpu):
    """(jitted dense causal attention, its implementation, why not cuDNN or None): cuDNN's flash
    attention where it compiles and runs for `args` (a GPU, fp16/bf16, a head_dim it takes), else
    XLA's."""
    xla = jax.jit(dense_causal_attention)
    if not on_gpu:
        return xla, "xla", "no GPU"
    dtype = jnp.dtype(args[0].dtype)
    if dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return xla, "xla", f"cuDNN's attention takes fp16/bf16, not {dtype.name}"
    cudnn = jax.jit(lambda q, k, v: dense_causal_attention(q, k, v, implementation="cudnn"))
    try:
        jax.block_until_ready(cudnn(*args))
    except Exception as e:  # refused at trace or compile time, or failed to run: say why
        return xla, "xla", f"cuDNN refused: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return cudnn, "cudnn", None


def bench_prefill(batch, length, heads, kv_heads, grid, iters, on_gpu=False, variants=True):
    """Each sequence one causal prompt of `length` tokens, its K/V already in the pages. Returns
    (name -> seconds or failure, the dense reference's implementation, why it is not cuDNN's)."""
    head_dim, page, dtype = grid["head_dim"], grid["page"], grid["dtype"]
    _, k_pages, v_pages, tables, lens = make_inputs(
        jax.random.PRNGKey(length + batch), batch, length, heads, kv_heads, head_dim, page, dtype
    )
    q = jax.random.normal(jax.random.PRNGKey(1), (batch * length, heads, head_dim), dtype)
    starts = jnp.arange(batch + 1, dtype=jnp.int32) * length
    gathered = jax.jit(lambda p, t: p[:, t].reshape(kv_heads, batch, length, head_dim).transpose(1, 2, 0, 3))
    k_dense, v_dense = gathered(k_pages, tables), gathered(v_pages, tables)
    paged = (q, k_pages, v_pages, tables, lens, starts)
    impls = {
        name: (jax.jit(lambda *a, b=name: pk.ragged_paged_attention(*a, backend=b)), paged)
        for name in ("pallas", "mosaic", "xla")
    }
    if variants:
        impls |= prefill_variants(paged, not on_gpu)
    dense_args = (q.reshape(batch, length, heads, head_dim), k_dense, v_dense)
    dense, implementation, why = dense_reference(dense_args, on_gpu)
    impls["dense"] = (dense, dense_args)
    return time_impls(impls, iters), implementation, why


def bench_point(batch, context, heads, kv_heads, grid, on_gpu, iters, kv_cache_dtype=None, variants=True):
    head_dim, page, dtype = grid["head_dim"], grid["page"], grid["dtype"]
    q, k_pages, v_pages, tables, lens = make_inputs(
        jax.random.PRNGKey(batch * 7 + context), batch, context, heads, kv_heads, head_dim, page, dtype
    )
    gathered = jax.jit(lambda p, t: p[:, t].reshape(kv_heads, batch, context, head_dim).transpose(1, 0, 2, 3))
    k_dense, v_dense = gathered(k_pages, tables), gathered(v_pages, tables)
    interpret = not on_gpu
    impls = {
        name: (jax.jit(lambda *a, b=name: pk.paged_attention(*a, backend=b)), (q, k_pages, v_pages, tables, lens))
        for name in ("pallas", "mosaic")
    }
    impls |= {
        "xla": (jax.jit(pk.paged_attention_xla), (q, k_pages, v_pages, tables, lens)),
        "contiguous": (jax.jit(contiguous_attention), (q, k_dense, v_dense, lens)),
    }
    if on_gpu:  # cuDNN's attention on the same contiguous K/V, in its [B, L, kvh, d] layout
        k_bthd, v_bthd = k_dense.transpose(0, 2, 1, 3), v_dense.transpose(0, 2, 1, 3)
        impls["contiguous cudnn"] = (jax.jit(contiguous_attention_cudnn), (q, k_bthd, v_bthd, lens))
    if kv_cache_dtype:  # the same pages in fp8 (the KV cache's kv_cache_dtype): half the bytes to read
        fp8 = FP8_DTYPES[kv_cache_dtype]
        k8, v8 = k_pages.astype(fp8), v_pages.astype(fp8)
        impls |= {
            f"{name} {kv_cache_dtype}": (jax.jit(lambda *a, b=name: pk.paged_attention(*a, backend=b)),
                                         (q, k8, v8, tables, lens))
            for name in ("pallas", "mosaic")
        }
        impls[f"xla {kv_cache_dtype}"] = (jax.jit(pk.paged_attention_xla), (q, k8, v8, tables, lens))
    if variants and (context >= VARIANT_MIN_CONTEXT or not on_gpu):
        def fp8_inputs_at(other_page):  # the same point over pages of another size, in fp8
            q2, k2, v2, t2, l2 = make_inputs(jax.random.PRNGKey(batch * 7 + context), batch, context, heads, kv_heads,
                                             head_dim, other_page, dtype)
            fp8 = FP8_DTYPES[kv_cache_dtype]
            return q2, k2.astype(fp8), v2.astype(fp8), t2, l2

        impls |= decode_variants((q, k_pages, v_pages, tables, lens),
                                 impls[f"pallas {kv_cache_dtype}"][1] if kv_cache_dtype else None, kv_cache_dtype,
                                 interpret, fp8_inputs_at)
    peer, why = jax_peer(interpret, context // page)
    if peer is not None:
        impls["jax_peer"] = (peer, (q, k_pages, v_pages, tables, lens))
    results = time_impls(impls, iters)
    if why:
        results["jax_peer"] = why
    del k_dense, v_dense, k_pages, v_pages, impls
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny grid (default when no GPU is present)")
    parser.add_argument("--quick", action="store_true", help="a few long-context points (GPU)")
    parser.add_argument("--step-1b", action="store_true",
                        help="the 1B workload's attention (batch 128 x 640, head_dim 64; prefill 4 x 512) (GPU)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=1 << 21, help="skip points with batch * context above this")
    parser.add_argument("--kv-cache-dtype", choices=sorted(FP8_DTYPES),
                        help="also decode from fp8 pages (their GB/s counted on the fp8 K/V bytes)")
    parser.add_argument("--no-variants", action="store_true",
                        help="time the families' defaults only (the variants add a compile each: about a minute on a GPU)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    tiny = args.tiny or not on_gpu
    grid = TINY_GRID if tiny else STEP_1B_GRID if args.step_1b else QUICK_GRID if args.quick else GPU_GRID
    iters = args.iters or (2 if tiny else 20)
    nbytes = copy_bytes(on_gpu)
    copy_bw = copy_bandwidth(nbytes, warmup_s=0.5 if on_gpu else 0.05)
    itemsize = jnp.dtype(grid["dtype"]).itemsize
    print(
        f"backend={jax.default_backend()} device={jax.devices()[0].device_kind}"
        f" dtype={jnp.dtype(grid['dtype']).name} head_dim={grid['head_dim']}"
        f" page={grid['page']} copy={copy_bw / 1e9:.1f} GB/s (bytes read + written, in-place x + 1 over"
        f" {nbytes / 2**30:.3g} GiB; GB/s below: each kernel's bytes read + written / time)"
        f"{' (pallas and mosaic in interpret mode)' if not on_gpu else ''}\n"
    )
    print("| batch | context | heads/kv | impl | µs | GB/s | % copy | fp8/bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for heads, kv_heads in grid["heads"]:
        for batch in grid["batch"]:
            for context in grid["context"]:
                if batch * context > args.max_tokens:
                    continue
                kv_bytes = 2 * batch * context * kv_heads * grid["head_dim"] * itemsize
                # besides K/V: q read, the output written (both in the grid's dtype), block tables and lengths read
                other_bytes = 2 * batch * heads * grid["head_dim"] * itemsize + 4 * batch * (context // grid["page"] + 1)
                res = bench_point(batch, context, heads, kv_heads, grid, on_gpu, iters, args.kv_cache_dtype,
                                  not args.no_variants)
                for impl, sec in res.items():
                    fp8 = args.kv_cache_dtype is not None and impl.endswith(f" {args.kv_cache_dtype}")
                    moved = (kv_bytes // itemsize if fp8 else kv_bytes) + other_bytes
                    row = dict(kind="decode", batch=batch, context=context, heads=heads, kv_heads=kv_heads, impl=impl,
                               seconds=sec, bytes=moved)
                    rows.append(row)
                    if isinstance(sec, str):
                        cells = f"{sec} | | | "
                    else:
                        rate = moved / sec
                        row["pct_copy"] = 100 * rate / copy_bw
                        wide = res.get(impl.removesuffix(f" {args.kv_cache_dtype}")) if fp8 else None
                        if isinstance(wide, float):
                            row["fp8_ratio"] = sec / wide
                        ratio = f"{row['fp8_ratio']:.2f}" if "fp8_ratio" in row else ""
                        cells = f"{sec * 1e6:.1f} | {rate / 1e9:.1f} | {row['pct_copy']:.0f} | {ratio}"
                    print(f"| {batch} | {context} | {heads}/{kv_heads} | {impl} | {cells} |", flush=True)
    print("\n| batch | prompt | heads/kv | impl | ms | TFLOP/s | % dense |")
    print("|---|---|---|---|---|---|---|")
    heads, kv_heads = grid["heads"][0]
    notes = {}  # why the dense reference is XLA's -> the points it was
    for batch, length in grid["prefill"]:
        flops = 2 * batch * heads * length * length * grid["head_dim"]  # QK^T and PV, causal half
        res, implementation, why = bench_prefill(batch, length, heads, kv_heads, grid, iters, on_gpu,
                                                 not args.no_variants)
        if why:
            notes.setdefault(why, []).append(f"{batch}x{length}")
        dense = res.get("dense")
        for impl, sec in res.items():
            row = dict(kind="prefill", batch=batch, context=length, heads=heads, kv_heads=kv_heads, impl=impl,
                       seconds=sec)
            if impl == "dense":
                row["implementation"] = implementation
            rows.append(row)
            if isinstance(sec, str):
                cells = f"{sec} | | "
            else:
                row["tflops"] = flops / sec / 1e12
                if isinstance(dense, float):
                    row["pct_dense"] = 100 * dense / sec
                share = f"{100 * dense / sec:.0f}" if isinstance(dense, float) else ""
                cells = f"{sec * 1e3:.2f} | {flops / sec / 1e12:.2f} | {share}"
            label = f"dense {implementation}" if impl == "dense" else impl
            print(f"| {batch} | {length} | {heads}/{kv_heads} | {label} | {cells} |", flush=True)
    for why, points in notes.items():
        print(f"\ndense xla (batch x prompt {', '.join(points)}): XLA's attention instead of cuDNN's: {why}")
    print_summary(rows, args.kv_cache_dtype, jnp.dtype(grid["dtype"]))
    print_variants(rows, grid)
    print(f"\nbench_kernels: {time.perf_counter() - started:.0f} s")
    return rows


def print_summary(rows, kv_cache_dtype, dtype):
    """One line per point: what the issue's goals read (% of the copy rate, fp8/bf16, the faster
    family against auto's table, prefill against cuDNN)."""
    from pallas_kernels import choice

    def timed(row):
        return not isinstance(row["seconds"], str)

    print("\nSummary (auto: the family pallas_kernels/choice.py picks on sm_90, from the "
          f"{choice.MEASURED_ON['date']} {choice.MEASURED_ON['gpu'].split(' (')[0]} run; faster: this run's)")
    print("| decode batch x context | pallas % copy | mosaic % copy | contiguous % copy | pallas fp8/bf16 "
          "| mosaic fp8/bf16 | faster 16-bit | faster fp8 | auto 16-bit | auto fp8 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    points = sorted({(r["batch"], r["context"]) for r in rows if r["kind"] == "decode"})
    for batch, context in points:
        here = {r["impl"]: r for r in rows if r["kind"] == "decode" and (r["batch"], r["context"]) == (batch, context)}

        def cell(impl, key, fmt):
            row = here.get(impl)
            return fmt.format(row[key]) if row and key in row else "-"

        def faster(suffix):
            runs = {f: here[f + suffix]["seconds"] for f in ("pallas", "mosaic") if f + suffix in here
                    and timed(here[f + suffix])}
            return min(runs, key=runs.get) if runs else "-"

        fp8 = f" {kv_cache_dtype}" if kv_cache_dtype else None
        auto8 = choice.auto_family(9.0, "decode", jnp.float8_e4m3fn) if fp8 else "-"
        print(f"| {batch} x {context} | {cell('pallas', 'pct_copy', '{:.0f}')} | "
              f"{cell('mosaic', 'pct_copy', '{:.0f}')} | {cell('contiguous', 'pct_copy', '{:.0f}')} | "
              f"{cell(f'pallas{fp8}', 'fp8_ratio', '{:.2f}') if fp8 else '-'} | "
              f"{cell(f'mosaic{fp8}', 'fp8_ratio', '{:.2f}') if fp8 else '-'} | {faster('')} | "
              f"{faster(fp8) if fp8 else '-'} | {choice.auto_family(9.0, 'decode', dtype)} | {auto8} |")
    prefill = sorted({(r["batch"], r["context"]) for r in rows if r["kind"] == "prefill"})
    if prefill:
        print("\n| prefill batch x prompt | pallas TFLOP/s | mosaic TFLOP/s | reference | reference TFLOP/s "
              "| pallas / reference | mosaic / reference | faster | auto |")
        print("|---|---|---|---|---|---|---|---|---|")
    for batch, length in prefill:
        here = {r["impl"]: r for r in rows if r["kind"] == "prefill" and (r["batch"], r["context"]) == (batch, length)}
        dense = here.get("dense", {})
        reference = "cuDNN" if dense.get("implementation") == "cudnn" else "dense xla (no cuDNN: see above)"

        def cell(impl, key, fmt):
            row = here.get(impl)
            return fmt.format(row[key]) if row and key in row else "-"

        runs = {f: here[f]["seconds"] for f in ("pallas", "mosaic") if f in here and timed(here[f])}
        print(f"| {batch} x {length} | {cell('pallas', 'tflops', '{:.0f}')} | {cell('mosaic', 'tflops', '{:.0f}')} | "
              f"{reference} | {cell('dense', 'tflops', '{:.0f}')} | {cell('pallas', 'pct_dense', '{:.0f}%')} | "
              f"{cell('mosaic', 'pct_dense', '{:.0f}%')} | {min(runs, key=runs.get) if runs else '-'} | "
              f"{choice.auto_family(9.0, 'prefill', dtype)} |")


if __name__ == "__main__":
    main()
