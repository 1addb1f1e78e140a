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

`--sweep` runs prefix and round-robin routing over sharing patterns (`--patterns`: few-long,
many-short, chat; PATTERNS below) and pool sizes (`--pools`: the fraction of the pattern's
shared prefixes one replica's pool holds, plus room to run), and prints one table: hit rate, TTFT
p50 / p99, tokens/s per run, and per pattern and pool the prefix / round-robin ratio with its
bound: the most any router can find (`ceiling`: every block cached after its first sight, the
first request of each prefix missing) over round-robin's hit rate.

  JAX_PLATFORMS=cpu python scripts/bench_dp.py --sweep --pools 1/3,1/2,1 --output-json /tmp/dp_sweep.json
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


# Sharing patterns for --sweep: (prefixes, their tokens, users per prefix, tokens per user turn, turns).
PATTERNS = {
    "few-long": dict(num_prefixes=4, system_tokens=2048, users=16, user_tokens=32, turns=1),
    "many-short": dict(num_prefixes=48, system_tokens=256, users=4, user_tokens=32, turns=1),
    "chat": dict(num_prefixes=8, system_tokens=512, users=4, user_tokens=64, turns=4),
}


def workload(args) -> list[list[list[int]]]:
    """Sessions in random order, each a list of prompts sent one after the other by one client:
    users of a shared prefix with one question each, or (turns > 1) multi-turn chats whose every
    turn resends the conversation so far (the replies stood in for by `max_tokens` fixed tokens)."""
    rng = random.Random(args.seed)
    turns = getattr(args, "turns", 1)
    systems = [[rng.randrange(1, 255) for _ in range(args.system_tokens)] for _ in range(args.num_prefixes)]
    sessions = []
    for system in systems:
        for _ in range(args.users):
            history, session = list(system), []
            for _ in range(turns):
                history += [rng.randrange(1, 255) for _ in range(args.user_tokens)]
                session.append(list(history))
                history += [rng.randrange(1, 255) for _ in range(args.max_tokens)]
            sessions.append(session)
    rng.shuffle(sessions)
    return sessions


def ceiling(sessions: list[list[list[int]]], block: int = 16) -> float:
    """The most any routing finds (tokens hit / prompt tokens): every full block cached from its
    first sight on, in the order sessions are listed (a session's turns in order); the block of a
    prompt's last token is always computed."""
    seen, hits, queries = set(), 0, 0
    for session in sessions:
        for prompt in session:
            key, matched = (), True
            for i in range((len(prompt) - 1) // block):
                key = hash((key, tuple(prompt[i * block:(i + 1) * block])))
                if matched and key in seen:
                    hits += block
                else:
                    matched = False
                seen.add(key)
            queries += len(prompt)
    return hits / queries


async def run_clients(url: str, sessions: list[list[list[int]]], args) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for session in sessions:
        queue.put_nowait(session)
    ttfts, tokens = [], 0

    async def client(session):
        nonlocal tokens
        while not queue.empty():
            for prompt in queue.get_nowait():  # a chat's turns one after the other
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


def pool_blocks(args, fraction: float) -> int:
    """A replica's pool: `fraction` of the shared prefixes' blocks (a chat's whole conversations
    count), plus room for the running requests."""
    block, turns = 16, getattr(args, "turns", 1)
    shared = args.num_prefixes * args.system_tokens // block
    if turns > 1:  # each chat's history is a prefix of its next turn
        shared += args.num_prefixes * args.users * turns * (args.user_tokens + args.max_tokens) // block
    longest = args.system_tokens + turns * (args.user_tokens + args.max_tokens)
    return int(fraction * shared) + args.concurrency * ((longest - args.system_tokens) // block + 2)


def run_one(args, size: str, policy: str, sessions, cluster=None) -> dict:
    if size == "ray":
        url, proc = cluster.start(args, policy), None
    else:
        proc, url, _ = start_server(args, int(size), policy)
    try:
        wait_until_warm(url)
        # Warm-up: the step shapes run once, on prompts that share nothing with the workload.
        asyncio.run(run_clients(url, workload(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}))
                                [:args.concurrency], args))
        return {"data_parallel_size": 2 if size == "ray" else int(size), "dp_routing": policy,
                "ray_serve": size == "ray", "num_gpu_blocks": args.num_gpu_blocks,
                **asyncio.run(run_clients(url, sessions, args))}
    finally:
        if proc is None:
            cluster.stop()
        else:
            proc.terminate()
            proc.wait(120)


def sweep(args) -> list[dict]:
    """Prefix and round-robin routing over --patterns x --pools, at N=2; one table."""
    results, lines = [], []
    for pattern in args.patterns.split(","):
        if pattern not in PATTERNS:
            raise SystemExit(f"--patterns: {pattern!r}; expected some of {sorted(PATTERNS)}")
        shaped = argparse.Namespace(**{**vars(args), **PATTERNS[pattern]})
        longest = shaped.system_tokens + shaped.turns * (shaped.user_tokens + shaped.max_tokens)
        shaped.max_model_len = max(args.max_model_len, 16 * (longest // 16 + 1))
        sessions = workload(shaped)
        bound = ceiling(sessions)
        for fraction_text in args.pools.split(","):
            num, _, den = fraction_text.partition("/")
            shaped.num_gpu_blocks = pool_blocks(shaped, float(num) / float(den or 1))
            rows = {}
            for policy in ("prefix", "round-robin"):
                row = {"pattern": pattern, "pool": fraction_text, "ceiling": bound,
                       **run_one(shaped, "2", policy, sessions)}
                print(json.dumps(row), flush=True)
                results.append(row)
                rows[policy] = row
            p, rr = rows["prefix"], rows["round-robin"]
            lines.append(f"| {pattern} | {fraction_text} ({shaped.num_gpu_blocks}) | {bound:.3f} | {p['hit_rate']:.3f} | "
                         f"{rr['hit_rate']:.3f} | {p['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x | "
                         f"{bound / max(rr['hit_rate'], 1e-9):.2f}x | {p['ttft_p50_s']:.2f} / {p['ttft_p99_s']:.2f} | "
                         f"{rr['ttft_p50_s']:.2f} / {rr['ttft_p99_s']:.2f} | {p['tokens_per_s']:.1f} / "
                         f"{rr['tokens_per_s']:.1f} |")
    print("| pattern | pool (blocks) | ceiling | prefix | round-robin | ratio | bound | TTFT p50/p99 prefix (s) | "
          "round-robin (s) | tokens/s prefix / rr |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    return results


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
    parser.add_argument("--sweep", action="store_true", help="prefix and round-robin over --patterns x --pools")
    parser.add_argument("--patterns", default="few-long,many-short,chat", help="--sweep's sharing patterns")
    parser.add_argument("--pools", default="1/3,1/2,1", help="--sweep's pool sizes: the fraction of the shared "
                        "prefixes one replica holds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    if args.sweep:
        results = sweep(args)
    else:
        results = fixed_runs(parser, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"machine": platform.machine(), "cpus": os.cpu_count(), "load": os.getloadavg(),
                       "args": vars(args), "results": results}, f, indent=1)


def fixed_runs(parser, args) -> list[dict]:
    """Issue 42's workload over --runs (and Ray Serve with --ray)."""
    if args.num_gpu_blocks is None:
        args.num_gpu_blocks = pool_blocks(args, (args.num_prefixes // 3) / args.num_prefixes)
    if args.ray and args.runs == parser.get_default("runs"):
        args.runs = "2:prefix,ray:prefix,ray:ray-prefix,ray:round-robin"
    sessions = workload(args)
    print(f"ceiling (every prefix cached after its first request): {ceiling(sessions):.3f}", flush=True)
    results = []
    cluster = RayCluster() if args.ray else None
    for run in args.runs.split(","):
        size, policy = run.split(":")
        row = run_one(args, size, policy, sessions, cluster)
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
    return results


if __name__ == "__main__":
    main()
