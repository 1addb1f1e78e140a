"""Online serving benchmark against any OpenAI-compatible server (vLLM's benchmark_serving.py, for jpaged).

Requests arrive as a Poisson process at --request-rate per second (default inf: all at once),
each streaming a /v1/completions request whose prompt is token ids (ShareGPT-like synthetic
lengths, the same generator as bench_throughput.py) with ignore_eos, so it produces exactly its
requested number of tokens. Metrics follow vLLM's definitions:
  TTFT  time from sending the request to the first chunk with text
  ITL   time between successive chunks with text (every gap of every request)
  TPOT  per request: (latency - TTFT) / (output tokens - 1), for requests with > 1 output token
  E2EL  end-to-end latency of a request
Output tokens are the server's usage.completion_tokens (stream_options.include_usage).

Example (CPU, the built-in model; start the server first in another shell):
  JAX_PLATFORMS=cpu jpaged serve --model tiny --max-num-seqs 32 --max-model-len 1024
  python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model tiny --num-prompts 32 \\
      --length-scale 0.1 --request-rate 8
"""

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_throughput import Request, sample_lengths  # noqa: E402  (the shared synthetic workload)


@dataclasses.dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def vocab_size_of(tokenizer: str) -> int:
    if tokenizer == "tiny":
        from jpaged.models.tiny import tiny_tokenizer

        return len(tiny_tokenizer())
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer))


def make_requests(args) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    vocab = args.vocab_size or vocab_size_of(args.tokenizer or args.model)
    # Skip the lowest ids: special tokens live there in most vocabularies.
    return [Request(rng.integers(min(256, vocab // 2), vocab, size=p).tolist(), o)
            for p, o in sample_lengths(args, rng)]


async def send(session: aiohttp.ClientSession, args, request: Request) -> Result:
    body = {"model": args.model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = Result(ok=False, prompt_len=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        async with session.post(args.base_url.rstrip("/") + "/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                now = time.perf_counter()
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
            result.latency = time.perf_counter() - start
            result.ok = True
    except aiohttp.ClientError as e:
        result.error = repr(e)
    return result


async def run(args, requests: list[Request]) -> tuple[list[Result], float]:
    rng = np.random.default_rng(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def limited(request):
            async with limit:
                return await send(session, args, request)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(limited(request)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
               "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": output,
               "request_throughput": len(ok) / duration, "output_throughput": output / duration,
               "total_token_throughput": (output + sum(r.prompt_len for r in ok)) / duration}
    samples = {"ttft": [r.ttft for r in ok], "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1)
                                                      for r in ok if r.output_tokens > 1],
               "itl": [gap for r in ok for gap in r.itl], "e2el": [r.latency for r in ok]}
    for name, values in samples.items():
        values = np.asarray(values or [0.0]) * 1000
        summary.update({f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
                        f"p99_{name}_ms": float(np.percentile(values, 99))})
    return summary


def print_table(summary: dict, args):
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Request rate (req/s)", args.request_rate), ("Benchmark duration (s)", summary["duration_s"]),
            ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"]),
            ("Output token throughput (tok/s)", summary["output_throughput"]),
            ("Total token throughput (tok/s)", summary["total_token_throughput"])]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    for label, value in rows:
        print(f"{label + ':':<44}{value:>16.2f}" if isinstance(value, float) else f"{label + ':':<44}{value:>16}")
    for name, title in titles.items():
        print("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {name.upper()} (ms):':<44}{summary[f'{stat}_{name}_ms']:>16.2f}")
    print("=" * 60)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default="tiny", help="model name sent in requests")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer for the vocabulary size (default: --model)")
    p.add_argument("--vocab-size", type=int, default=None, help="skip loading a tokenizer: draw ids below this")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply sampled lengths (CPU runs)")
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length instead of the distribution")
    p.add_argument("--output-len", type=int, default=None, help="fixed output length instead of the distribution")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    results, duration = asyncio.run(run(args, make_requests(args)))
    summary = summarize(results, duration)
    print_table(summary, args)
    for r in results:
        if not r.ok:
            print("failed:", r.error, file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
