"""Hostile load against a running `jpaged serve`: disconnect storms, random and hostile request
bodies, malformed fields and hostile grammars (each must get a 4xx), huge requests, all at once, while /health is
polled. Prints what a supervisor would want to know: status counts (any 5xx is a bug), the slowest
/health answer (event-loop stalls), and whether the engine ended alive and idle (no request
running or waiting, no KV block held).

    python scripts/stress_server.py --url http://127.0.0.1:8000 --requests 2000 --disconnects 400

Then issue 38's attacks (scripts/stress_attacks.py): /kv pollers, Responses limits and store
bytes, sleep mode (when the server has --enable-sleep-mode), and issue 60's KV events flood (when
it has --kv-events-config: non-reading subscribers and replay clients, the server's RSS and the
live batches' delay measured); with --lora-churn, LoRA churn and
hostile adapter files (scripts/stress_lora.py); with --startup-attacks, malformed checkpoints
and configs at start-up (scripts/stress_checkpoints.py; needs no server). --start-server "ARGS"
starts `jpaged serve ARGS` itself (its RSS is then checked) and stops it at the end. Every
attack at once, on the tiny model:

    python scripts/stress_server.py --startup-attacks --lora-churn tiny --lora-streams 300 --seed 38 \
        --start-server "--model tiny --api-key KEY --enable-sleep-mode --enable-lora \
        --enable-lora-runtime-updates --responses-store-bytes 67108864 --max-model-len 4096"

(--lora-churn tiny builds three tiny adapters and the hostile ones under --lora-dir, which
--start-server adds as --allowed-lora-paths.) The SUMMARY at the end: requests, 5xx and failures
of each part, engine alive, requests unfinished, leaked KV blocks, tracebacks in the server's log.
"""

import argparse
import asyncio
import collections
import json
import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stress_attacks  # noqa: E402
import stress_checkpoints  # noqa: E402

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

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
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
    return {"requests": sum(v for k, v in statuses.items() if not str(k).startswith("/health")), "5xx": five_xx,
            "failures": len(failures), "alive": healthy, "idle": idle}


# ---------------------------------------------------------------------- issue 38's attacks
def lora_attacks(args) -> int:
    """--lora-churn: scripts/stress_lora.py's churn (every answered stream checked against its
    adapter alone) and, with --lora-hostile-dir, its hostile adapter files; the server needs
    --enable-lora --enable-lora-runtime-updates (and --allowed-lora-paths over both directories).
    `--lora-churn tiny`: three random adapters of the tiny model, built under --lora-dir."""
    import stress_lora

    adapters, hostile = args.lora_churn, args.lora_hostile_dir
    if adapters == ["tiny"]:
        adapters = stress_checkpoints.make_tiny_adapters(os.path.join(args.lora_dir, "adapters"))
        if hostile is None:
            hostile = os.path.join(args.lora_dir, "hostile")
            shutil.rmtree(hostile, ignore_errors=True)  # FIFOs of an earlier run would block the rebuild
    return asyncio.run(stress_lora.main(argparse.Namespace(
        url=args.url, adapters=adapters, streams=args.lora_streams, names=8, loaders=12, clients=16,
        max_tokens=8, hostile_dir=hostile, api_key=args.api_key, seed=args.seed)))


def start_server(args) -> subprocess.Popen:
    """`jpaged serve ARGS` on a free port; args.url, api_key, store bytes and pid taken from it."""
    words = shlex.split(args.start_server)
    known = argparse.ArgumentParser(add_help=False)
    known.add_argument("--api-key")
    known.add_argument("--responses-store-bytes", type=int)
    known.add_argument("--allowed-lora-paths", nargs="+")
    known.add_argument("--kv-events-config")
    flags = known.parse_known_args(words)[0]
    if flags.kv_events_config and args.kv_events_endpoint is None:  # where to connect: its addresses, on loopback
        events = json.loads(flags.kv_events_config)
        local = lambda a: a and a.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")  # noqa: E731
        args.kv_events_endpoint = local(events.get("endpoint", "tcp://*:5557"))
        args.kv_events_replay_endpoint = args.kv_events_replay_endpoint or local(events.get("replay_endpoint"))
    if args.lora_churn == ["tiny"] and flags.allowed_lora_paths is None:
        words += ["--allowed-lora-paths", args.lora_dir]
    os.makedirs(args.lora_dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(args.server_log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", *words, "--host", "127.0.0.1", "--port",
                             str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    args.url, args.server_pid = f"http://127.0.0.1:{port}", proc.pid
    args.api_key = args.api_key or flags.api_key
    args.store_bytes = flags.responses_store_bytes or args.store_bytes
    print(f"starting jpaged serve {' '.join(words)} on port {port} (log: {args.server_log})", flush=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(args.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise SystemExit(f"error: the server did not start (exit {proc.poll()}); see {args.server_log}")


async def final_check(url) -> dict:
    """Alive (/health), idle (nothing running, waiting or swapped) and the KV blocks still held."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        deadline = time.monotonic() + 60
        while True:
            try:
                async with session.get(url + "/health") as r:
                    alive = r.status == 200
                async with session.get(url + "/metrics") as r:
                    values = {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
                              for line in (await r.text()).splitlines() if line and not line.startswith("#")}
            except aiohttp.ClientError:
                return {"alive": False, "busy": None, "leaked_blocks": None}
            busy = sum(values.get(f"jpaged:{k}", 0) for k in ("num_requests_running", "num_requests_waiting",
                                                               "num_requests_swapped"))
            leaked = values.get("jpaged:num_gpu_blocks_in_use", 0)
            if (busy == 0 and leaked == 0) or time.monotonic() > deadline:
                return {"alive": alive, "busy": int(busy), "leaked_blocks": int(leaked),
                        "cpu_cache": values.get("jpaged:cpu_cache_usage_perc", 0)}
            await asyncio.sleep(0.5)


def run_all(args) -> int:
    lines, failed = [], False
    if args.startup_attacks:
        ok, total = stress_checkpoints.startup_attacks(workers=args.startup_workers)
        lines.append(f"start-up attacks: {ok}/{total} exited 2 with one error line and no traceback")
        failed |= ok != total
    if args.no_server_attacks:
        print("\nSUMMARY\n  " + "\n  ".join(lines))
        return 1 if failed else 0
    server = start_server(args) if args.start_server else None
    try:
        generic = asyncio.run(main(args))
        lines.append(f"generic attacks: {generic['requests']} requests, {generic['5xx']} 5xx, "
                     f"{generic['failures']} failures, alive {generic['alive']}, idle {generic['idle']}")
        failed |= bool(generic["5xx"] or generic["failures"] or not generic["alive"] or not generic["idle"])
        attacks = [a for a in ("kv", "responses", "sleep", "kv-events", "dp") if a in args.attacks]
        kv_events = (args.kv_events_endpoint, args.kv_events_replay_endpoint) if args.kv_events_endpoint else None
        tally = asyncio.run(stress_attacks.run(args.url, args.api_key, attacks=attacks, store_bytes=args.store_bytes,
                                               pid=args.server_pid, kv_pollers=args.kv_pollers,
                                               sleep_seconds=args.sleep_churn_seconds, seed=args.seed or 0,
                                               kv_events=kv_events, kv_events_seconds=args.kv_events_seconds,
                                               kv_events_clients=args.kv_events_clients))
        print("issue 38 attacks, statuses:", dict(sorted(tally.statuses.items())))
        for failure in tally.failures[:20]:
            print("FAILURE:", failure)
        lines += tally.notes
        lines.append(f"issue 38 attacks ({', '.join(attacks)}): {tally.requests} requests, {tally.five_xx} 5xx, "
                     f"{len(tally.failures)} failures")
        failed |= bool(tally.five_xx or tally.failures)
        if args.lora_churn:
            lora_code = lora_attacks(args)
            lines.append(f"LoRA churn and hostile adapters (scripts/stress_lora.py): "
                         f"{'ok' if lora_code == 0 else 'FAILED'}")
            failed |= lora_code != 0
        end = asyncio.run(final_check(args.url))
        lines.append(f"engine alive: {end['alive']}; requests unfinished: {end['busy']}; leaked KV blocks: "
                     f"{end['leaked_blocks']}")
        failed |= not end["alive"] or end["busy"] != 0 or end["leaked_blocks"] != 0
    finally:
        if server is not None:
            died = server.poll()
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
            with open(args.server_log, errors="replace") as f:
                log = f.read()
            lines.append(f"server process: {'alive' if died is None else f'DIED (exit {died})'} until stopped; "
                         f"tracebacks in its log: {log.count('Traceback')}")
            failed |= died is not None or "Traceback" in log
    print("\nSUMMARY\n  " + "\n  ".join(lines))
    print("RESULT:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="the server's --api-key (sent on every request)")
    parser.add_argument("--start-server", default=None, metavar="ARGS",
                        help="start `jpaged serve ARGS` on a free port, attack it, stop it (--url is ignored)")
    parser.add_argument("--server-log", default="/tmp/jpaged-stress-server.log", help="its output")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="the server's pid on this machine, for its RSS (known with --start-server)")
    parser.add_argument("--requests", type=int, default=2000, help="random (often hostile) request bodies")
    parser.add_argument("--malformed", type=int, default=200,
                        help="requests with a malformed field (MALFORMED), each of which must get a 4xx")
    parser.add_argument("--grammars", type=int, default=20,
                        help="requests with a hostile grammar (GRAMMARS), each of which must get a 4xx")
    parser.add_argument("--disconnects", type=int, default=400, help="clients that leave within 100 ms")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=200, help="tokens of the one long request")
    parser.add_argument("--attacks", nargs="*", default=["kv", "responses", "sleep", "kv-events", "dp"],
                        help="issue 38's attacks to run, and issue 60's kv-events and dp (scripts/stress_attacks.py, "
                             "stress_fleet.py; sleep is skipped without --enable-sleep-mode, kv-events without a KV "
                             "events endpoint, dp without 2 data-parallel replicas)")
    parser.add_argument("--kv-events-endpoint", default=None,
                        help="the server's KV events address to connect to (with --start-server: from its "
                             "--kv-events-config, * as 127.0.0.1)")
    parser.add_argument("--kv-events-replay-endpoint", default=None, help="its replay address to connect to")
    parser.add_argument("--kv-events-seconds", type=float, default=30.0, help="how long the kv-events flood lasts")
    parser.add_argument("--kv-events-clients", type=int, default=300,
                        help="non-reading subscribers, and as many non-reading replay clients, of the kv-events flood")
    parser.add_argument("--kv-pollers", type=int, default=20, help="clients polling /kv around a victim stream")
    parser.add_argument("--store-bytes", type=int, default=256 << 20,
                        help="the server's --responses-store-bytes (read from --start-server's ARGS)")
    parser.add_argument("--sleep-churn-seconds", type=float, default=30.0)
    parser.add_argument("--lora-churn", nargs="+", default=None, metavar="ADAPTER_DIR",
                        help="also churn these PEFT adapters (scripts/stress_lora.py) after the other attacks "
                             "('tiny': three random adapters of the tiny model, built under --lora-dir)")
    parser.add_argument("--lora-streams", type=int, default=5000, help="answered streams of the LoRA churn")
    parser.add_argument("--lora-hostile-dir", default=None, help="build hostile adapters here and load them "
                        "(with --lora-churn tiny: LORA_DIR/hostile)")
    parser.add_argument("--lora-dir", default="/tmp/jpaged-stress-lora",
                        help="where --lora-churn tiny builds its adapters (the server must allow it: --start-server "
                             "adds --allowed-lora-paths LORA_DIR when its ARGS name none)")
    parser.add_argument("--startup-attacks", action="store_true",
                        help="first start jpaged on malformed checkpoints and configs (scripts/stress_checkpoints.py)")
    parser.add_argument("--startup-workers", type=int, default=2, help="start-ups run at once")
    parser.add_argument("--no-server-attacks", action="store_true",
                        help="only the start-up attacks: no server needed")
    parser.add_argument("--seed", type=int, default=None)
    raise SystemExit(run_all(parser.parse_args()))
