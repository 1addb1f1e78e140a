"""The defaults check of scripts/gpu_check.sh: `jpaged serve MODEL` started as a user starts it (every
engine option at its default: no num_gpu_blocks_override, no gpu_memory_utilization, the server
picks the device and sizes the KV pool itself), answering mixed OpenAI requests over HTTP, each
answer checked; then SIGTERM and a clean exit.

    python scripts/gpu_serve_check.py --model DIR [--requests 200] [--concurrency 64] [--seconds 120] \
        [--label NAME] [--output-json FILE] [--server-log FILE] [--expect-platform gpu] [-- SERVER FLAGS]

The requests cycle through twelve kinds: completions and chat, plain and streaming (with
stream_options.include_usage), n=2, logprobs (completions' `logprobs`, chat's `logprobs` +
`top_logprobs`), and structured output (chat's response_format json_schema, completions'
guided_json and guided_regex, chat's guided_choice). Every answer must be a 200 whose body (or
every server-sent event of it, ending in [DONE]) has OpenAI's shape: n choices with their indices,
texts, finish reasons, usage adding up, logprobs where asked, and structured outputs that finished
("stop") and parse / match / are one of the choices. The grammars are bounded (an object of a
boolean and an enum, a regex of at most 20 characters), so a random model finishes them too.

Requests start as soon as the server prints its URL (the step shapes still compile in the background
then: the server pads steps to the shapes compiled so far), so requests/s on a cold server includes
the warm-up's competition; `ready_s` says when /health reported every shape compiled. The start-up
line the engine logs (backend, device, kernels, weights, KV pool and the rule that sized it) is kept
in the results. The client stops sending at --seconds less the shutdown's allowance, counts what did
not answer as failures, and always stops the server (SIGTERM, then SIGKILL after 20 s); the server
also dies with this process (PR_SET_PDEATHSIG), so a `timeout` that kills the client leaves no
server holding the GPU. Exit status 0 only if the server started, every request passed and the
server exited 0 after SIGTERM. Uses the standard library and aiohttp only (the GPU image has both).
"""

import argparse
import asyncio
import ctypes
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"]}
REGEX = "[a-z]{2,6}( [a-z]{2,6}){0,2}"
CHOICES = ["yes", "no", "maybe"]
WORDS = ("the a of paged attention cache block table sequence token model server request stream batch decode prefill "
         "kernel memory device host page pool jax pallas triton mosaic hopper schema json regex choice chat hello "
         "world quick brown fox jumps over lazy dog").split()

# The request kinds, in the order the requests cycle through them.
KINDS = ("cmpl", "cmpl_stream", "cmpl_n2", "cmpl_logprobs", "chat", "chat_stream", "chat_n2_logprobs",
         "chat_json_schema", "cmpl_guided_json", "cmpl_guided_regex", "chat_guided_choice", "cmpl_stream_n2_logprobs")
SHUTDOWN_ALLOWANCE_S = 25  # SIGTERM to exit, and the SIGKILL after it


class Bad(Exception):
    """An answer that is not well formed."""


def expect(ok, message):
    if not ok:
        raise Bad(message)


def make_request(i: int, rng: random.Random, model: str) -> tuple[str, str, dict]:
    """(kind, path, body) of request i."""
    kind = KINDS[i % len(KINDS)]
    text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 20, 60, 120])))
    chat = kind.startswith("chat")
    body = {"model": model, "max_tokens": rng.randint(8, 48)}
    if chat:
        body["messages"] = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if rng.random() < 0.5:
        body.update(temperature=0.8, seed=rng.randint(0, 2**31 - 1))
    else:
        body["temperature"] = 0
    if "stream" in kind:
        body.update(stream=True, stream_options={"include_usage": True})
    if "n2" in kind:
        body.update(n=2, temperature=0.8, seed=rng.randint(0, 2**31 - 1))
    if "logprobs" in kind:
        if chat:
            body.update(logprobs=True, top_logprobs=2)
        else:
            body["logprobs"] = 2
    if kind == "chat_json_schema":
        body.update(max_tokens=64, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "answer", "schema": SCHEMA}})
    elif kind == "cmpl_guided_json":
        body.update(max_tokens=64, guided_json=SCHEMA)
    elif kind == "cmpl_guided_regex":
        body.update(max_tokens=32, guided_regex=REGEX)
    elif kind == "chat_guided_choice":
        body.update(max_tokens=8, guided_choice=CHOICES)
    return kind, "/v1/chat/completions" if chat else "/v1/completions", body


def check_structured(kind: str, text: str, finish_reason: str):
    if kind in ("chat_json_schema", "cmpl_guided_json"):
        expect(finish_reason == "stop", f"structured output did not finish: finish_reason {finish_reason!r}, "
                                        f"text {text[:80]!r}")
        try:
            value = json.loads(text)
        except ValueError:
            raise Bad(f"not JSON: {text[:80]!r}") from None
        expect(isinstance(value, dict) and set(value) == {"ok", "color"} and isinstance(value["ok"], bool)
               and value["color"] in ("red", "green", "blue"), f"does not follow the schema: {value!r:.80}")
    elif kind == "cmpl_guided_regex":
        expect(finish_reason == "stop", f"regex output did not finish: finish_reason {finish_reason!r}")
        expect(re.fullmatch(REGEX, text) is not None, f"{text[:80]!r} does not match {REGEX}")
    elif kind == "chat_guided_choice":
        expect(finish_reason == "stop" and text in CHOICES, f"{text[:80]!r} ({finish_reason}) is not one of {CHOICES}")


def check_usage(usage, body, n):
    expect(isinstance(usage, dict), f"no usage: {usage!r:.80}")
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    expect(all(isinstance(x, int) for x in (p, c, t)) and p > 0 and 0 <= c <= n * body["max_tokens"] and t == p + c,
           f"usage does not add up: {usage!r:.120}")
    return c


def check_completion_logprobs(lp, k):
    expect(isinstance(lp, dict), f"logprobs missing: {lp!r:.80}")
    tokens, values, tops, offsets = (lp.get(x) for x in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    expect(all(isinstance(x, list) for x in (tokens, values, tops, offsets))
           and len(tokens) == len(values) == len(tops) == len(offsets), "logprobs' lists differ in length")
    expect(all(isinstance(v, (int, float)) and v <= 1e-3 for v in values), f"token logprobs not <= 0: {values[:4]}")
    # A top-k dict keyed by text: the sampled token joins the k best, texts that coincide merge.
    expect(all(isinstance(d, dict) and 1 <= len(d) <= k + 1 for d in tops), "top_logprobs entries off")


def check_chat_logprobs(lp, k):
    content = lp.get("content") if isinstance(lp, dict) else None
    expect(isinstance(content, list) and content, f"chat logprobs missing: {lp!r:.80}")
    for entry in content:
        expect(isinstance(entry.get("token"), str) and isinstance(entry.get("logprob"), (int, float))
               and entry["logprob"] <= 1e-3 and isinstance(entry.get("bytes"), list)
               and isinstance(entry.get("top_logprobs"), list) and len(entry["top_logprobs"]) == k,
               f"chat logprob entry off: {entry!r:.120}")


def check_whole(kind, body, answer) -> int:
    """A non-streaming answer; returns its completion tokens."""
    chat = kind.startswith("chat")
    n = body.get("n", 1)
    expect(answer.get("object") == ("chat.completion" if chat else "text_completion"),
           f"object {answer.get('object')!r}")
    expect(isinstance(answer.get("id"), str) and answer["id"].startswith("chatcmpl-" if chat else "cmpl-"), "bad id")
    choices = answer.get("choices")
    expect(isinstance(choices, list) and sorted(c.get("index") for c in choices) == list(range(n)),
           f"choices' indices {[c.get('index') for c in choices or []]} for n={n}")
    for c in choices:
        expect(c.get("finish_reason") in ("stop", "length"), f"finish_reason {c.get('finish_reason')!r}")
        if chat:
            message = c.get("message") or {}
            expect(message.get("role") == "assistant" and isinstance(message.get("content"), str), "bad message")
            text = message["content"]
            if body.get("logprobs"):
                check_chat_logprobs(c.get("logprobs"), body["top_logprobs"])
        else:
            text = c.get("text")
            expect(isinstance(text, str), "text is not a string")
            if body.get("logprobs") is not None:
                check_completion_logprobs(c.get("logprobs"), body["logprobs"])
        check_structured(kind, text, c["finish_reason"])
    return check_usage(answer.get("usage"), body, n)


async def check_stream(kind, body, response) -> int:
    """A streaming answer: every event well formed, [DONE] last; returns its completion tokens."""
    chat = kind.startswith("chat")
    n = body.get("n", 1)
    expect(response.headers.get("Content-Type", "").startswith("text/event-stream"),
           f"content type {response.headers.get('Content-Type')!r}")
    texts, finish, usage, done = {}, {}, None, False
    async for raw in response.content:
        line = raw.decode().strip()
        if not line:
            continue
        expect(line.startswith("data: ") and not done, f"unexpected line {line[:80]!r}")
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        expect("error" not in event, f"error event: {data[:200]}")
        expect(event.get("object") == ("chat.completion.chunk" if chat else "text_completion"),
               f"event object {event.get('object')!r}")
        if event.get("usage"):
            usage = event["usage"]
        for c in event.get("choices") or []:
            i = c.get("index")
            expect(i in range(n), f"choice index {i} for n={n}")
            expect(i not in finish, f"choice {i} goes on after its finish_reason")
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            expect(piece is None or isinstance(piece, str), "a delta that is not text")
            texts[i] = texts.get(i, "") + (piece or "")
            if not chat and body.get("logprobs") is not None and c.get("logprobs") is not None:
                lp = c["logprobs"]
                expect(len(lp.get("tokens", [])) == len(lp.get("token_logprobs", [])), "chunk logprobs off")
            if c.get("finish_reason") is not None:
                expect(c["finish_reason"] in ("stop", "length"), f"finish_reason {c['finish_reason']!r}")
                finish[i] = c["finish_reason"]
    expect(done, "no [DONE]")
    expect(sorted(finish) == list(range(n)), f"finish reasons for {sorted(finish)} of n={n}")
    for i in range(n):
        check_structured(kind, texts.get(i, ""), finish[i])
    return check_usage(usage, body, n)


async def one(session, url, kind, path, body, timeout):
    """(ok, output tokens, seconds, error)."""
    t0 = time.perf_counter()
    try:
        async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                return False, 0, time.perf_counter() - t0, f"HTTP {response.status}: {(await response.text())[:300]}"
            if body.get("stream"):
                tokens = await check_stream(kind, body, response)
            else:
                tokens = check_whole(kind, body, await response.json())
        return True, tokens, time.perf_counter() - t0, None
    except Bad as e:
        return False, 0, time.perf_counter() - t0, f"malformed: {e}"
    except asyncio.TimeoutError:
        return False, 0, time.perf_counter() - t0, f"no answer in {timeout:.0f} s"
    except Exception as e:  # noqa: BLE001 (a connection error, JSON that does not parse, a missing field...)
        return False, 0, time.perf_counter() - t0, f"{type(e).__name__}: {e}"


async def health_poller(session, url, state):
    while True:
        t0 = time.perf_counter()
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                health = await r.json()
                state["health"] = health
                if health.get("ready") and state.get("ready_at") is None:
                    state["ready_at"] = time.perf_counter()
        except Exception as e:  # noqa: BLE001 (recorded, the poll goes on)
            state["health_error"] = f"{type(e).__name__}: {e}"
        state["health_max_s"] = max(state.get("health_max_s", 0.0), time.perf_counter() - t0)
        await asyncio.sleep(1.0)


async def drive(url, args, deadline, state) -> dict:
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        poller = asyncio.create_task(health_poller(session, url, state))
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
            model = (await r.json())["data"][0]["id"]
        requests = [make_request(i, rng, model) for i in range(args.requests)]
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(session, url, kind, path, body, args.request_timeout))
                 for kind, path, body in requests]
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        elapsed = time.perf_counter() - t0
        results = [t.result() if t.done() and not t.cancelled() else (False, 0, 0.0, "not answered before the deadline")
                   for t in tasks]
        # The warm-up's end, if it comes soon (the next server then loads every shape this one compiled).
        wait_until = min(deadline, time.perf_counter() + args.ready_wait)
        while state.get("ready_at") is None and time.perf_counter() < wait_until:
            await asyncio.sleep(0.5)
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                state["health_after"] = {"status": r.status, **(await r.json())}
        except Exception as e:  # noqa: BLE001
            state["health_after"] = {"error": f"{type(e).__name__}: {e}"}
        poller.cancel()
    by_kind = {}
    for (kind, _, _), (ok, _, _, _) in zip(requests, results):
        good, total = by_kind.get(kind, (0, 0))
        by_kind[kind] = (good + ok, total + 1)
    latencies = sorted(r[2] for r in results if r[0])
    failures = [{"i": i, "kind": requests[i][0], "error": r[3]} for i, r in enumerate(results) if not r[0]]
    ok = len(results) - len(failures)
    out_tokens = sum(r[1] for r in results)
    return {"model": model, "requests": len(results), "ok": ok, "failures": len(failures),
            "failure_examples": failures[:10], "by_kind": {k: f"{g}/{t}" for k, (g, t) in by_kind.items()},
            "elapsed_s": round(elapsed, 2), "requests_per_s": round(ok / elapsed, 2) if elapsed else 0.0,
            "output_tokens": out_tokens, "output_tokens_per_s": round(out_tokens / elapsed, 1) if elapsed else 0.0,
            "latency_p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "latency_max_s": round(latencies[-1], 3) if latencies else None}


def _die_with_parent():
    """In the server's process: SIGKILL when this client dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m serving.cli serve MODEL --port P [flags]`, its output to a log file; the lines that
    matter (start-up line, URL, warm-up, shutdown, errors) also to our stdout."""
    KEY = re.compile(r"jpaged: |warm-up|Traceback|Error|error|RESOURCE_EXHAUSTED|out of memory")

    def __init__(self, args):
        self.port = free_port()
        cmd = [sys.executable, "-m", "serving.cli", "serve", args.model, "--port", str(self.port), *args.server_args]
        preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "(unset)")
        print(f"$ {' '.join(cmd)}  (XLA_PYTHON_CLIENT_PREALLOCATE={preallocate})", flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.log = open(args.server_log or os.devnull, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", preexec_fn=_die_with_parent)
        self.lines, self.url, self.startup_line = [], None, None
        self.serving_s = None
        self.printed = 0
        self.serving = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            line = line.rstrip("\n")
            self.lines.append(line)
            if self.startup_line is None and re.search(r"jpaged: \S+ \(\w+\) on ", line):
                self.startup_line = line[line.index("jpaged: "):]
            if self.url is None and (m := re.search(r"jpaged: serving .* at (http://\S+)/v1", line)):
                self.url, self.serving_s = m.group(1), time.perf_counter() - self.t0
                self.serving.set()
            if self.KEY.search(line) and "jpaged.access" not in line and self.printed < 60:
                self.printed += 1
                print(f"  server| {line[:400]}", flush=True)
        self.serving.set()  # the process ended: stop waiting

    def wait_serving(self, deadline) -> bool:
        while not self.serving.wait(0.5):
            if time.perf_counter() > deadline:
                return False
        return self.url is not None

    def stop(self) -> tuple[int | None, float]:
        """SIGTERM, then SIGKILL after 20 s: (exit status, seconds to exit)."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                print("  server did not exit 20 s after SIGTERM: SIGKILL", flush=True)
                self.proc.kill()
                self.proc.wait()
        self.reader.join(5)
        self.log.close()
        return self.proc.returncode, time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="'tiny' or a checkpoint directory (with a tokenizer)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--seconds", type=float, default=120.0, help="the whole check, start-up and shutdown included")
    parser.add_argument("--request-timeout", type=float, default=90.0)
    parser.add_argument("--ready-wait", type=float, default=20.0,
                        help="after the requests, wait this long at most for the warm-up's end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="defaults")
    parser.add_argument("--output-json")
    parser.add_argument("--server-log", help="the server's whole output (default: only its key lines, here)")
    parser.add_argument("--expect-platform", choices=["gpu", "cpu"],
                        help="fail unless the engine's start-up line says it runs there")
    parser.add_argument("server_args", nargs="*", help="after --: more `jpaged serve` flags (none for the defaults)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    deadline = start + args.seconds - SHUTDOWN_ALLOWANCE_S
    result = {"label": args.label, "model_arg": args.model, "server_flags": args.server_args,
              "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "(unset)"),
              "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "(unset)")}
    problems = []

    def on_term(signum, frame):  # a `timeout` around us: stop the server on the way out
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    server = Server(args)
    state = {}
    try:
        if not server.wait_serving(deadline):
            problems.append("the server did not start serving in time" if server.proc.poll() is None else
                            f"the server exited ({server.proc.returncode}) before serving")
        else:
            print(f"serving after {server.serving_s:.1f} s at {server.url}", flush=True)
            result.update(asyncio.run(drive(server.url, args, deadline, state)))
            if result["failures"]:
                problems.append(f"{result['failures']} of {result['requests']} requests failed")
    except SystemExit as e:  # SIGTERM: the server is stopped and what there is written, below
        problems.append(f"interrupted ({e})")
    finally:
        code, shutdown_s = server.stop()
    result.update(startup_line=server.startup_line, serving_s=server.serving_s and round(server.serving_s, 1),
                  ready_s=round(state["ready_at"] - server.t0, 1) if state.get("ready_at") else None,
                  health_after=state.get("health_after"), health_max_s=round(state.get("health_max_s", 0.0), 3),
                  exit_code=code, shutdown_s=round(shutdown_s, 1),
                  shut_down_cleanly=code == 0 and any("jpaged: shutting down" in x for x in server.lines),
                  wall_s=round(time.perf_counter() - start, 1))
    if server.startup_line is None:
        problems.append("no start-up line from the engine")
    elif args.expect_platform and f") on {args.expect_platform} (" not in server.startup_line:
        problems.append(f"the engine does not run on {args.expect_platform}: {server.startup_line[:200]}")
    if server.url is not None and not result["shut_down_cleanly"]:
        problems.append(f"no clean shutdown after SIGTERM (exit status {code})")
    if server.url is None:
        result["server_tail"] = server.lines[-40:]
    result["problems"] = problems
    result["passed"] = not problems
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"start-up line: {server.startup_line}")
    for failure in result.get("failure_examples", []):
        print(f"  FAILED #{failure['i']} {failure['kind']}: {failure['error']}")
    print(f"{args.label}: {result.get('ok', 0)}/{args.requests} requests ok, {result.get('failures', args.requests)} "
          f"failures, {result.get('requests_per_s', 0)} req/s, {result.get('output_tokens_per_s', 0)} output tok/s "
          f"(burst {result.get('elapsed_s')} s); serving after {result['serving_s']} s, all shapes ready after "
          f"{result['ready_s']} s; by kind {result.get('by_kind')}; exit {code} in {result['shutdown_s']} s after "
          f"SIGTERM; {'PASSED' if not problems else 'FAILED: ' + '; '.join(problems)}", flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
