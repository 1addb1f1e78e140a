"""pallas_kernels against a float64 numpy reference: the XLA twins, the Pallas Triton
kernels and the Pallas Mosaic GPU kernels (interpret mode on CPU; compiled for real when the
tests run on a GPU -- Mosaic on sm_90+ only, and off-GPU only with jax >= 0.11, whose GPU
interpret mode simulates TMA, barriers and wgmma). Data is fresh random each run; every case prints its parameters and sequence
lengths so a failure can be replayed.

Unused table entries hold garbage (negative, out of range, huge), and every
page slot that no sequence owns holds NaN: any read of a slot that should be
masked shows up as NaN in the output.
"""

import importlib.util
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.decode import paged_attention_pallas
from pallas_kernels.prefill import ragged_paged_attention_pallas
from pallas_kernels.tiling import auto_num_splits

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}  # the KV cache's fp8 pages
TOL = {"f32": 1e-5, "bf16": 2e-2, "f16": 5e-3}
rng = np.random.default_rng()
INTERPRET = jax.default_backend() != "gpu"  # on a GPU the kernels compile for real


def mosaic_runs() -> bool:
    if not INTERPRET:
        return float(jax.devices()[0].compute_capability) >= 9.0
    from jax.experimental.pallas import mosaic_gpu

    return hasattr(mosaic_gpu, "InterpretGPUParams")


needs_mosaic = pytest.mark.skipif(not mosaic_runs(), reason="Mosaic GPU kernels need sm_90+, or jax >= 0.11 off-GPU")


# ---------------------------------------------------------------- fixtures --
def make_cache(lens, num_kv_heads, page_size, head_dim, dtype):
    """Random pages + shuffled block tables for sequences of the given lengths.

    Returns jnp (k_pages, v_pages, block_tables) and the float64 copies of the
    pages (with NaN in every slot no sequence owns)."""
    blocks = [-(-n // page_size) for n in lens]
    width = max(blocks + [1]) + 1  # one always-garbage column
    num_pages = sum(blocks) + 3  # spare pages nobody owns
    owner = rng.permutation(num_pages)
    tables = rng.integers(-3, 3 * num_pages, size=(len(lens), width))
    tables[rng.random(tables.shape) < 0.2] = 2**30
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape)
    v = rng.standard_normal(shape)
    owned = np.zeros((num_pages, page_size), bool)
    nxt = 0
    for s, n in enumerate(lens):
        for b in range(blocks[s]):
            page = owner[nxt]
            nxt += 1
            tables[s, b] = page
            owned[page, : min(page_size, n - b * page_size)] = True
    k[:, ~owned] = np.nan
    v[:, ~owned] = np.nan
    k_j = jnp.asarray(k, dtype)
    v_j = jnp.asarray(v, dtype)
    return (k_j, v_j, jnp.asarray(tables, jnp.int32), np.asarray(k_j, np.float64), np.asarray(v_j, np.float64))


def gather_seq(pages64, table, n):
    """[kvh, P, ps, d] -> the first n tokens of one sequence, [kvh, n, d]."""
    ps = pages64.shape[2]
    pos = np.arange(n)
    return pages64[:, table[pos // ps], pos % ps]


def attend(q, k, v, scale):
    """q [H, d] over k, v [kvh, n, d] (GQA) in float64."""
    heads = q.shape[0]
    group = heads // k.shape[0]
    out = np.zeros_like(q)
    if k.shape[1] == 0:
        return out
    for h in range(heads):
        s = k[h // group] @ q[h] * scale
        p = np.exp(s - s.max())
        out[h] = p @ v[h // group] / p.sum()
    return out


def check_close(out, ref, dtype_name, label):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert not np.isnan(out).any(), f"{label}: NaN in output"
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6)
    print(f"{label}: max rel err {err:.2e}")
    assert err <= TOL[dtype_name], f"{label}: rel err {err:.2e}"


def random_q(shape, dtype):
    q = jnp.asarray(rng.standard_normal(shape), dtype)
    return q, np.asarray(q, np.float64)


# ------------------------------------------------------------------ decode --
# (dtype, page, heads, kv_heads, head_dim, num_splits); pairwise coverage of
# dtype x page size x GQA ratio (1,2,3,4,8) x head_dim (native and padded).
DECODE_CASES = [
    ("f32", 16, 4, 4, 64, None),
    ("f32", 8, 8, 2, 128, 2),
    ("bf16", 32, 8, 1, 64, 4),
    ("bf16", 64, 4, 2, 96, 1),
    ("f16", 16, 16, 2, 80, 2),
    ("f32", 8, 6, 2, 32, 4),
]


# Mosaic: bf16/fp16 and head_dim % 64 == 0 only; split-K forced and automatic.
MOSAIC_DECODE_CASES = [
    ("bf16", 16, 8, 2, 64, None),
    ("f16", 8, 4, 4, 128, 2),
    ("bf16", 128, 8, 1, 64, 3),
]


def decode_lens(page):
    return [1, page - 1, page, page + 1, 0, 20 * page + 3]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_paged_attention(impl, case):
    run_decode(impl, case)


@needs_mosaic
@pytest.mark.parametrize("case", MOSAIC_DECODE_CASES, ids=str)
def test_paged_attention_mosaic(case):
    run_decode("mosaic", case)


def run_decode(impl, case, page_dtype=None):
    """`page_dtype`: pages in another dtype than q (fp8); the reference reads their exact values."""
    dtype_name, page, heads, kv_heads, head_dim, splits = case
    dtype = DTYPES[dtype_name]
    lens = decode_lens(page)
    k, v, tables, k64, v64 = make_cache(lens, kv_heads, page, head_dim, page_dtype or dtype)
    q, q64 = random_q((len(lens), heads, head_dim), dtype)
    scale = 0.7 / np.sqrt(head_dim)
    if impl == "xla":
        out = pk.paged_attention_xla(q, k, v, tables, jnp.asarray(lens), scale=scale)
    elif impl == "pallas-e4m3-bytes":  # an A100's path: e4m3 pages read as bytes, widened by arithmetic
        out = paged_attention_pallas(q, k, v, tables, jnp.asarray(lens, jnp.int32), scale=scale, num_splits=splits,
                                     interpret=INTERPRET, fp8_as_bits=True)
    else:
        out = pk.paged_attention(
            q, k, v, tables, jnp.asarray(lens, jnp.int32), scale=scale, num_splits=splits, backend=impl
        )
    assert out.shape == q.shape and out.dtype == q.dtype
    tables_np = np.asarray(tables)
    ref = np.stack(
        [
            attend(q64[s], gather_seq(k64, tables_np[s], n), gather_seq(v64, tables_np[s], n), scale)
            for s, n in enumerate(lens)
        ]
    )
    check_close(out, ref, dtype_name, f"{impl} {case} lens={lens}")


def test_paged_attention_default_scale_and_dispatch():
    lens = [3, 20]
    k, v, tables, k64, v64 = make_cache(lens, 2, 8, 64, jnp.float32)
    q, q64 = random_q((2, 4, 64), jnp.float32)
    out = pk.paged_attention(q, k, v, tables, jnp.asarray(lens, jnp.int32))
    ref = np.stack(
        [
            attend(q64[s], gather_seq(k64, np.asarray(tables)[s], n), gather_seq(v64, np.asarray(tables)[s], n), 1 / 8)
            for s, n in enumerate(lens)
        ]
    )
    check_close(out, ref, "f32", "default scale, interpret=None")


def test_paged_attention_auto_split_k():
    """Few sequences and a long table: the default picks split-K."""
    lens = [300, 2]
    assert auto_num_splits(2, 300 // 8 + 2, 8) > 1
    k, v, tables, k64, v64 = make_cache(lens, 1, 8, 64, jnp.float32)
    q, q64 = random_q((2, 2, 64), jnp.float32)
    out = pk.paged_attention(q, k, v, tables, jnp.asarray(lens, jnp.int32), backend="pallas")
    ref = np.stack(
        [
            attend(q64[s], gather_seq(k64, np.asarray(tables)[s], n), gather_seq(v64, np.asarray(tables)[s], n), 1 / 8)
            for s, n in enumerate(lens)
        ]
    )
    check_close(out, ref, "f32", "auto split-K")


# ------------------------------------------------------------------ prefill --
# Each sequence is (context_len, q_len): fresh prompts, chunks starting
# mid-page and on a page boundary, q_len 1 next to long ones, empty rows.
def prefill_seqs(page):
    return [
        (5, 5),
        (3 * page + 5, 2 * page + 3),
        (2 * page, page),
        (page + 1, 1),
        (0, 0),
        (page - 1, page - 1),
        (4 * page, 1),
        (page + 2, page + 2),
    ]


# (dtype, page, heads, kv_heads, head_dim, pad_tokens, q_tile); q_tile
# forces small query tiles so sequences span several tiles.
PREFILL_CASES = [
    ("f32", 8, 4, 4, 64, 5, None),
    ("bf16", 16, 8, 2, 128, 0, None),
    ("f32", 32, 8, 1, 96, 3, 16),
    ("f16", 64, 6, 2, 64, 2, 4),
    ("bf16", 8, 4, 2, 64, 1, 8),
]


# Mosaic: query tiles are 64 // next_pow2(group) tokens (q_tile does not apply).
MOSAIC_PREFILL_CASES = [
    ("bf16", 16, 8, 2, 64, 3, None),
    ("f16", 8, 4, 4, 128, 0, None),
    ("bf16", 64, 6, 2, 64, 1, None),
]


def run_prefill(impl, case, seqs, page_dtype=None):
    dtype_name, page, heads, kv_heads, head_dim, pad_tokens, q_tile = case
    dtype = DTYPES[dtype_name]
    ctx = [c for c, _ in seqs]
    qlens = [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + pad_tokens
    k, v, tables, k64, v64 = make_cache(ctx, kv_heads, page, head_dim, page_dtype or dtype)
    q, q64 = random_q((num_tokens, heads, head_dim), dtype)
    args = (q, k, v, tables, jnp.asarray(ctx, jnp.int32), jnp.asarray(qsl))
    if impl == "xla":
        out = pk.ragged_paged_attention_xla(*args)
    elif impl == "mosaic":
        out = pk.ragged_paged_attention(*args, backend="mosaic")
    else:
        out = ragged_paged_attention_pallas(*args, interpret=INTERPRET, q_tile=q_tile,
                                            fp8_as_bits=impl == "pallas-e4m3-bytes")
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = np.zeros_like(q64)
    tables_np = np.asarray(tables)
    scale = 1 / np.sqrt(head_dim)
    for s, (c, n) in enumerate(seqs):
        kk = gather_seq(k64, tables_np[s], c)
        vv = gather_seq(v64, tables_np[s], c)
        for j in range(n):
            pos = c - n + j
            t = qsl[s] + j
            ref[t] = attend(q64[t], kk[:, : pos + 1], vv[:, : pos + 1], scale)
    check_close(out, ref, dtype_name, f"{impl} {case} seqs={seqs}")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_ragged_paged_attention(impl, case):
    seqs = prefill_seqs(case[1])
    order = rng.permutation(len(seqs))
    run_prefill(impl, case, [seqs[i] for i in order])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[2], DECODE_CASES[4]], ids=str)
def test_paged_attention_fp8_pages(impl, fp8, case):
    """fp8 pages (NaN in every unowned slot), f32 / bf16 / f16 queries: the kernels widen the
    pages as they load them; the float64 reference reads the same fp8 values."""
    run_decode(impl, case, FP8[fp8])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("case", [PREFILL_CASES[1], PREFILL_CASES[2]], ids=str)
def test_ragged_paged_attention_fp8_pages(impl, fp8, case):
    seqs = prefill_seqs(case[1])
    order = rng.permutation(len(seqs))
    run_prefill(impl, case, [seqs[i] for i in order], FP8[fp8])


@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[4]], ids=str)
def test_triton_kernels_read_e4m3_pages_as_bytes(case):
    """Below sm_89 Triton has no e4m3 conversion: the kernels take the pages' bytes and widen them
    by integer arithmetic (blocks.widen_e4m3), decode and prefill against the float64 reference,
    and the widening equals the native conversion on all 256 byte values (NaN for 0x7f / 0xff)."""
    from pallas_kernels.blocks import widen_e4m3

    byte_values = np.arange(256, dtype=np.uint8)
    native = np.asarray(jnp.asarray(byte_values).view(jnp.float8_e4m3fn).astype(jnp.float32))
    widened = np.asarray(widen_e4m3(jnp.asarray(byte_values), jnp.float32))
    np.testing.assert_array_equal(widened, native)  # NaNs compare equal here
    assert np.isnan(widened[[0x7F, 0xFF]]).all() and np.signbit(widened[0x80])
    run_decode("pallas-e4m3-bytes", case, FP8["e4m3"])
    dtype_name, page, heads, kv_heads, head_dim, _ = case
    run_prefill("pallas-e4m3-bytes", (dtype_name, page, heads, kv_heads, head_dim, 2, None), prefill_seqs(page),
                FP8["e4m3"])


@needs_mosaic
@pytest.mark.parametrize("case", MOSAIC_PREFILL_CASES, ids=str)
def test_ragged_paged_attention_mosaic(case):
    seqs = prefill_seqs(case[1])
    order = rng.permutation(len(seqs))
    run_prefill("mosaic", case, [seqs[i] for i in order])


@needs_mosaic
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("case", [MOSAIC_DECODE_CASES[0], MOSAIC_DECODE_CASES[1]], ids=str)
def test_paged_attention_mosaic_fp8_pages(fp8, case):
    """Mosaic: fp8 pages (NaN in unowned slots) land by TMA, widen in shared memory, then wgmma."""
    run_decode("mosaic", case, FP8[fp8])


@needs_mosaic
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("case", [MOSAIC_PREFILL_CASES[0], MOSAIC_PREFILL_CASES[1]], ids=str)
def test_ragged_paged_attention_mosaic_fp8_pages(fp8, case):
    seqs = prefill_seqs(case[1])
    order = rng.permutation(len(seqs))
    run_prefill("mosaic", case, [seqs[i] for i in order], FP8[fp8])


@needs_mosaic
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_with_mosaic_kernels_matches_xla(kv_cache_dtype):
    """attention_backend="mosaic" end to end (prefill, then decode steps through the engine's
    scanned layers) against the XLA twins, both in bf16 (with fp8 pages: both quantize the same
    K/V at the same calculated scales, so only the kernels differ). Two bf16 implementations round
    differently (each is ~0.15 nats from float32 over four tokens on this model), so greedy paths
    may part at a near-tie: compared as vLLM's check_logprobs_close does. Up to the first
    differing token the logprobs must agree to bf16 noise; at it, each side's token must be in
    the other's top 5. A wrong page, mask or position shifts logprobs by whole nats. With fp8 pages
    a bf16 rounding apart can land K or V one fp8 step (6%) apart: up to 0.32 nats seen (CI, a
    random draw; seeds 0-5: at most 0.12), so 0.5 there. The prompts are fixed."""
    import jpaged

    prompt_rng = np.random.default_rng(20261124)
    prompts = [prompt_rng.integers(0, 256, n).tolist() for n in (5, *prompt_rng.integers(20, 60, 3))]
    tolerance = 0.15 if kv_cache_dtype == "auto" else 0.5
    sp = jpaged.SamplingParams(temperature=0, max_tokens=6, logprobs=5)
    results = {}
    for backend in ("xla", "mosaic"):
        llm = jpaged.LLM("tiny", dtype="bfloat16", attention_backend=backend, enforce_eager=True, max_model_len=128,
                         max_num_seqs=4, num_gpu_blocks_override=32, kv_cache_dtype=kv_cache_dtype,
                         calculate_kv_scales=kv_cache_dtype != "auto")
        results[backend] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    for ours, ref in zip(results["mosaic"], results["xla"]):
        for token, expected, top, ref_top in zip(ours.token_ids, ref.token_ids, ours.logprobs, ref.logprobs):
            if token != expected:
                assert token in ref_top and expected in top, (prompts, ours, ref)
                break
            assert abs(top[token] - ref_top[token]) < tolerance, (prompts, ours, ref)


def test_mosaic_rejects_what_it_cannot_take():
    k, v, tables, _, _ = make_cache([3], 2, 16, 80, jnp.bfloat16)
    q = jnp.zeros((1, 4, 80), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim % 64"):
        pk.paged_attention(q, k, v, tables, jnp.asarray([3], jnp.int32), backend="mosaic")
    k, v, tables, _, _ = make_cache([3], 2, 16, 64, jnp.float32)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        pk.paged_attention(jnp.zeros((1, 4, 64)), k, v, tables, jnp.asarray([3], jnp.int32), backend="mosaic")
    with pytest.raises(ValueError, match="bf16 or fp16"):  # pages neither q's dtype nor fp8
        pk.paged_attention(jnp.zeros((1, 4, 64), jnp.bfloat16), k, v, tables, jnp.asarray([3], jnp.int32),
                           backend="mosaic")


def test_ragged_paged_attention_single_long_prompt():
    run_prefill("xla", ("f32", 16, 4, 2, 64, 0, None), [(150, 150)])


def test_ragged_paged_attention_dispatch_all_padding():
    """Public entry point, interpret=None; a batch with no real tokens."""
    k, v, tables, _, _ = make_cache([0, 0], 2, 8, 64, jnp.float32)
    q = jnp.full((6, 4, 64), jnp.nan, jnp.float32)
    out = pk.ragged_paged_attention(q, k, v, tables, jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), 0.0)


# -------------------------------------------------------------- cache ops --
def test_write_kv():
    kvh, pages, page, d, tokens = 2, 6, 8, 16, 20
    k_pages = jnp.asarray(rng.standard_normal((kvh, pages, page, d)), jnp.bfloat16)
    v_pages = jnp.asarray(rng.standard_normal((kvh, pages, page, d)), jnp.bfloat16)
    slots = rng.permutation(pages * page)[:tokens]
    slots[rng.random(tokens) < 0.3] = -1
    k = jnp.asarray(rng.standard_normal((tokens, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((tokens, kvh, d)), jnp.float32)
    new_k, new_v = pk.write_kv(k_pages, v_pages, k, v, jnp.asarray(slots, jnp.int32))
    for old, new, src in ((k_pages, new_k, k), (v_pages, new_v, v)):
        expect = np.asarray(old).reshape(kvh, pages * page, d).copy()
        live = slots >= 0
        expect[:, slots[live]] = np.swapaxes(np.asarray(src.astype(old.dtype)), 0, 1)[:, live]
        got = np.asarray(new).reshape(kvh, pages * page, d)
        assert new.dtype == old.dtype
        np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("fp8", FP8)
def test_write_kv_quantizes_fp8_pages(fp8):
    """fp8 pages store x / scale rounded to the nearest fp8 value (ml_dtypes' numpy cast as the
    reference), saturated at the largest finite one: no NaN from an outlier."""
    import ml_dtypes

    dtype = FP8[fp8]
    kvh, pages, page, d, tokens = 2, 4, 8, 16, 24
    k_pages, v_pages = jnp.zeros((kvh, pages, page, d), dtype), jnp.zeros((kvh, pages, page, d), dtype)
    slots = rng.permutation(pages * page)[:tokens]
    slots[rng.random(tokens) < 0.25] = -1
    k = rng.standard_normal((tokens, kvh, d)) * 3
    v = rng.standard_normal((tokens, kvh, d))
    k[0, 0, 0] = 1e9  # far past the largest fp8 value even after scaling
    k_scale, v_scale = np.float32(rng.uniform(0.01, 2)), np.float32(rng.uniform(0.01, 2))
    new_k, new_v = pk.write_kv(k_pages, v_pages, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                               jnp.asarray(slots, jnp.int32), k_scale, v_scale)
    largest = float(ml_dtypes.finfo(np.dtype(dtype)).max)
    for new, src, scale in ((new_k, k, k_scale), (new_v, v, v_scale)):
        assert new.dtype == dtype
        expect = np.zeros((kvh, pages * page, d), np.dtype(dtype))
        live = slots >= 0
        scaled = np.clip(np.float32(src) / scale, -largest, largest)
        expect[:, slots[live]] = np.swapaxes(scaled.astype(np.dtype(dtype)), 0, 1)[:, live]
        got = np.asarray(new).reshape(kvh, pages * page, d)
        np.testing.assert_array_equal(got.astype(np.float32), expect.astype(np.float32))
        assert np.isfinite(got.astype(np.float32)).all()


def test_write_kv_donated_in_place():
    k_pages = jnp.zeros((1, 4, 4, 8))
    v_pages = jnp.zeros((1, 4, 4, 8))
    step = jax.jit(pk.write_kv, donate_argnums=(0, 1))
    x = jnp.ones((2, 1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_k, _ = step(k_pages, v_pages, x, x, jnp.asarray([5, -1], jnp.int32))
    assert float(new_k.sum()) == 8.0


def test_copy_blocks():
    kvh, pages, page, d = 2, 10, 4, 8
    k_pages = jnp.asarray(rng.standard_normal((kvh, pages, page, d)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((kvh, pages, page, d)), jnp.float32)
    perm = rng.permutation(pages)
    src, dst = perm[:4].copy(), perm[4:8].copy()
    src[2] = -1  # padding pair
    new_k, new_v = pk.copy_blocks(k_pages, v_pages, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
    for old, new in ((k_pages, new_k), (v_pages, new_v)):
        expect = np.asarray(old).copy()
        for s, t in zip(src, dst):
            if s >= 0:
                expect[:, t] = expect[:, s]
        np.testing.assert_array_equal(np.asarray(new), expect)


# ------------------------------------------------- GPU lowering, benchmark --
def load_script(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_kernels_lower_for_h100(backend):
    """No GPU needed: lowering for CUDA with an abstract H100 runs Triton's lowering (its module
    parsed back and verified) and Mosaic GPU's layout inference and verifier, which catch
    unsupported primitives, shapes and layouts. CI's readiness job lowers every case."""
    lower = load_script("lower_for_gpu")
    cases = [case for case in lower.kernel_cases() if case[2] == backend][:2]  # decode + prefill
    assert [label.split()[0] for label, *_ in cases] == ["decode", "prefill"]
    for label, fn, _, args in cases:
        assert lower.kernel_calls(lower.lower_for_cuda(fn, *args)) == [backend], label


def test_bench_tiny_runs():
    bench = load_script("bench_kernels")
    rows = bench.main(["--tiny", "--iters", "1", "--max-tokens", "32"])
    timed = [r for r in rows if not isinstance(r["seconds"], str)]
    assert {r["impl"] for r in timed} >= {"pallas", "xla", "contiguous"}
