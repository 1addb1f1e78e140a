"""scripts/bench_kernels.py's report: per point % of the copy rate, the fp8/bf16 time ratio, the
faster family against auto's table, prefill against cuDNN (or the dense XLA reference and why)."""

import importlib.util
from pathlib import Path

import jax.numpy as jnp


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels",
                                                  Path(__file__).parents[1] / "scripts/bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_reports_copy_share_fp8_ratio_and_summary(capsys):
    bench = load_bench()
    rows = bench.main(["--tiny", "--iters", "1", "--max-tokens", "32", "--kv-cache-dtype", "fp8"])
    out = capsys.readouterr().out
    decode = {r["impl"]: r for r in rows if r["kind"] == "decode"}
    for impl in ("pallas", "xla", "contiguous", "pallas fp8", "xla fp8"):
        assert decode[impl]["pct_copy"] > 0, impl
    # fp8 rows: their time over the same kernel's on 16-bit pages, and half the K/V bytes
    assert abs(decode["pallas fp8"]["fp8_ratio"] - decode["pallas fp8"]["seconds"] / decode["pallas"]["seconds"]) < 1e-12
    assert "fp8_ratio" not in decode["pallas"]
    other = 2 * 1 * 4 * 64 * 2 + 4 * 1 * (32 // 16 + 1)  # q and out (bf16), block table and length
    assert decode["pallas"]["bytes"] - other == 2 * (decode["pallas fp8"]["bytes"] - other)
    for impl in ("pallas[vT] fp8", "pallas[vT,select] fp8"):  # fp8 V pages stored transposed: timed beside the default
        assert isinstance(decode[impl]["seconds"], float), decode[impl]
    assert {"mosaic[vT,page=32] fp8", "mosaic[page=32] fp8"} <= set(decode)  # (Mosaic: GPU interpret mode, jax >= 0.11)
    prefill = {r["impl"]: r for r in rows if r["kind"] == "prefill"}
    assert prefill["dense"]["implementation"] == "xla" and abs(prefill["dense"]["pct_dense"] - 100) < 1e-9
    assert prefill["pallas"]["tflops"] > 0 and prefill["pallas"]["pct_dense"] > 0
    assert "| batch | context | heads/kv | impl | µs | GB/s | % copy | fp8/bf16 |" in out
    assert "XLA's attention instead of cuDNN's: no GPU" in out
    summary = out[out.index("Summary"):]
    line = next(x for x in summary.splitlines() if x.startswith("| 1 x 32 |"))
    assert line.split("|")[-3:-1] == [" pallas ", " pallas "], line  # auto on sm_90: Triton for decode
    assert "| 2 x 64 |" in summary and "dense xla (no cuDNN" in summary
    assert out.rstrip().splitlines()[-1].startswith("bench_kernels: ")


def test_summary_reads_the_rows(capsys):
    """Synthetic rows: the faster family per point and dtype, the ratios, the cuDNN reference."""
    bench = load_bench()
    rows = [dict(kind="decode", batch=64, context=32768, impl=impl, seconds=sec, pct_copy=pct, **extra)
            for impl, sec, pct, extra in (("pallas", 2.0, 80.0, {}), ("mosaic", 2.5, 64.0, {}),
                                          ("contiguous", 1.8, 89.0, {}),
                                          ("pallas fp8", 1.2, 67.0, {"fp8_ratio": 0.6}),
                                          ("mosaic fp8", 1.0, 80.0, {"fp8_ratio": 0.4}))]
    rows += [dict(kind="prefill", batch=1, context=8192, impl="pallas", seconds=2.0, tflops=200.0, pct_dense=40.0),
             dict(kind="prefill", batch=1, context=8192, impl="mosaic", seconds=1.0, tflops=400.0, pct_dense=80.0),
             dict(kind="prefill", batch=1, context=8192, impl="dense", seconds=0.8, tflops=500.0, pct_dense=100.0,
                  implementation="cudnn")]
    bench.print_summary(rows, "fp8", jnp.dtype(jnp.bfloat16))
    out = capsys.readouterr().out
    assert "| 64 x 32768 | 80 | 64 | 89 | 0.60 | 0.40 | pallas | mosaic | pallas | pallas |" in out
    assert "| 1 x 8192 | 200 | 400 | cuDNN | 500 | 40% | 80% | mosaic | mosaic |" in out


def test_variants_read_against_their_default(capsys):
    """Synthetic rows: each variant (`family[...]`, fp8 ones suffixed) over its family's default at
    the same point; Triton decode's default names the depth its grid gets (decode.decode_stages)."""
    bench = load_bench()
    rows = [dict(kind="decode", batch=8, context=32768, kv_heads=8, impl=impl, seconds=sec)
            for impl, sec in (("pallas", 400e-6), ("pallas[stages=2]", 400e-6), ("pallas[stages=3]", 360e-6),
                              ("mosaic fp8", 450e-6), ("mosaic[2/SM] fp8", 300e-6), ("mosaic[2/SM,diag] fp8", "failed: x"))]
    rows += [dict(kind="prefill", batch=1, context=8192, kv_heads=8, impl="mosaic", seconds=2e-3),
             dict(kind="prefill", batch=1, context=8192, kv_heads=8, impl="mosaic[keys=128,diag]", seconds=1.5e-3)]
    bench.print_variants(rows, bench.QUICK_GRID)
    out = capsys.readouterr().out
    # off a GPU the rule keeps 2 stages; 8 x 32k is 8 x 8 x 4 splits = 256 programs
    assert "| decode | 8 x 32768 | pallas[stages=3] | 360.0 | pallas (stages=2, 256 programs) | 400.0 | 0.900 |" in out
    assert "| decode | 8 x 32768 | mosaic[2/SM] fp8 | 300.0 | mosaic fp8 | 450.0 | 0.667 |" in out
    assert "| decode | 8 x 32768 | mosaic[2/SM,diag] fp8 | failed: x | mosaic fp8 | - | - |" in out
    assert "| prefill | 1 x 8192 | mosaic[keys=128,diag] | 1500.0 | mosaic | 2000.0 | 0.750 |" in out


def test_fp8_names_match_the_kv_cache():
    """bench_kernels spells the fp8 KV cache names out (it runs on GPU images without jpaged's
    dependencies): the same as the engine's."""
    from jpaged.models.kv_cache import FP8_DTYPES

    assert load_bench().FP8_DTYPES == FP8_DTYPES
