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

Experiments (figures in --output-dir, PNG, drawn by paper_figures.py beside this script, with
claims.md and results.json):
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


def _load_script(name: str):
    """A module beside this script, by its file (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_sharing = _load_script("bench_sharing")
paper_figures = _load_script("paper_figures")  # the paper's numbers, claims.md and the figures


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
              "args": {k: v for k, v in vars(args).items()}, "paper": paper_figures.PAPER, "results": results,
              "total_s": round(time.perf_counter() - start, 1)}
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    paper_figures.plot(results, args.output_dir)
    rows = paper_figures.claims(results)
    paper_figures.write_claims(rows, os.path.join(args.output_dir, "claims.md"), report)
    for c, p, o, h in rows:
        log(f"{'HOLDS' if h else 'DIFFERS':7s} {c}: paper {p}, ours {o}")
    log(f"done in {report['total_s']} s: figures and results.json in {args.output_dir}")
    return report


if __name__ == "__main__":
    main()
