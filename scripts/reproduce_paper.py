"""Reproduce the PagedAttention paper's experiments in one command, its baselines inside this
engine (kv_allocation), so that every comparison isolates memory management.

  JAX_PLATFORMS=cpu python scripts/reproduce_paper.py --quick   # the 2-core CPU machine, < 15 min
  python scripts/reproduce_paper.py --model PATH                 # full sizes, for a GPU

Workloads: synthetic traces with the paper's length statistics (Fig. 11: ShareGPT prompts of
161.3 tokens and outputs of 338.0 on average, long-tailed; Alpaca 19.3 and 58.5), lognormal
lengths, random token ids, every request ignoring EOS (so it produces exactly its sampled output
length: what orca-oracle reserves), Poisson arrivals. `--quick` divides the ShareGPT lengths and
max_model_len (2048 -> 512) by 4, so that Orca (Max) still reserves ~4x a mean request as in the
paper, and uses fewer requests and a 2048-token KV pool.

The trace is replayed on a virtual clock: requests arrive at their Poisson times, each engine
step advances the clock by its measured duration, and an idle engine jumps to the next arrival
(no sleeping, and the script's own bookkeeping is not counted). Rates are fractions of the
capacity measured for paged allocation (all requests at once), so the same fractions span the
interesting range on any machine.

Experiments (figures in --output-dir, PNG, and results.json):
  Fig. 12  normalized latency (mean of end-to-end latency / output length, s/token) vs request
           rate, per allocation policy, ShareGPT-like and Alpaca-like.
  Fig. 13  mean number of requests batched per step, per policy (at the middle rate); and with
           the fp8 KV cache against bf16 pages in the same bytes of KV memory.
  Fig. 2   KV memory by content per policy (slots holding tokens / reserved / internal
           fragmentation, time-averaged over allocated slots) at the highest rate.
  Fig. 14-16 (via scripts/bench_sharing.py) memory saved by sharing for parallel sampling and
           beam search; shared-prefix prompts with prefix caching on vs off.
  Fig. 18  normalized latency vs block size at a fixed rate (paged).
  Fig. 19  (a) swapping a sequence's blocks out and in vs recomputing its tokens, per block
           size; (b) normalized latency with preemption by swap vs by recompute.
"""

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import sys
import time

if __name__ == "__main__" and importlib.util.find_spec("matplotlib") is None:  # now, not after the run
    sys.exit('error: scripts/reproduce_paper.py needs matplotlib for its figures: pip install ".[bench]"')

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import jpaged  # noqa: E402
from jpaged.core.block_manager import BlockManager  # noqa: E402
from jpaged.core.kv_allocation import KV_ALLOCATIONS, kv_usage, step_without_model  # noqa: E402
from jpaged.core.scheduler import Scheduler  # noqa: E402
from jpaged.core.sequence import Sequence, SequenceGroup  # noqa: E402
from jpaged.models.kv_cache import kv_dtype  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "bench_sharing", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_sharing.py"))
bench_sharing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_sharing)

# The paper's numbers (OPT-13B on an A100 unless said otherwise), for the figures and the report.
PAPER = {
    "fig2_token_fraction": {"paged": 0.963, "orca-oracle": 0.382, "orca-pow2": 0.268, "orca-max": 0.204},
    "fig12_rate_gain_sharegpt": {"orca-oracle": (1.7, 2.7), "orca-max": (2.7, 8.0), "static": (22.0, 22.0)},
    "fig13_batch_gain_sharegpt": {"orca-oracle": 2.2, "orca-max": 4.3},
    "fig15_saved_alpaca": {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)},
    "fig15_saved_sharegpt": {"parallel": (0.162, 0.305), "beam": (0.443, 0.663)},
    "fig16_throughput_gain": {"1-shot": 1.67, "5-shot": 3.58},
    "fig19_recompute_over_swap_max": 1.2,  # recompute never costs more than 20% over swapping
}

POLICY_LABELS = {"paged": "jpaged (paged)", "orca-oracle": "Orca (Oracle)", "orca-pow2": "Orca (Pow2)",
                 "orca-max": "Orca (Max)", "static": "FasterTransformer-like (static)"}


@dataclasses.dataclass(frozen=True)
class Trace:
    name: str
    prompt: tuple  # lognormal (mean, sigma of the log, low, high) as bench_sharing.lengths takes them
    output: tuple
    num_requests: int


def traces(args) -> list[Trace]:
    scale = 0.25 if args.quick else 1.0
    cap = args.max_model_len // 2
    return [Trace("ShareGPT", (161.3 * scale, 1.0, 4, cap), (338.0 * scale, 1.0, 4, cap),
                  args.num_requests or (40 if args.quick else 1000)),
            Trace("Alpaca", bench_sharing.ALPACA_PROMPT[:3] + (min(bench_sharing.ALPACA_PROMPT[3], cap),),
                  bench_sharing.ALPACA_OUTPUT[:3] + (min(bench_sharing.ALPACA_OUTPUT[3], cap),),
                  2 * args.num_requests if args.num_requests else 80 if args.quick else 2000)]


def sample_requests(trace: Trace, vocab_size: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, size=n).tolist()
               for n in bench_sharing.lengths(rng, trace.num_requests, *trace.prompt)]
    return prompts, bench_sharing.lengths(rng, trace.num_requests, *trace.output)


def replay(llm, prompts, output_lens, rate: float, seed: int) -> dict:
    """Serve the requests arriving at Poisson times of `rate` (inf: all at once) on a virtual clock."""
    engine = llm.llm_engine
    rng = np.random.default_rng(seed)
    n = len(prompts)
    arrivals = np.zeros(n) if math.isinf(rate) else np.cumsum(rng.exponential(1 / rate, n))
    finish, ids = {}, [f"r{time.monotonic_ns()}-{i}" for i in range(n)]
    preemptions = engine.scheduler.num_preemptions
    clock, next_i = 0.0, 0
    busy = batched = tokens = reserved = fragmented = 0.0
    steps = step_batched = 0
    while len(finish) < n:
        while next_i < n and arrivals[next_i] <= clock:
            engine.add_request(ids[next_i], prompts[next_i],
                               jpaged.SamplingParams(temperature=0, max_tokens=output_lens[next_i], ignore_eos=True))
            next_i += 1
        if not engine.has_unfinished_requests():
            clock = arrivals[next_i]
            continue
        start = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - start
        clock += dt
        for out in outputs:
            if out.finished:
                finish[out.request_id] = clock
        # Time-weighted: what the memory held and how many requests ran during this step.
        usage = engine.kv_usage()
        busy += dt
        batched += dt * len(engine.scheduler.running)
        steps += 1
        step_batched += len(engine.scheduler.running)
        tokens += dt * usage.token_slots
        reserved += dt * usage.reserved_slots
        fragmented += dt * usage.fragmented_slots
    latencies = [(finish[ids[i]] - arrivals[i]) / output_lens[i] for i in range(n)]
    allocated = tokens + reserved + fragmented
    return {"rate": rate, "requests": n, "normalized_latency": float(np.mean(latencies)),
            "makespan_s": round(clock - float(arrivals[0]), 3), "busy_s": round(busy, 3),
            "throughput_req_s": n / (clock - float(arrivals[0])),
            "mean_batched_requests": batched / busy, "mean_batched_requests_per_step": step_batched / steps,
            "token_fraction": tokens / allocated, "reserved_fraction": reserved / allocated,
            "fragmented_fraction": fragmented / allocated,
            "preemptions": engine.scheduler.num_preemptions - preemptions}


class Engines:
    """One LLM per configuration, built on first use (the same step shapes compile once)."""

    def __init__(self, args):
        self.args, self.cache = args, {}

    def kwargs(self, **overrides) -> dict:
        a = self.args
        kwargs = dict(block_size=16, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                      max_num_batched_tokens=a.max_num_batched_tokens, swap_space=a.swap_space, seed=a.seed,
                      enforce_eager=a.enforce_eager)
        kv_slots = overrides.pop("kv_slots", a.kv_slots)
        kwargs.update(overrides)
        # The same memory at every block size: block_size * blocks = kv_slots.
        kwargs["num_gpu_blocks_override"] = kv_slots // kwargs["block_size"]
        return kwargs

    def get(self, **overrides):
        kwargs = self.kwargs(**overrides)
        key = tuple(sorted(kwargs.items()))
        if key not in self.cache:
            self.cache.clear()  # one at a time: each holds its KV pool
            self.cache[key] = jpaged.LLM(self.args.model, **kwargs)
        return self.cache[key]


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fig12(engines, args, vocab_size) -> dict:
    """Normalized latency vs rate per policy; also Fig. 13 (batched requests) and Fig. 2 (memory)."""
    results = {}
    for trace in traces(args):
        prompts, output_lens = sample_requests(trace, vocab_size, args.seed)
        capacity_run = replay(engines.get(kv_allocation="paged"), prompts, output_lens, math.inf, args.seed)
        capacity = trace.num_requests / capacity_run["makespan_s"]
        rates = [round(f * capacity, 3) for f in args.rate_fractions]
        log(f"{trace.name}: paged serves {capacity:.2f} req/s at most; rates {rates}")
        runs = {}
        for policy in args.policies:
            llm = engines.get(kv_allocation=policy)
            runs[policy] = []
            for rate in rates:
                run = replay(llm, prompts, output_lens, rate, args.seed)
                runs[policy].append(run)
                log(f"  {policy:12s} {rate:7.2f} req/s: {run['normalized_latency']:.4f} s/token, "
                    f"{run['mean_batched_requests']:.1f} batched, {run['token_fraction']:.1%} of allocated KV "
                    f"holds tokens, {run['preemptions']} preemptions ({run['busy_s']:.1f} s)")
        results[trace.name] = {"capacity_req_s": capacity, "rates": rates, "runs": runs,
                               "mean_prompt_len": float(np.mean([len(p) for p in prompts])),
                               "mean_output_len": float(np.mean(output_lens))}
    return results


def fig13_fp8(engines, args, vocab_size) -> dict:
    """Fig. 13's shape for the fp8 KV cache (a later vLLM feature): requests batched when the KV
    pool has the same bytes with bf16 pages and with fp8 ones (twice the blocks), the
    ShareGPT-like trace arriving all at once, in a quarter of the other figures' pool, so that
    memory alone bounds the batch. Averaged per step, not per second: fp8 pages cost a CPU more
    time per step (it converts them in software), which is not what the figure is about."""
    trace = traces(args)[0]
    prompts, output_lens = sample_requests(trace, vocab_size, args.seed)
    kwargs = dict(kv_allocation="paged", dtype="bfloat16", kv_cache_dtype="auto", calculate_kv_scales=False)
    bf16_slots = args.kv_slots // 4
    spec = engines.get(**kwargs, kv_slots=bf16_slots).llm_engine.runner.kv_cache_spec
    pool_bytes = bf16_slots // spec.block_size * spec.bytes_per_block
    runs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        fp8_spec = dataclasses.replace(spec, dtype=np.dtype(kv_dtype(kv_cache_dtype, spec.dtype)))
        slots = pool_bytes // fp8_spec.bytes_per_block * spec.block_size  # the same bytes: more blocks when smaller
        kwargs.update(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=kv_cache_dtype != "auto")
        llm = engines.get(**kwargs, kv_slots=slots)
        run = replay(llm, prompts, output_lens, math.inf, args.seed)
        run.update(kv_slots=slots, kv_cache_dtype=llm.stats()["kv_cache_dtype"], pool_mib=pool_bytes / 2**20)
        runs[kv_cache_dtype] = run
        log(f"  {run['kv_cache_dtype']:14s} {slots} KV slots in {pool_bytes / 2**20:.2f} MiB: "
            f"{run['mean_batched_requests_per_step']:.2f} batched per step, {run['preemptions']} preemptions "
            f"({run['busy_s']:.1f} s)")
    return {"trace": trace.name, "runs": runs}


def fig2_paper_scale(args) -> dict:
    """Fig. 2 at the paper's sizes, without a model: the engine's own scheduler and block manager
    serve a full-length ShareGPT-like trace (context 2048, OPT-13B's 15.7K KV slots on an A100,
    the paper's Table 1) with every request queued at once, as under heavy load. A step computes
    the scheduled tokens and samples one token for each sequence at its end. What the memory
    holds depends only on what is scheduled, not on how fast a model computes it."""
    max_len, block_size = 2048, 16
    rng = np.random.default_rng(args.seed)
    n = args.memory_requests
    prompt_lens = bench_sharing.lengths(rng, n, 161.3, 1.0, 4, max_len // 2)
    output_lens = bench_sharing.lengths(rng, n, 338.0, 1.0, 4, max_len // 2)
    results = {}
    for policy in [p for p in args.policies if p != "static"]:  # the paper's Fig. 2 has no FasterTransformer
        bm = BlockManager(block_size, args.memory_kv_slots // block_size, 0, kv_allocation=policy,
                          max_model_len=max_len)
        scheduler = Scheduler(bm, max_num_seqs=256, max_num_batched_tokens=max_len, max_model_len=max_len)
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens)):
            scheduler.add_seq_group(SequenceGroup(str(i), [Sequence(i, [0] * p)],
                                                  jpaged.SamplingParams(max_tokens=o, ignore_eos=True), 0.0))
        steps = batched = tokens = reserved = fragmented = 0
        while scheduler.has_unfinished_seqs():
            step_without_model(scheduler, token_id=0)
            usage = kv_usage(bm, scheduler.running, max_len)
            steps += 1
            batched += len(scheduler.running)
            tokens += usage.token_slots
            reserved += usage.reserved_slots
            fragmented += usage.fragmented_slots
        allocated = tokens + reserved + fragmented
        results[policy] = {"steps": steps, "mean_batched_requests": batched / steps,
                           "token_fraction": tokens / allocated, "reserved_fraction": reserved / allocated,
                           "fragmented_fraction": fragmented / allocated}
        log(f"  {policy:12s} {tokens / allocated:.1%} of allocated KV holds tokens, "
            f"{reserved / allocated:.1%} reserved, {fragmented / allocated:.1%} fragmented; "
            f"{batched / steps:.1f} requests batched, {steps} steps")
    return {"requests": n, "kv_slots": args.memory_kv_slots, "max_model_len": max_len, "policies": results}


def fig14_16(engines, args) -> list[dict]:
    """Sharing (bench_sharing's workloads and measures, with this script's engine sizes)."""
    # bench_sharing's sizes: long enough for its 5-shot prefix, a pool that never preempts; it
    # measures memory, and times the prefix workloads after a warm-up run: shapes compile on first use.
    sizes = dict(kv_allocation="paged", max_model_len=max(args.max_model_len, 1024),
                 kv_slots=max(args.kv_slots, 8192), enforce_eager=True)
    plain = engines.get(**sizes)
    vocab_size = plain.llm_engine.hf_config.vocab_size
    ns = argparse.Namespace(num_prompts=args.sharing_prompts, widths=args.widths, seed=args.seed)
    results = bench_sharing.bench_parallel_and_beam(plain, ns, vocab_size)
    # The prefix workloads compare caching on and off: two engines at once, small enough here.
    cached = jpaged.LLM(args.model, **engines.kwargs(**sizes, enable_prefix_caching=True))
    return results + bench_sharing.bench_shared_prefix({True: cached, False: plain}, ns, vocab_size)


def fig18_19a(engines, args, vocab_size, fig12_results) -> tuple[dict, dict]:
    """Per block size: normalized latency at a fixed rate (Fig. 18b), and moving a sequence's KV
    out and back vs recomputing it (Fig. 19a)."""
    fig18 = {trace.name: {"rate": fig12_results[trace.name]["capacity_req_s"] * args.fixed_rate_fraction, "runs": {}}
             for trace in traces(args)}
    micro, n = {}, args.recompute_tokens
    for block_size in args.block_sizes:
        llm = engines.get(kv_allocation="paged", block_size=block_size)
        for trace in traces(args):
            prompts, output_lens = sample_requests(trace, vocab_size, args.seed)
            run = replay(llm, prompts, output_lens, fig18[trace.name]["rate"], args.seed)
            fig18[trace.name]["runs"][block_size] = run
            log(f"  {trace.name} block size {block_size:3d}: {run['normalized_latency']:.4f} s/token, "
                f"{run['token_fraction']:.1%} of allocated KV holds tokens ({run['busy_s']:.1f} s)")
        engine, runner = llm.llm_engine, llm.llm_engine.runner
        pairs = [(i, i) for i in range(math.ceil(n / block_size))]  # the engine is idle: any blocks do
        prompt = np.random.default_rng(args.seed).integers(0, vocab_size, size=n).tolist()
        swap, recompute = [], []
        for _ in range(args.repeats + 1):  # the first of each may compile
            start = time.perf_counter()
            runner.swap_out(pairs)
            runner.swap_in(pairs)
            jax.block_until_ready(runner.kv_cache)
            swap.append(time.perf_counter() - start)
            engine.add_request(f"recompute-{time.monotonic_ns()}", prompt, jpaged.SamplingParams(max_tokens=1))
            start = time.perf_counter()
            engine.step()
            recompute.append(time.perf_counter() - start)
        micro[block_size] = {"swap_s": float(np.median(swap[1:])), "recompute_s": float(np.median(recompute[1:]))}
        log(f"  block size {block_size:3d}: swap out + in of {n} tokens {micro[block_size]['swap_s'] * 1e3:.1f} ms, "
            f"recompute {micro[block_size]['recompute_s'] * 1e3:.1f} ms")
    return fig18, {"tokens": n, "micro": micro}


def fig19b(engines, args, vocab_size, fig12_results) -> dict:
    """Normalized latency with preemption by swap vs by recompute, overloaded. The paper uses
    ShareGPT; here the Alpaca-like trace, whose many short requests fill the small quick pool and
    get preempted (the ShareGPT-like one rarely is)."""
    trace = traces(args)[1]
    prompts, output_lens = sample_requests(trace, vocab_size, args.seed)
    rate = fig12_results[trace.name]["capacity_req_s"] * args.preemption_rate_fraction
    end_to_end = {}
    for mode in ("recompute", "swap"):
        run = replay(engines.get(kv_allocation="paged", preemption_mode=mode), prompts, output_lens, rate, args.seed)
        end_to_end[mode] = run
        log(f"  {mode:9s} at {rate:.2f} req/s: {run['normalized_latency']:.4f} s/token, "
            f"{run['preemptions']} preemptions ({run['busy_s']:.1f} s)")
    return {"trace": trace.name, "rate": rate, "end_to_end": end_to_end}


# ---------------------------------------------------------------------------------------- claims

def claims(results: dict) -> list[tuple[str, str, str, bool]]:
    """(claim, the paper's number, ours, whether the shape holds) for each figure."""
    rows = []
    f2 = results["fig2"]["policies"]
    if "paged" in f2:
        rows.append(("Fig. 2 (paper's sizes, scheduler only): share of allocated KV slots holding tokens, paged",
                     "96.3%", f"{f2['paged']['token_fraction']:.1%}", f2["paged"]["token_fraction"] >= 0.96))
    baselines = [p for p in ("orca-oracle", "orca-pow2", "orca-max") if p in f2]
    if baselines and "paged" in f2:
        ordered = [f2[p]["token_fraction"] for p in baselines]
        rows.append(("Fig. 2 (paper's sizes): the same for " + " / ".join(POLICY_LABELS[p] for p in baselines),
                     " / ".join(f"{PAPER['fig2_token_fraction'][p]:.1%}" for p in baselines),
                     " / ".join(f"{x:.1%}" for x in ordered),
                     ordered == sorted(ordered, reverse=True) and max(ordered) < f2["paged"]["token_fraction"]))
    for p, paper in (("orca-oracle", 2.2), ("orca-max", 4.3)):
        if p in f2 and "paged" in f2:
            gain = f2["paged"]["mean_batched_requests"] / f2[p]["mean_batched_requests"]
            rows.append((f"Fig. 13 (paper's sizes): requests batched, paged / {POLICY_LABELS[p]}", f"{paper}x",
                         f"{gain:.2f}x", gain >= paper / 2))
    f12 = results["fig12"]
    for name, r in f12.items():
        top = {p: runs[-1] for p, runs in r["runs"].items()}
        fractions = {p: top[p]["token_fraction"] for p in top}
        baselines = [p for p in ("orca-oracle", "orca-pow2", "orca-max") if p in fractions]
        if "paged" in fractions:
            rows.append((f"Fig. 2 ({name}): share of allocated KV slots holding tokens, paged",
                         "96.3%", f"{fractions['paged']:.1%}", fractions["paged"] >= 0.96))
        if baselines and "paged" in fractions:
            ordered = [fractions[p] for p in baselines]
            rows.append((f"Fig. 2 ({name}): the same for " + " / ".join(POLICY_LABELS[p] for p in baselines),
                         " / ".join(f"{PAPER['fig2_token_fraction'][p]:.1%}" for p in baselines),
                         " / ".join(f"{x:.1%}" for x in ordered),
                         ordered == sorted(ordered, reverse=True) and max(ordered) < fractions["paged"]))
        # At the highest rate every policy is overloaded: requests served per second is its capacity.
        caps = {p: runs[-1]["throughput_req_s"] for p, runs in r["runs"].items()}
        for p in ("orca-oracle", "orca-pow2", "orca-max", "static"):
            if p in caps and "paged" in caps:
                paper = {"orca-oracle": "1.7-2.7x", "orca-max": "2.7-8x", "static": "up to 22x",
                         "orca-pow2": "between Oracle and Max"}[p]
                gain = caps["paged"] / caps[p]
                rows.append((f"Fig. 12 ({name}): throughput at {r['rates'][-1]:.2f} req/s, paged / {POLICY_LABELS[p]}",
                             paper + " rate at equal latency (ShareGPT)",
                             f"{gain:.2f}x", gain > 1.2))
        batched = {p: runs[-1]["mean_batched_requests"] for p, runs in r["runs"].items()}
        for p, paper in (("orca-oracle", 2.2), ("orca-max", 4.3)):
            if p in batched and "paged" in batched:
                gain = batched["paged"] / batched[p]
                rows.append((f"Fig. 13 ({name}): requests batched at {r['rates'][-1]:.2f} req/s, paged / "
                             f"{POLICY_LABELS[p]}", f"{paper}x (ShareGPT)",
                             f"{gain:.2f}x", gain >= paper / 2))
    fp8 = results.get("fig13_fp8")
    if fp8:
        bf16_run, fp8_run = fp8["runs"]["auto"], fp8["runs"]["fp8"]
        per_step = "mean_batched_requests_per_step"
        gain = fp8_run[per_step] / bf16_run[per_step]
        rows.append((f"Fig. 13 shape, fp8 KV cache ({fp8['trace']}, all at once, {bf16_run['pool_mib']:.2f} MiB "
                     "of KV): requests batched per step, fp8 / bf16 pages", "about 2x (half the bytes per token)",
                     f"{gain:.2f}x ({fp8_run[per_step]:.1f} / {bf16_run[per_step]:.1f})", gain >= 1.5))
    sharing = results.get("fig14_16", [])
    for kind in ("parallel", "beam"):
        runs = [r for r in sharing if r["workload"] == kind]
        saved = [r["memory_saved"] for r in runs]
        if saved:
            lo, hi = PAPER["fig15_saved_alpaca"][kind]
            widths = ", ".join(str(r["width"]) for r in runs)
            rows.append((f"Fig. 15: KV memory saved by sharing, {kind} (widths {widths})",
                         f"{lo:.1%}-{hi:.1%} (Alpaca)", " / ".join(f"{x:.1%}" for x in saved), max(saved) >= lo))
    for shot, paper in PAPER["fig16_throughput_gain"].items():
        on = next((r for r in sharing if r["workload"] == f"prefix {shot}" and r["prefix_caching"]), None)
        if on:
            rows.append((f"Fig. 16 ({shot} prefix): speedup of sharing the prefix (caching on / off)",
                         f"{paper}x throughput vs Orca (Oracle)", f"{on['speedup']}x, hit rate {on['hit_rate']:.0%}",
                         on["speedup"] > 1))
    for name, r in results.get("fig18", {}).items():
        lat = {int(b): run["normalized_latency"] for b, run in r["runs"].items()}
        best = min(lat, key=lat.get)
        rows.append((f"Fig. 18 ({name}): best block size", "16-128 (ShareGPT), 16-32 (Alpaca)",
                     f"{best} ({', '.join(f'{b}: {lat[b]:.4f}' for b in sorted(lat))} s/token)",
                     16 in lat and lat[16] <= 1.1 * lat[best]))
    f19 = results.get("fig19")
    if f19:
        micro = {int(b): m for b, m in f19["micro"].items()}
        ratios = {b: m["recompute_s"] / m["swap_s"] for b, m in sorted(micro.items())}
        rows.append(("Fig. 19a: recompute time / swap time, by block size",
                     "swap costly at small blocks; recompute <= 1.2x swap",
                     ", ".join(f"{b}: {x:.2f}" for b, x in ratios.items()),
                     max(ratios.values()) <= PAPER["fig19_recompute_over_swap_max"]))
        e2e = f19["end_to_end"]
        ratio = e2e["swap"]["normalized_latency"] / e2e["recompute"]["normalized_latency"]
        rows.append((f"Fig. 19b ({f19['trace']}): normalized latency, swap / recompute (block size 16)",
                     "comparable (16-64)",
                     f"{ratio:.2f} ({e2e['recompute']['preemptions']} / {e2e['swap']['preemptions']} preemptions)",
                     0.8 <= ratio <= 1.25))
    return rows


def write_claims(rows, path: str, report: dict):
    lines = [f"<!-- written by scripts/reproduce_paper.py{' --quick' if report['quick'] else ''}: "
             f"{report['model']} on {report['backend']} ({report['machine']}), {report['total_s']} s -->",
             "| claim | paper | ours | shape holds |", "|---|---|---|---|"]
    lines += [f"| {c} | {p} | {o} | {'yes' if h else 'no'} |" for c, p, o, h in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------- figures

def plot(results: dict, out_dir: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)

    f12 = results["fig12"]
    fig, axes = plt.subplots(1, len(f12), figsize=(5.5 * len(f12), 4))
    for ax, (name, r) in zip(np.atleast_1d(axes), f12.items()):
        for policy, runs in r["runs"].items():
            ax.plot([x["rate"] for x in runs], [x["normalized_latency"] for x in runs], "o-",
                    label=POLICY_LABELS[policy])
        ax.set(title=f"{name}-like trace (Fig. 12)", xlabel="request rate (req/s)",
               ylabel="normalized latency (s/token)", yscale="log")
        ax.legend(fontsize=8)
    save(fig, "fig12_latency_vs_rate.png")

    # Figs. 13 and 2: the paper-scale scheduler-only run, then each quick trace at its highest rate.
    panels = [("paper's sizes, ShareGPT-like\n(scheduler and block manager only)", results["fig2"]["policies"])]
    panels += [(f"{name}-like at {r['rates'][-1]:.2f} req/s", {p: runs[-1] for p, runs in r["runs"].items()})
               for name, r in f12.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, runs) in zip(axes, panels):
        policies = list(runs)
        ax.bar(range(len(policies)), [runs[p]["mean_batched_requests"] for p in policies],
               color=[f"C{i}" for i in range(len(policies))])
        ax.set_xticks(range(len(policies)), policies, fontsize=7)
        ax.set(title=title + " (Fig. 13)", ylabel="mean batched requests")
    save(fig, "fig13_batched_requests.png")

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5))
    for ax, (title, runs) in zip(axes, panels):
        policies = [p for p in runs if p != "static"]
        bottom = np.zeros(len(policies))
        for part, color, label in (("token", "#16a34a", "token states"), ("reserved", "#facc15", "reservation"),
                                   ("fragmented", "#ef4444", "internal fragmentation")):
            values = np.array([runs[p][f"{part}_fraction"] * 100 for p in policies])
            ax.bar(range(len(policies)), values, bottom=bottom, color=color, label=label)
            bottom += values
        for i, p in enumerate(policies):
            ax.text(i, 2, f"{runs[p]['token_fraction']:.1%}", ha="center", fontsize=8, color="white")
            ax.plot([i - 0.4, i + 0.4], [PAPER["fig2_token_fraction"][p] * 100] * 2, "k--", lw=1)
        ax.set_xticks(range(len(policies)), policies, fontsize=8)
        ax.set(title=title + "\n(Fig. 2; dashes: the paper)", ylabel="% of allocated KV slots", ylim=(0, 100))
        ax.legend(fontsize=7, loc="upper right")
    save(fig, "fig2_memory_breakdown.png")

    sharing = results["fig14_16"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("parallel", "beam")):
        rows = [r for r in sharing if r["workload"] == kind]
        ax.bar([str(r["width"]) for r in rows], [r["memory_saved"] * 100 for r in rows], color="#7c3aed", label="ours")
        for key, style in (("fig15_saved_alpaca", "k--"), ("fig15_saved_sharegpt", "k:")):
            lo, hi = PAPER[key][kind]
            ax.axhspan(lo * 100, hi * 100, alpha=0.12, color="k" if "alpaca" in key else "b",
                       label="paper, " + key.split("_")[-1])
        ax.set(title=f"{'parallel sampling (n)' if kind == 'parallel' else 'beam search (width)'}: "
               "memory saved by sharing (Figs. 14-15)", xlabel="n" if kind == "parallel" else "beam width",
               ylabel="% of KV blocks saved")
        ax.legend(fontsize=7)
    save(fig, "fig15_sharing_savings.png")

    prefix = [r for r in sharing if r["workload"].startswith("prefix")]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = sorted({r["workload"] for r in prefix})
    for i, caching in enumerate((False, True)):
        ax.bar(np.arange(len(names)) + 0.4 * i - 0.2,
               [next(r for r in prefix if r["workload"] == n and r["prefix_caching"] == caching)["elapsed_s"]
                for n in names], 0.4, label="prefix caching " + ("on" if caching else "off"))
    ax.set_xticks(range(len(names)), names)
    ax.set(title="Shared-prefix prompts (Fig. 16): time to serve", ylabel="seconds")
    ax.legend()
    save(fig, "fig16_shared_prefix.png")

    f18 = results["fig18"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in f18.items():
        sizes = sorted(r["runs"], key=int)
        ax.plot([str(s) for s in sizes], [r["runs"][s]["normalized_latency"] for s in sizes], "o-",
                label=f"{name}-like at {r['rate']:.2f} req/s")
    ax.set(title="Block size (Fig. 18b)", xlabel="block size (tokens)", ylabel="normalized latency (s/token)")
    ax.legend(fontsize=8)
    save(fig, "fig18_block_size.png")

    f19 = results["fig19"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sizes = sorted(f19["micro"], key=int)
    axes[0].plot([str(s) for s in sizes], [f19["micro"][s]["swap_s"] * 1e3 for s in sizes], "o-", label="swap out + in")
    axes[0].plot([str(s) for s in sizes], [f19["micro"][s]["recompute_s"] * 1e3 for s in sizes], "o-",
                 label="recompute")
    axes[0].set(title=f"(a) overhead for {f19['tokens']} tokens (Fig. 19a)", xlabel="block size",
                ylabel="ms")
    axes[0].legend()
    modes = list(f19["end_to_end"])
    axes[1].bar(modes, [f19["end_to_end"][m]["normalized_latency"] for m in modes], color=["C0", "C1"])
    axes[1].set(title=f"(b) {f19['trace']}-like at {f19['rate']:.2f} req/s (Fig. 19b)\n"
                f"{' / '.join(str(f19['end_to_end'][m]['preemptions']) for m in modes)} preemptions",
                ylabel="normalized latency (s/token)")
    save(fig, "fig19_recompute_vs_swap.png")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized: ShareGPT lengths / 4, fewer requests")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "docs", "figures"))
    parser.add_argument("--policies", nargs="+", default=list(KV_ALLOCATIONS), choices=KV_ALLOCATIONS)
    parser.add_argument("--rate-fractions", type=float, nargs="+",
                        help="request rates as fractions of paged allocation's capacity")
    parser.add_argument("--fixed-rate-fraction", type=float, default=0.5, help="the rate of Fig. 18")
    parser.add_argument("--preemption-rate-fraction", type=float, default=math.inf,
                        help="the rate of Fig. 19b (default: all requests at once, so that the pool fills and "
                        "requests are preempted)")
    parser.add_argument("--block-sizes", type=int, nargs="+")
    parser.add_argument("--num-requests", type=int, help="of the ShareGPT-like trace; twice as many Alpaca-like "
                        "(default: 32 quick, 1000 full)")
    parser.add_argument("--kv-slots", type=int, help="KV pool size in tokens (default: 2048 quick, 32768 full)")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--swap-space", type=float, default=0.5, help="GiB of host memory for swapped KV")
    parser.add_argument("--memory-requests", type=int, default=150, help="requests of the paper-scale Fig. 2 run")
    parser.add_argument("--memory-kv-slots", type=int, default=15_696,
                        help="KV slots of the paper-scale Fig. 2 run (OPT-13B on an A100-40GB: 15.7K)")
    parser.add_argument("--sharing-prompts", type=int, help="prompts per sharing workload (bench_sharing)")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--recompute-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true", help="compile step shapes on first use")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    q = args.quick
    defaults = dict(rate_fractions=[0.3, 1.0, 2.5] if q else [0.2, 0.4, 0.6, 0.8, 1.0, 1.5, 2.5],
                    block_sizes=[8, 16, 128] if q else [8, 16, 32, 64, 128], kv_slots=2048 if q else 32768,
                    max_model_len=512 if q else 2048, max_num_seqs=64 if q else 256,
                    sharing_prompts=12 if q else 64)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    os.makedirs(args.output_dir, exist_ok=True)
    start = time.perf_counter()
    engines = Engines(args)
    vocab_size = engines.get(kv_allocation="paged").llm_engine.hf_config.vocab_size
    log("Fig. 2 at the paper's sizes (scheduler and block manager only)")
    results = {"fig2": fig2_paper_scale(args)}
    log("Figs. 12, 13 and 2: latency vs rate per allocation policy")
    results["fig12"] = fig12(engines, args, vocab_size)
    log("Fig. 13 for the fp8 KV cache: requests batched at the same KV memory, fp8 vs bf16 pages")
    results["fig13_fp8"] = fig13_fp8(engines, args, vocab_size)
    log("Figs. 18 and 19a: block size; swap vs recompute")
    results["fig18"], results["fig19"] = fig18_19a(engines, args, vocab_size, results["fig12"])
    log("Fig. 19b: preemption by recompute vs swap")
    results["fig19"].update(fig19b(engines, args, vocab_size, results["fig12"]))
    log("Figs. 14-16: sharing (bench_sharing)")
    results["fig14_16"] = fig14_16(engines, args)
    report = {"model": args.model, "quick": q, "backend": jax.default_backend(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "args": {k: v for k, v in vars(args).items()}, "paper": PAPER, "results": results,
              "total_s": round(time.perf_counter() - start, 1)}
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    plot(results, args.output_dir)
    rows = claims(results)
    write_claims(rows, os.path.join(args.output_dir, "claims.md"), report)
    for c, p, o, h in rows:
        log(f"{'HOLDS' if h else 'DIFFERS':7s} {c}: paper {p}, ours {o}")
    log(f"done in {report['total_s']} s: figures and results.json in {args.output_dir}")
    return report


if __name__ == "__main__":
    main()
