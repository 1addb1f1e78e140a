"""attention_backend="auto" on a GPU: which kernel family runs each phase, by measurement.

The table below is what one GPU run measured (`scripts/bench_kernels.py --quick --kv-cache-dtype
fp8`, the run's log `full/bench_kernels.log`; docs/PERF.md, "First GPU run"): the time of one call
per point, per family, per phase and per KV page dtype. `auto` runs, for each phase and page dtype,
the family with the smaller SUM of those times over the measured points. A sum weighs each point by
its time, so the large batches at long context (where a serving GPU spends its decode time, and
where a step's attention costs milliseconds) count most, and a 13% gain at batch 8 x 4k (13 us)
cannot outvote a 4% loss at batch 64 x 32k (106 us). Mixed results at the time of writing:

- decode, 16-bit pages: Mosaic faster at batch 8 (88.2 vs 101.3 us at 4k, 353.8 vs 414.5 at 32k),
  Triton at batch 64 (345.4 vs 383.7 at 4k, 2,490.6 vs 2,596.4 at 32k): sums 3,352 (Triton) vs
  3,422 us (Mosaic) -> Triton.
- decode, fp8 pages: Triton at 3 of 4 points, by up to 1.57x: 3,092 vs 4,622 us -> Triton.
- prefill (ragged), 16-bit pages: Mosaic 1.3-1.4x faster at 2k and 8k -> Mosaic.
- prefill, fp8 pages: not measured -> Triton (auto's choice before any measurement).

The table covers sm_90 (Hopper: H100, H200, GH200), where it was measured. Below sm_90 Mosaic GPU
does not run (no wgmma or TMA) and Triton stays; on sm_100+ the Mosaic kernels' wgmma does not exist
(Blackwell has tcgen05 instead) and nothing was measured, so Triton stays there too. Where the
chosen family cannot take a call (Mosaic: bf16/fp16 q only, head_dim % 64, no sliding window, key limits or
logit soft-capping), the call runs on Triton. A new GPU run updates MEASURED and the sums decide
again; `bench_kernels` prints the family this table picks beside each point's measured winner.
"""

PHASES = ("decode", "prefill")
PAGES = ("16-bit", "fp8")  # bf16/fp16 pages (the run measured bf16; fp16 has the same bytes and path), fp8 ones

# Where the figures come from (the GPU run's date, device, software).
MEASURED_ON = dict(date="2026-11-28", gpu="NVIDIA H200 (sm_90, 143,771 MiB)",
                   jax="0.11.2 (CUDA 13 plugin)",
                   source="the day's second run (17:27 UTC), bench_kernels --quick --kv-cache-dtype fp8 in "
                          "gpu_check.sh at 693de7e (fp8 widened to f16, Triton's page ids through the loop): "
                          "bf16 q, head_dim 128, page 16, 32 query / 8 KV heads")

# (phase, pages) -> family -> {(batch, context or prompt length): microseconds per call}.
MEASURED = {
    ("decode", "16-bit"): {
        "pallas": {(8, 4096): 77.3, (8, 32768): 382.3, (64, 4096): 340.4, (64, 32768): 2462.8},
        "mosaic": {(8, 4096): 73.2, (8, 32768): 344.9, (64, 4096): 360.5, (64, 32768): 2589.8},
    },
    ("decode", "fp8"): {
        "pallas": {(8, 4096): 72.4, (8, 32768): 284.9, (64, 4096): 272.1, (64, 32768): 1999.5},
        "mosaic": {(8, 4096): 83.5, (8, 32768): 455.4, (64, 4096): 484.7, (64, 32768): 3499.7},
    },
    ("prefill", "16-bit"): {  # one causal prompt of 2,048 / 8,192 tokens (log's ms, 2 decimals)
        "pallas": {(1, 2048): 260.0, (1, 8192): 2620.0},
        "mosaic": {(1, 2048): 200.0, (1, 8192): 1900.0},
    },
    ("prefill", "fp8"): {},  # not measured
}
UNMEASURED = "pallas"  # what auto runs where MEASURED has nothing


def pages_class(page_dtype) -> str:
    """"fp8" for 1-byte (fp8) pages, "16-bit" otherwise (f32 pages: Mosaic refuses them anyway)."""
    import numpy as np

    return "fp8" if np.dtype(page_dtype).itemsize == 1 else "16-bit"


def measured_choice(phase: str, pages: str) -> str:
    """The family MEASURED says is faster for `phase` and `pages` (smallest sum of times over the
    points every family was measured at), or UNMEASURED."""
    if phase not in PHASES or pages not in PAGES:
        raise ValueError(f"phase {phase!r} / pages {pages!r}: expected one of {PHASES} / {PAGES}")
    runs = MEASURED[(phase, pages)]
    common = set.intersection(*(set(points) for points in runs.values())) if runs else set()
    if not common:
        return UNMEASURED
    return min(sorted(runs), key=lambda family: sum(runs[family][point] for point in common))


def auto_family(compute_capability: float, phase: str, page_dtype, mosaic_takes_it: bool = True) -> str:
    """The family attention_backend="auto" runs on a GPU of `compute_capability` for `phase`
    ("decode" or "prefill") over pages of `page_dtype`: the measured choice on sm_90 (the
    generation it was measured on) where Mosaic takes the call, else "pallas" (Triton)."""
    if not 9.0 <= compute_capability < 10.0:
        return "pallas"
    family = measured_choice(phase, pages_class(page_dtype))
    return family if family != "mosaic" or mosaic_takes_it else "pallas"


def describe_auto() -> str:
    """auto's choices on sm_90, one line for the start-up log."""
    parts = [f"{phase} {pages} pages: {'Mosaic' if measured_choice(phase, pages) == 'mosaic' else 'Triton'}"
             for phase in PHASES for pages in PAGES]
    return (f"'auto' on sm_90 by measurement ({MEASURED_ON['gpu'].split(' (')[0]}, {MEASURED_ON['date']}): "
            + ", ".join(parts) + " (Triton where Mosaic cannot take the model)")
