"""Sharing benchmark: the KV memory that block sharing saves (paper §6.3-6.4), measured.

Workloads, on the built-in `tiny` model (any --model works) with Alpaca-like lengths (the
paper's Alpaca: prompts of 19.3 tokens and outputs of 58.5 on average; lognormal here, prompts
capped at 128 tokens and outputs at 256) and random token ids:

  parallel sampling  n = 2, 4, 6 samples per prompt (temperature 1, seeded): the samples share
                     their prompt's full blocks.
  beam search        width 2, 4, 6: beams share their common history, forking every step.
  shared prefix      every prompt starts with one common prefix of ~80 tokens (the paper's
                     1-shot translation prompt) or ~340 tokens (5-shot), followed by its own
                     Alpaca-like "sentence"; prefix caching on, then off for comparison.

Every request ignores EOS, so it produces exactly its sampled output length. All requests are
submitted at once and the engine runs them to completion with a pool large enough never to
preempt. After every step the script reads `llm.stats()`: `num_gpu_blocks_in_use` (device
blocks held) and `num_gpu_blocks_without_sharing` (what the same block tables would hold if no
block were shared). Memory saved = 1 - sum(in use) / sum(without sharing) over all steps: the
paper's "blocks saved by sharing / blocks without sharing", averaged over the run. For the
shared-prefix workload it also reports the prefix cache hit rate (in tokens: hits / queries,
as vLLM v1 counts) and the prompt tokens whose prefill was saved, with wall times on vs off.

  JAX_PLATFORMS=cpu python scripts/bench_sharing.py --output-json /tmp/sharing.json
"""

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jpaged  # noqa: E402

# Alpaca-like lengths: lognormal (mean, sigma of the log), capped.
ALPACA_PROMPT = (19.3, 0.6, 4, 128)
ALPACA_OUTPUT = (58.5, 0.8, 4, 256)
PREFIX_LENS = {"1-shot": 80, "5-shot": 340}  # the paper's translation prompts: 80 and 341 tokens


def lengths(rng, n, mean, sigma, low, high) -> list[int]:
    mu = math.log(mean) - sigma ** 2 / 2  # so that the mean before capping is `mean`
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), low, high).astype(int).tolist()


def alpaca_requests(rng, n, vocab_size):
    prompts = [rng.integers(0, vocab_size, size=p).tolist() for p in lengths(rng, n, *ALPACA_PROMPT)]
    return prompts, lengths(rng, n, *ALPACA_OUTPUT)


def run(llm, prompts, params) -> dict:
    """Run every request to completion; time-averaged block counts and prefix cache counters."""
    engine = llm.llm_engine
    before = llm.stats()
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, sp)
    in_use = without = peak_in_use = peak_without = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        stats = llm.stats()
        in_use += stats["num_gpu_blocks_in_use"]
        without += stats["num_gpu_blocks_without_sharing"]
        peak_in_use = max(peak_in_use, stats["num_gpu_blocks_in_use"])
        peak_without = max(peak_without, stats["num_gpu_blocks_without_sharing"])
        steps += 1
    elapsed = time.perf_counter() - start
    after = llm.stats()
    return {"requests": len(prompts), "steps": steps, "elapsed_s": round(elapsed, 2),
            "prompt_tokens": sum(map(len, prompts)),
            "memory_saved": round(1 - in_use / without, 4),
            "mean_blocks_in_use": round(in_use / steps, 1), "mean_blocks_without_sharing": round(without / steps, 1),
            "peak_blocks_in_use": peak_in_use, "peak_blocks_without_sharing": peak_without,
            "preemptions": after["num_preemptions"] - before["num_preemptions"],
            "prefix_cache_queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
            "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"]}


def bench_parallel_and_beam(llm, args, vocab_size) -> list[dict]:
    results = []
    rng = np.random.default_rng(args.seed)
    prompts, output_lens = alpaca_requests(rng, args.num_prompts, vocab_size)
    for kind in ("parallel", "beam"):
        for width in args.widths:
            if kind == "parallel":
                params = [jpaged.SamplingParams(n=width, temperature=1.0, seed=args.seed + i, max_tokens=m,
                                                ignore_eos=True) for i, m in enumerate(output_lens)]
            else:
                params = [jpaged.SamplingParams(use_beam_search=True, n=width, temperature=0, max_tokens=m,
                                                ignore_eos=True) for m in output_lens]
            result = {"workload": kind, "width": width, **run(llm, prompts, params)}
            print(f"{kind:8s} {width}: memory saved {result['memory_saved']:.1%} "
                  f"(blocks in use {result['mean_blocks_in_use']} vs {result['mean_blocks_without_sharing']} "
                  f"without sharing, {result['steps']} steps, {result['elapsed_s']} s)", flush=True)
            results.append(result)
    return results


def bench_shared_prefix(llms, args, vocab_size) -> list[dict]:
    results = []
    for name, prefix_len in PREFIX_LENS.items():
        rng = np.random.default_rng(args.seed + prefix_len)
        prefix, warm_up_prefix = rng.integers(0, vocab_size, size=(2, prefix_len)).tolist()
        sentences, _ = alpaca_requests(rng, args.num_prompts, vocab_size)
        # A translation is about as long as its source sentence.
        params = [jpaged.SamplingParams(temperature=0, max_tokens=len(s), ignore_eos=True) for s in sentences]
        for caching, llm in llms.items():
            # The same requests with another prefix first: the same step shapes, so the timed run
            # compiles nothing (enforce_eager compiles on first use).
            run(llm, [warm_up_prefix + s for s in sentences], params)
            result = {"workload": f"prefix {name}", "prefix_len": prefix_len, "prefix_caching": caching,
                      **run(llm, [prefix + s for s in sentences], params)}
            if caching:
                result["hit_rate"] = round(result["prefix_cache_hits"] / result["prefix_cache_queries"], 4)
                result["prefill_tokens_saved"] = result["prefix_cache_hits"]
            results.append(result)
        on, off = results[-2:]
        on["speedup"] = round(off["elapsed_s"] / on["elapsed_s"], 2)
        print(f"prefix {name}: hit rate {on['hit_rate']:.1%}, prefill tokens computed "
              f"{on['prompt_tokens'] - on['prefill_tokens_saved']} of {on['prompt_tokens']}, memory saved "
              f"{on['memory_saved']:.1%}; {on['elapsed_s']} s with caching vs {off['elapsed_s']} s without "
              f"({on['speedup']}x)", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false",
                        help="compile every step shape at start-up (default: on first use)")
    parser.add_argument("--skip", choices=["sharing", "prefix"], nargs="*", default=[])
    parser.add_argument("--output-json")
    args = parser.parse_args()

    # The longest request: the 5-shot prefix, a sentence and its translation (each within the prompt cap).
    max_model_len = max(ALPACA_PROMPT[3] + ALPACA_OUTPUT[3], max(PREFIX_LENS.values()) + 2 * ALPACA_PROMPT[3])
    engine_kwargs = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         num_gpu_blocks_override=args.num_gpu_blocks_override, enforce_eager=args.enforce_eager,
                         seed=args.seed)
    start = time.perf_counter()
    plain = jpaged.LLM(args.model, **engine_kwargs)
    vocab_size = plain.llm_engine.hf_config.vocab_size
    results = []
    if "sharing" not in args.skip:  # sharing by forking only: no prefix cache
        results += bench_parallel_and_beam(plain, args, vocab_size)
    if "prefix" not in args.skip:
        cached = jpaged.LLM(args.model, enable_prefix_caching=True, **engine_kwargs)
        results += bench_shared_prefix({True: cached, False: plain}, args, vocab_size)
    report = {"model": args.model, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "engine": engine_kwargs, "num_prompts": args.num_prompts, "total_s": round(time.perf_counter() - start, 1),
              "results": results}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
