"""Decode time per step against the KV pool's size, for each KV cache dtype: a step must cost what
it reads and writes, never the pool (issue: an fp8 pool once cost 1.7 s per token at 8,192 blocks
on a CPU, where XLA converted the whole pool around every page write).

    JAX_PLATFORMS=cpu python scripts/bench_kv_pool.py --model tiny --blocks 256 8192 default
    JAX_PLATFORMS=cpu python scripts/bench_kv_pool.py --model /path/to/SmolLM2 --dtype bfloat16

Each configuration builds its own engine (enforce_eager: only the shapes used are compiled), runs
one warm-up request, then times `--batch` greedy requests of `--tokens` tokens each. "default"
is the pool the engine sizes itself.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def measure(model, dtype, kv_cache_dtype, blocks, batch, tokens, repeats):
    import jpaged

    llm = jpaged.LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, enforce_eager=True, max_num_seqs=batch,
                     max_model_len=256, num_gpu_blocks_override=None if blocks == "default" else int(blocks))
    prompts = [f"Request {i}: tell me a story about paging." for i in range(batch)]
    params = jpaged.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, jpaged.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append((time.perf_counter() - start) / tokens)
    num_blocks = llm.llm_engine.runner.num_gpu_blocks
    pool_mib = 2 * llm.llm_engine.runner.kv_cache.k_pages.nbytes / 2**20
    del llm
    return num_blocks, pool_mib, statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"])
    p.add_argument("--blocks", nargs="+", default=["256", "8192", "default"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print("| kv_cache_dtype | pool blocks | pool MiB | ms per decode step |\n|---|---|---|---|")
    for kv_cache_dtype in args.kv_cache_dtypes:
        for blocks in args.blocks:
            num_blocks, pool_mib, seconds = measure(args.model, args.dtype, kv_cache_dtype, blocks, args.batch,
                                                    args.tokens, args.repeats)
            print(f"| {kv_cache_dtype} | {num_blocks}{' (default)' if blocks == 'default' else ''} | "
                  f"{pool_mib:.0f} | {seconds * 1000:.1f} |", flush=True)


if __name__ == "__main__":
    main()
