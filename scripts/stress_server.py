"""Hostile load against a running `jpaged serve`: disconnect storms, random and hostile request
bodies, malformed fields and hostile grammars (each must get a 4xx), huge requests, all at once, while /health is
polled. Prints what a supervisor would want to know: status counts (any 5xx is a bug), the slowest
/health answer (event-loop stalls), and whether the engine ended alive and idle (no request
running or waiting, no KV block held).

    python scripts/stress_server.py --url http://127.0.0.1:8000 --requests 2000 --disconnects 400
"""

import argparse
import asyncio
import collections
import json
import random
import time

import aiohttp

HOSTILE_VALUES = [None, True, False, -1, 0, 1, 2**31, -2**63, 2**70, 1e308, -1e308, 0.5, "", "x", "\ud800", [],
                  [1, -1], [2**64], {}, {"a": 1}, "never"]
FIELDS = {  # field: plausible values
    "max_tokens": [1, 4, 16, 64], "n": [1, 2, 4], "best_of": [1, 2, 5], "temperature": [0, 0.7, 1.0],
    "top_p": [0.1, 0.9, 1.0], "top_k": [-1, 1, 40, 10**6], "min_p": [0, 0.1], "seed": [0, 7, 2**64],
    "stop": ["\n", ["a", "b"], ["s" * 2000], ["x"] * 100], "stop_token_ids": [[1], [2**31]], "ignore_eos": [True],
    "min_tokens": [0, 2, 100], "logprobs": [0, 5, 21], "echo": [True, False], "presence_penalty": [-2, 0.5, 3],
    "frequency_penalty": [0.5], "repetition_penalty": [1e-300, 0.5, 1.2], "use_beam_search": [True],
    "length_penalty": [-1000, 0.5, 1000], "early_stopping": [True, "never"], "stream": [True, False],
}


CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _history(arguments: str) -> list:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]


JSON = {"Content-Type": "application/json"}
# Malformed fields (issue 30), each once a 500 or a RecursionError: every one must get a 4xx.
MALFORMED = [(path, json.dumps(body).encode(), JSON) for path, body in [
    ("/v1/chat/completions", {**CHAT_HI, "response_format": {"type": "json_schema", "json_schema": "s"}}),
    ("/v1/chat/completions", {**CHAT_HI, "response_format": {"type": "json_schema", "json_schema": {"schema": 1}}}),
    ("/v1/chat/completions", {**CHAT_HI, "response_format": {"type": "json_schema"}}),
    ("/v1/chat/completions", {**CHAT_HI, "tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}}),
    ("/v1/chat/completions", {**CHAT_HI, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["f"]}}}),
    ("/v1/chat/completions", {**CHAT_HI, "tools": TOOLS, "tool_choice": ["auto"]}),
    ("/v1/chat/completions", {**CHAT_HI, "tool_choice": {"type": "function", "function": "f"}}),
    ("/v1/chat/completions", {**CHAT_HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": "s"}}],
                              "tool_choice": "required"}),
    ("/v1/chat/completions", {**CHAT_HI, "messages": _history(deep(1000))}),
    ("/v1/completions", {"prompt": "hi", "guided_json": deep(5000)}),
]] + [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', {"Content-Type": f"application/json; charset={charset}"})
    for charset in ("undefined", "punycode", "rot13", "nope")
] + [
    ("/v1/completions", deep(1000).encode(), JSON),
    ("/v1/chat/completions", b'{"messages": ' + deep(200000).encode() + b"}", JSON),
]

# Grammars (issue 30) that froze the server (compiled on the event loop for up to minutes) or came
# back silently wrong (a 200 "stop" with text breaking the grammar): each must get a 4xx, within
# --grammar-compile-timeout, while /health keeps answering.
_REF_CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                   "required": ["x"]}}}
GRAMMARS = [(path, json.dumps({"max_tokens": 4, **body}).encode(), JSON) for path, body in [
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "string", "allOf": [
        {"pattern": f".*{chr(97 + i)}.*"} for i in range(21)]}}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "object", "patternProperties": {
        f"^k{i}[a-z]*$": {} for i in range(1000)}}}),
    ("/v1/completions", {"prompt": "a", "guided_choice": [str(i) for i in range(100_000)]}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"enum": list(range(100_000))}}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"anyOf": [{"const": i} for i in range(2000)]}}),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a{1000}{1000}"}),
    ("/v1/completions", {"prompt": "a", "guided_regex": ""}),
    ("/v1/completions", {"prompt": "a", "guided_json": _REF_CYCLE}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "integer", "minimum": 10**30}}),
    ("/v1/chat/completions", {**CHAT_HI, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(1000)]}),
]]


def random_body(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.4
    body = {"messages": [{"role": "user", "content": rng.choice(["hi", "héllo 🙂", "\ud800", "x" * 5000])}]} \
        if chat else {"prompt": rng.choice(["hi", "Once upon a time", [1, 2, 3], [[1, 2], [3]], "", [-1], "y" * 9000])}
    for name in rng.sample(sorted(FIELDS), rng.randint(0, 6)):
        body[name] = rng.choice(HOSTILE_VALUES) if rng.random() < 0.2 else rng.choice(FIELDS[name])
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def main(args):
    rng = random.Random(args.seed)
    statuses: collections.Counter = collections.Counter()
    failures: list = []
    latencies: list[float] = []
    done = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=600)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def poll_health():
            while not done.is_set():
                start = time.monotonic()
                async with session.get(args.url + "/health") as r:
                    statuses[f"/health {r.status}"] += 1
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.05)

        async def one(path, body):
            data = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as \\ud800 escapes
            try:
                async with session.post(args.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                    text = await r.text()
                    statuses[r.status] += 1
                    if r.status >= 500 or (r.status == 200 and "data: {\"error\"" in text):
                        failures.append((r.status, body, text[:300]))
            except aiohttp.ClientError as e:
                statuses[type(e).__name__] += 1

        async def refused(path, data, headers):
            """A malformed request: a 4xx in OpenAI's shape, or a failure."""
            try:
                async with session.post(args.url + path, data=data, headers=headers) as r:
                    text = await r.text()
                    statuses[f"malformed {r.status}"] += 1
                    if not 400 <= r.status < 500 or '"error"' not in text:
                        failures.append((r.status, data[:120], text[:300]))
            except aiohttp.ClientError as e:
                statuses[type(e).__name__] += 1

        async def leave_early(i):
            body = {"prompt": f"storm {i}", "max_tokens": 64, "ignore_eos": True, "stream": i % 2 == 0}
            try:
                await asyncio.wait_for(one("/v1/completions", body), rng.uniform(0, 0.1))
            except asyncio.TimeoutError:
                statuses["disconnected"] += 1

        poller = asyncio.create_task(poll_health())
        start = time.monotonic()
        long_request = asyncio.create_task(one("/v1/completions", {"prompt": "long", "max_tokens": args.long_tokens,
                                                                   "ignore_eos": True}))
        semaphore = asyncio.Semaphore(args.concurrency)

        async def limited(coro):
            async with semaphore:
                await coro

        jobs = [limited(leave_early(i)) for i in range(args.disconnects)]
        jobs += [limited(one(*random_body(rng))) for _ in range(args.requests)]
        jobs += [limited(refused(*rng.choice(MALFORMED))) for _ in range(args.malformed)]
        jobs += [limited(refused(*rng.choice(GRAMMARS))) for _ in range(args.grammars)]
        rng.shuffle(jobs)
        await asyncio.gather(*jobs)
        await long_request
        elapsed = time.monotonic() - start
        # Idle again: nothing running or waiting, no KV block held.
        deadline = time.monotonic() + 60
        while True:
            async with session.get(args.url + "/metrics") as r:
                values = {line.rsplit(" ", 1)[0].split("{")[0]: line.rsplit(" ", 1)[1]
                          for line in (await r.text()).splitlines() if line and not line.startswith("#")}
            idle = all(float(values[f"jpaged:{k}"]) == 0 for k in ("num_requests_running", "num_requests_waiting",
                                                                   "gpu_cache_usage_perc"))
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        done.set()
        await poller
        async with session.get(args.url + "/health") as r:
            healthy = r.status == 200

    five_xx = sum(v for k, v in statuses.items() if isinstance(k, int) and k >= 500)
    print(f"{args.requests} random bodies + {args.malformed} malformed fields + {args.grammars} hostile grammars + "
          f"{args.disconnects} disconnecting clients + 1 long request in {elapsed:.1f} s")
    print("statuses:", dict(sorted(statuses.items(), key=str)))
    print(f"5xx or error events: {five_xx + len(failures)}; /health answers: {len(latencies)}, "
          f"slowest {max(latencies) * 1e3:.0f} ms, p99 {sorted(latencies)[int(0.99 * (len(latencies) - 1))] * 1e3:.0f} ms")
    print(f"engine alive: {healthy}; idle with no KV block held: {idle}")
    for failure in failures[:5]:
        print("FAILURE:", failure)
    return 0 if healthy and idle and not failures and not five_xx else 1


# ---------------------------------------------------------------------- LoRA attacks (issue 38)
def lora_attacks(args) -> int:
    """--lora-churn: scripts/stress_lora.py's churn (every answered stream checked against its
    adapter alone) and, with --lora-hostile-dir, its hostile adapter files; the server needs
    --enable-lora --enable-lora-runtime-updates (and --allowed-lora-paths over both directories)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import stress_lora

    return asyncio.run(stress_lora.main(argparse.Namespace(
        url=args.url, adapters=args.lora_churn, streams=args.lora_streams, names=8, loaders=12, clients=16,
        max_tokens=8, hostile_dir=args.lora_hostile_dir, api_key=None, seed=args.seed)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lora-churn", nargs="+", default=None, metavar="ADAPTER_DIR",
                        help="also churn these PEFT adapters (scripts/stress_lora.py) after the other attacks")
    parser.add_argument("--lora-streams", type=int, default=5000, help="answered streams of the LoRA churn")
    parser.add_argument("--lora-hostile-dir", default=None, help="build hostile adapters here and load them")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=2000, help="random (often hostile) request bodies")
    parser.add_argument("--malformed", type=int, default=200,
                        help="requests with a malformed field (MALFORMED), each of which must get a 4xx")
    parser.add_argument("--grammars", type=int, default=20,
                        help="requests with a hostile grammar (GRAMMARS), each of which must get a 4xx")
    parser.add_argument("--disconnects", type=int, default=400, help="clients that leave within 100 ms")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=200, help="tokens of the one long request")
    parser.add_argument("--seed", type=int, default=None)
    parsed = parser.parse_args()
    code = asyncio.run(main(parsed))
    lora_code = lora_attacks(parsed) if parsed.lora_churn else 0
    raise SystemExit(code or lora_code)
