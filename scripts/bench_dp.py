"""Data-parallel benchmark: prefix-cache hit rate and TTFT by routing policy (`--dp-routing`).

Workload (issue 42's): 16 system prompts of ~1k tokens, 8 users each with their own ~32-token
question after it, sent in random order by 16 concurrent streaming clients, 16 tokens each
(ignore_eos). Each run starts `jpaged serve --data-parallel-size N --dp-routing POLICY
--enable-prefix-caching` on the built-in `tiny` model (any --model works), waits for it, sends
the workload and reads the replicas' /metrics: prefix-cache hits / queries in tokens (vLLM v1's
count) summed over the `engine` labels, and the clients' TTFT p50 / p99 and tokens/s.

The replicas' pools are sized (--num-gpu-blocks-override, default: room for a third of the system
prompts, plus the running requests) so that one replica cannot keep every prefix: routing decides
what stays cached, which is what it is for. With pools that hold everything every policy ends
near (users - 1) / users; docs/PERF.md has the hit rates at three pool sizes.

  JAX_PLATFORMS=cpu python scripts/bench_dp.py --output-json /tmp/dp.json

`--ray` adds runs through Ray Serve (jpaged.ray:build_app on a local Ray cluster this script
starts, two LLMServer replicas): `--runs` entries `ray:ROUTER` (prefix, least-loaded,
round-robin, ray-prefix: Ray's PrefixCacheAffinityRouter, pow-2: Ray's default), and the TTFT
p50 of `ray:prefix` against `2:prefix` (`jpaged serve --data-parallel-size 2`) is printed.

  JAX_PLATFORMS=cpu python scripts/bench_dp.py --ray --output-json /tmp/dp_ray.json
"""

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time

import aiohttp


def start_server(args, size: int, policy: str) -> tuple[subprocess.Popen, str, list]:
    command = [sys.executable, "-m", "serving.cli", "serve", "--model", args.model, "--port", "0",
               "--data-parallel-size", str(size), "--dp-routing", policy, "--enable-prefix-caching",
               "--max-model-len", str(args.max_model_len), "--max-num-seqs", "16",
               "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--disable-log-stats"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log, ready = [], threading.Event()
    url = []

    def drain():
        for line in proc.stdout:
            log.append(line)
            if not url and line.startswith("jpaged: serving"):
                url.append(line.split(" at ")[1].split("/v1")[0])
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait(1800)
    if not url:
        proc.kill()
        raise RuntimeError("the server did not start:\n" + "".join(log[-40:]))
    return proc, url[0], log


class RayCluster:
    """A local Ray cluster with Serve's proxy on a free port; one application at a time."""

    def __init__(self):
        import socket

        import ray
        from ray import serve

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
            "PYTHONPATH": root, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})

    def start(self, args, router: str) -> str:
        from ray import serve

        from jpaged.ray import build_app

        serve.run(build_app({"model": args.model, "num_replicas": 2, "request_router": router,
                             "enable_prefix_caching": True, "max_model_len": args.max_model_len, "max_num_seqs": 16,
                             "num_gpu_blocks_override": args.num_gpu_blocks, "disable_log_stats": True}),
                  name="bench", route_prefix="/")
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        from ray import serve

        serve.delete("bench")


def wait_until_warm(url: str, timeout_s: float = 1800):
    """Until /health says "ready" (every replica's background warm-up done): TTFT is measured warm."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if json.load(r).get("ready"):
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url}: not warm after {timeout_s} s")


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(1, 255) for _ in range(args.system_tokens)] for _ in range(args.num_prefixes)]
    prompts = [s + [rng.randrange(1, 255) for _ in range(args.user_tokens)] for s in systems
               for _ in range(args.users)]
    rng.shuffle(prompts)
    return prompts


async def run_clients(url: str, prompts: list[list[int]], args) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttfts, tokens = [], 0

    async def client(session):
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            start, first = time.monotonic(), None
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {") and first is None:
                        first = time.monotonic() - start
            ttfts.append(first)
            tokens += args.max_tokens

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def counters() -> dict:
            async with session.get(url + "/metrics") as r:
                text = await r.text()
            return {(name, engine): float(v) for name, engine, v in re.findall(
                r'^jpaged:prefix_cache_(hits|queries)_total\{model_name="[^"]*"(?:,engine="([^"]+)")?\} (\S+)$',
                text, re.M)}

        before = await counters()
        start = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
        elapsed = time.monotonic() - start
        after = await counters()
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    hits = sum(v for (name, _), v in delta.items() if name == "hits")
    queries = sum(v for (name, _), v in delta.items() if name == "queries")
    ttfts.sort()
    return {"hit_rate": hits / queries if queries else 0.0, "hits": hits, "queries": queries,
            "queries_per_engine": {engine or "0": v for (name, engine), v in delta.items() if name == "queries"},
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "tokens_per_s": tokens / elapsed, "wall_s": elapsed}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="each replica's KV pool (default: a third of the system prompts' blocks, plus room "
                        "to run)")
    parser.add_argument("--runs", default="2:prefix,2:least-loaded,2:round-robin,1:prefix",
                        help="comma-separated SIZE:POLICY runs")
    parser.add_argument("--ray", action="store_true", help="also through Ray Serve (runs ray:ROUTER; default "
                        "runs: 2:prefix,ray:prefix,ray:ray-prefix,ray:round-robin)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    if args.num_gpu_blocks is None:
        block = 16
        args.num_gpu_blocks = (args.num_prefixes // 3) * (args.system_tokens // block) + \
            args.concurrency * ((args.user_tokens + args.max_tokens) // block + 2)
    if args.ray and args.runs == parser.get_default("runs"):
        args.runs = "2:prefix,ray:prefix,ray:ray-prefix,ray:round-robin"
    prompts = workload(args)
    results = []
    cluster = RayCluster() if args.ray else None
    for run in args.runs.split(","):
        size, policy = run.split(":")
        if size == "ray":
            url = cluster.start(args, policy)
            proc = None
        else:
            proc, url, log = start_server(args, int(size), policy)
        try:
            wait_until_warm(url)
            # Warm-up: the step shapes run once, on prompts that share nothing with the workload.
            asyncio.run(run_clients(url, workload(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}))
                                    [:args.concurrency], args))
            row = {"data_parallel_size": 2 if size == "ray" else int(size), "dp_routing": policy,
                   "ray_serve": size == "ray", **asyncio.run(run_clients(url, prompts, args))}
        finally:
            if proc is None:
                cluster.stop()
            else:
                proc.terminate()
                proc.wait(120)
        print(json.dumps(row), flush=True)
        results.append(row)
    by = {("ray" if r["ray_serve"] else r["data_parallel_size"], r["dp_routing"]): r for r in results}
    if ("ray", "prefix") in by and (2, "prefix") in by:
        overhead = by["ray", "prefix"]["ttft_p50_s"] / by[2, "prefix"]["ttft_p50_s"] - 1
        print(f"Ray Serve TTFT p50 overhead against jpaged serve --data-parallel-size 2: {100 * overhead:+.1f}% "
              "(goal: within 10%)")
    if (2, "prefix") in by and (2, "round-robin") in by:
        ratio = by[2, "prefix"]["hit_rate"] / max(by[2, "round-robin"]["hit_rate"], 1e-9)
        print(f"prefix / round-robin hit rate at N=2: {ratio:.2f}x (goal >= 1.8x)")
    if (2, "prefix") in by and (1, "prefix") in by:
        print(f"N=2 / N=1 tokens/s: {by[2, 'prefix']['tokens_per_s'] / by[1, 'prefix']['tokens_per_s']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"machine": platform.machine(), "cpus": os.cpu_count(), "load": os.getloadavg(),
                       "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
