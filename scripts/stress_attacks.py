"""Issue 38's attacks on a running `jpaged serve`, for scripts/stress_server.py.

  kv         /kv polled by 20 clients (half without the key when the server has --api-key: each
             must be a 401) while a victim stream runs: its time alone and polled, largest gap.
  responses  metadata over OpenAI's limits (17 pairs, 65-character keys, 513-character and 4 MB
             values, values not strings): 400s; many stored responses with big tools to pass
             --responses-store-bytes (the oldest evicted; the server's RSS, when its pid is known,
             grows by less than the bytes sent); truncation 'auto' with 600 and 5,000 messages;
             previous_response_id chains, forks and ids missing, evicted or not strings;
             max_tool_calls out of range; tool_choice 'required' cut by max_output_tokens
             (status 'incomplete', no partial call served as text).
  sleep      (--enable-sleep-mode) level=1%20, level=1&level=2, level=3 ...: 400s; sleep during
             streams: refused, the streams finish; sleep / wake_up churn with requests: 200s and
             400s only, then awake and greedy text unchanged.
  kv-events  (issue 60; scripts/stress_fleet.py) non-reading KV-event subscribers and replay clients
             while completions make events: live batches on time, the server's RSS bounded.
  dp         (issue 60; scripts/stress_fleet.py; --data-parallel-size >= 2) a replica stopped
             (SIGSTOP), one killed while it restarts, all killed: requests answered or told to retry.

Every request is counted in a Tally (status per section; a 5xx or an unexpected status is a failure).
"""

import asyncio
import collections
import json
import random
import time

import aiohttp

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


class Tally:
    def __init__(self):
        self.statuses: collections.Counter = collections.Counter()
        self.failures: list = []
        self.notes: list[str] = []
        self.expected_5xx = 0  # 503s a section asked for (told to retry), not failures

    def count(self, section: str, status, text: str = "", expect=None, what="") -> bool:
        self.statuses[f"{section} {status}"] += 1
        expected = expect is not None and status in expect
        bad = not isinstance(status, int) or (status >= 500 and not expected) or (expect is not None and not expected)
        if expected and isinstance(status, int) and status >= 500:  # (a 503 asked for: retry later)
            self.expected_5xx += 1
        if bad:
            self.failures.append((section, what, status, text[:300]))
        return not bad

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def five_xx(self) -> int:
        return sum(v for k, v in self.statuses.items() if k.rsplit(" ", 1)[1].isdigit() and int(k.rsplit(" ", 1)[1])
                   >= 500) - self.expected_5xx


async def call(session, method, url, body=None, headers=None, data=None) -> tuple:
    """(status, text), or (the client error's name, '')."""
    try:
        async with session.request(method, url, json=body, data=data, headers=headers) as r:
            return r.status, await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__, ""


async def victim_stream(session, url, tokens=200) -> tuple[float, float, int]:
    """(seconds, largest gap between two chunks, status) of one greedy stream of `tokens` tokens."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    start = last = time.monotonic()
    gap = 0.0
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return time.monotonic() - start, 0.0, r.status
        async for line in r.content:
            if line.startswith(b"data: {"):
                now = time.monotonic()
                gap, last = max(gap, now - last), now
    return time.monotonic() - start, gap, 200


def sse_events(text: str) -> list[dict]:
    """A stream's events; an `error` event raises (it is a failure wherever it comes)."""
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    if not events or any(e.get("type") == "error" or ("error" in e and "type" not in e) for e in events):
        raise ValueError(f"error event or no event: {text[-300:]}")
    return events


# ---------------------------------------------------------------------- /kv
async def kv_attack(session, bare, url, api_key, tally, pollers=20, tokens=200):
    """`session` carries the key (if any), `bare` none."""
    alone = await victim_stream(session, url, tokens)
    tally.count("kv victim", alone[2], expect={200})
    stop = asyncio.Event()

    async def poll(i):
        keyed = api_key is None or i % 2 == 0
        while not stop.is_set():
            status, text = await call(session if keyed else bare, "GET", url + "/kv")
            tally.count("kv " + ("keyed" if keyed else "no key"), status, text, expect={200} if keyed else {401})

    tasks = [asyncio.create_task(poll(i)) for i in range(pollers)]
    await asyncio.sleep(0.3)
    polled = await victim_stream(session, url, tokens)
    tally.count("kv victim", polled[2], expect={200})
    stop.set()
    await asyncio.gather(*tasks)
    if api_key is not None:
        import base64
        basic = "Basic " + base64.b64encode(f"anyone:{api_key}".encode()).decode()
        for header, expect in ((basic, 200), ("Bearer wrong", 401), ("Basic !!!", 401), (f"Token {api_key}", 401)):
            status, text = await call(bare, "GET", url + "/kv", headers={"Authorization": header})
            tally.count("kv auth variants", status, text, expect={expect}, what=header[:12])
    line = (f"/kv: victim {tokens}-token stream {alone[0]:.2f} s alone (largest gap {alone[1] * 1e3:.0f} ms), "
            f"{polled[0]:.2f} s with {pollers} pollers (largest gap {polled[1] * 1e3:.0f} ms)")
    tally.notes.append(line)
    print(line, flush=True)


# ---------------------------------------------------------------------- Responses
def _meta_cases():
    ok = {f"k{i:02d}" + "k" * 60: "v" * 512 for i in range(16)}  # at the limits: 16 pairs, 64 and 512 characters
    bad = [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": "v" * (4 << 20)},
           {"k": 1}, {"k": None}, {"k": True}, {"k": ["v"]}, {"k": {"v": "w"}}, {"k": 1.5}, "metadata", ["k", "v"], 7]
    return ok, bad


def _function_tools(description="", n=1):
    return [{"type": "function", "name": f"f{i}", "description": description,
             "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}
            for i in range(n)]


def _rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


async def responses_attack(session, url, tally, store_bytes, pid=None, concurrency=4):
    R = url + "/v1/responses"
    ok_meta, bad_meta = _meta_cases()
    for path, body in (("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        status, text = await call(session, "POST", url + path, {**body, "metadata": ok_meta})
        tally.count("metadata at the limits", status, text, expect={200}, what=path)
        for meta in bad_meta:
            status, text = await call(session, "POST", url + path, {**body, "metadata": meta})
            tally.count("metadata over the limits", status, text, expect={400}, what=f"{path} {str(meta)[:60]}")

    # Many stored responses, each with a big tool description, past --responses-store-bytes.
    size = 2 << 20
    n = min(600, int(8 * store_bytes / size) + 8)  # several times the bound: an unbounded store would show
    rss_before = _rss_mib(pid) if pid else None
    body = {"input": "hi", "max_output_tokens": 1, "tools": _function_tools("d" * size), "tool_choice": "none"}
    data = json.dumps(body).encode()
    ids: list = [None] * n
    semaphore = asyncio.Semaphore(concurrency)

    async def store(i):
        async with semaphore:
            status, text = await call(session, "POST", R, data=data, headers={"Content-Type": "application/json"})
            if tally.count("store big responses", status, text, expect={200}):
                ids[i] = json.loads(text)["id"]
    start = time.monotonic()
    await asyncio.gather(*[store(i) for i in range(n)])
    seconds = time.monotonic() - start
    rss_after = _rss_mib(pid) if pid else None
    stored = [i for i in ids if i]
    found = []
    for response_id in (stored[:3] + stored[-3:]) if stored else []:
        status, text = await call(session, "GET", f"{R}/{response_id}")
        tally.count("store retrieve", status, text, expect={200, 404})
        found.append(status)
    line = (f"responses store: {len(stored)}/{n} responses of {size >> 20} MiB stored in {seconds:.1f} s "
            f"({n * size >> 20} MiB sent, --responses-store-bytes {store_bytes >> 20} MiB); the 3 oldest then newest "
            f"retrieved: {found}")
    if stored and (found[:3] != [404] * 3 or found[-1] != 200):
        tally.failures.append(("store", "oldest not evicted or newest gone", found, ""))
    if rss_before is not None and rss_after is not None:
        growth = rss_after - rss_before
        line += f"; server RSS {rss_before:.0f} -> {rss_after:.0f} MiB (+{growth:.0f})"
        if growth > min(2 * (store_bytes >> 20) + 256, (n * size >> 20) / 2):
            tally.failures.append(("store", "RSS unbounded", f"+{growth:.0f} MiB", ""))
    else:
        line += "; server RSS not checked (its pid unknown: --start-server or --server-pid)"
    tally.notes.append(line)
    print(line, flush=True)

    # truncation 'auto' at any conversation length; 'disabled' past the context is a 400.
    for count in (600, 5000):
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "x" * 20}
                    for i in range(count - 1)] + [{"role": "user", "content": "last"}]
        for truncation, expect, stream in (("auto", {200}, False), ("auto", {200}, True), ("disabled", {400}, False)):
            start = time.monotonic()
            status, text = await call(session, "POST", R, {"input": messages, "max_output_tokens": 4,
                                                           "truncation": truncation, "stream": stream})
            good = tally.count(f"truncation {truncation}", status, text, expect=expect, what=f"{count} messages")
            if good and status == 200:  # completed, or incomplete at max_output_tokens
                try:
                    final = sse_events(text)[-1]["response"] if stream else json.loads(text)
                except ValueError as e:
                    tally.failures.append(("truncation stream", count, "error event", str(e)))
                    continue
                reason = (final.get("incomplete_details") or {}).get("reason")
                if final["status"] not in ("completed", "incomplete") or (
                        final["status"] == "incomplete" and reason != "max_output_tokens"):
                    tally.failures.append(("truncation", count, final["status"], text[-300:]))
            print(f"  truncation {truncation} {'stream ' if stream else ''}{count} messages: {status} in "
                  f"{time.monotonic() - start:.1f} s", flush=True)

    # previous_response_id: a chain, forks of one response, ids missing, evicted, deleted or not strings.
    previous = None
    for i in range(20):
        status, text = await call(session, "POST", R, {"input": f"turn {i}", "max_output_tokens": 4,
                                                       "previous_response_id": previous, "truncation": "auto"})
        if tally.count("previous_response_id chain", status, text, expect={200}, what=i):
            previous = json.loads(text)["id"]
    forks = await asyncio.gather(*[call(session, "POST", R, {"input": f"fork {i}", "max_output_tokens": 4,
                                                              "previous_response_id": previous}) for i in range(10)])
    for status, text in forks:
        tally.count("previous_response_id forks", status, text, expect={200})
    for bad, expect in (("resp_nope", 404), (stored[0] if stored else "resp_x", 404), (5, 400), ([previous], 400),
                        ({"id": previous}, 400), ("", 404)):
        status, text = await call(session, "POST", R, {"input": "x", "max_output_tokens": 2,
                                                       "previous_response_id": bad})
        tally.count("previous_response_id bad", status, text, expect={expect}, what=str(bad)[:40])
    if previous:
        status, text = await call(session, "DELETE", f"{R}/{previous}")
        tally.count("previous_response_id delete", status, text, expect={200})
        status, text = await call(session, "POST", R, {"input": "x", "max_output_tokens": 2,
                                                       "previous_response_id": previous})
        tally.count("previous_response_id deleted", status, text, expect={404})
    status, text = await call(session, "POST", R, {"input": "x", "max_output_tokens": 2, "store": False})
    if tally.count("store false", status, text, expect={200}):
        status, text = await call(session, "POST", R, {"input": "x", "max_output_tokens": 2,
                                                       "previous_response_id": json.loads(text)["id"]})
        tally.count("previous_response_id not stored", status, text, expect={404})

    # max_tool_calls out of range (with 'required', whose grammar grows with it).
    for value, expect in ((0, 400), (-1, 400), (129, 400), (10**6, 400), (2**70, 400), ("3", 400), (1.5, 400),
                          (True, 400), ([2], 400), (1, 200), (128, 200), (None, 200)):
        status, text = await call(session, "POST", R, {"input": "call f", "max_output_tokens": 64,
                                                       "tools": _function_tools(n=2), "tool_choice": "required",
                                                       "max_tool_calls": value})
        tally.count("max_tool_calls", status, text, expect={expect}, what=repr(value)[:30])

    # tool_choice 'required' cut by max_output_tokens: incomplete, never a partial call as text.
    for tokens in (1, 2, 3, 5, 8):
        for stream in (False, True):
            body = {"input": "call f", "max_output_tokens": tokens, "tools": _function_tools(n=2),
                    "tool_choice": "required", "stream": stream}
            status, text = await call(session, "POST", R, body)
            if not tally.count("required cut short", status, text, expect={200}, what=tokens):
                continue
            if stream:
                try:
                    events = sse_events(text)
                except ValueError as e:
                    tally.failures.append(("required cut short", tokens, "error event", str(e)))
                    continue
                ok = events[-1]["type"] == "response.incomplete" and not any(
                    e["type"] == "response.output_text.delta" and e["delta"] for e in events)
            else:
                response = json.loads(text)
                ok = response["status"] == "incomplete" and not any(
                    part.get("text") for item in response["output"] if item["type"] == "message"
                    for part in item["content"])
            if not ok:
                tally.failures.append(("required cut short", f"{tokens} tokens, stream {stream}",
                                       "not incomplete, or text served", text[:300]))
        status, text = await call(session, "POST", url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "call f"}], "max_tokens": tokens, "tool_choice": "required",
            "tools": [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                      for t in _function_tools(n=2)]})
        if tally.count("required cut short (chat)", status, text, expect={200}, what=tokens):
            choice = json.loads(text)["choices"][0]
            if choice["finish_reason"] != "length" or choice["message"].get("content"):
                tally.failures.append(("required cut short (chat)", tokens, "partial call as content", text[:300]))


# ---------------------------------------------------------------------- sleep mode
async def greedy(session, url, tokens=16):
    status, text = await call(session, "POST", url + "/v1/completions", {"prompt": PROMPT, "max_tokens": tokens,
                                                                         "temperature": 0, "ignore_eos": True})
    return status, json.loads(text)["choices"][0]["text"] if status == 200 else text


async def sleep_attack(session, bare, url, api_key, tally, churn_seconds=30.0, seed=0):
    status, text = await call(session, "GET", url + "/is_sleeping")
    if status == 404:
        tally.notes.append("sleep: skipped (the server has no --enable-sleep-mode)")
        print(tally.notes[-1])
        return
    status, reference = await greedy(session, url)
    tally.count("sleep reference", status, reference, expect={200})
    for query in ("level=1%20", "level=1&level=2", "level=3", "level=01", "level=%2B1", "level=", "level=-1",
                  "level=1.0", "level=2&level=2", "level=1%00", "level=" + "1" * 10000):
        status, text = await call(session, "POST", f"{url}/sleep?{query}")
        tally.count("sleep bad level", status, text, expect={400}, what=query[:20])
    if api_key is not None:
        for path in ("/sleep?level=1", "/wake_up", "/is_sleeping", "/reset_prefix_cache"):
            status, text = await call(bare, "GET" if path == "/is_sleeping" else "POST", url + path)
            tally.count("sleep without key", status, text, expect={401}, what=path)
    status, text = await call(session, "GET", url + "/is_sleeping")
    if tally.count("is_sleeping", status, text, expect={200}) and json.loads(text)["is_sleeping"]:
        tally.failures.append(("sleep bad level", "", "asleep after refused sleeps", text))

    # Sleep while streams run: refused, and the streams finish.
    start = time.monotonic()
    streams = [asyncio.create_task(victim_stream(session, url, 800)) for _ in range(4)]
    await asyncio.sleep(0.5)
    answers = []
    for level in (1, 2, 1, 2):
        status, text = await call(session, "POST", f"{url}/sleep?level={level}")
        answers.append((time.monotonic() - start, status, text))
        await asyncio.sleep(0.1)
    ends = []
    for seconds, gap, status in await asyncio.gather(*streams):
        tally.count("streams during sleep attempts", status, expect={200})
        ends.append(seconds)
    for at, status, text in answers:  # only while the streams ran (a machine slow to start them aside)
        tally.count("sleep during streams", status, text, expect={400} if at < min(ends) else {200, 400})
    if any(status == 200 for _, status, _ in answers):
        await call(session, "POST", url + "/wake_up")

    # Churn: sleep, wake_up, is_sleeping, reset_prefix_cache and completions from many clients.
    rng = random.Random(seed)
    deadline = time.monotonic() + churn_seconds

    async def sleeper(r):
        while time.monotonic() < deadline:
            path = r.choice(["/sleep?level=1", "/sleep?level=2", "/wake_up", "/wake_up", "/reset_prefix_cache",
                             "/is_sleeping"])
            status, text = await call(session, "GET" if path == "/is_sleeping" else "POST", url + path)
            tally.count("sleep churn " + path.split("?")[0], status, text, expect={200, 400}, what=path)
            await asyncio.sleep(r.uniform(0, 0.2))

    async def requester(r):
        while time.monotonic() < deadline:
            status, text = await call(session, "POST", url + "/v1/completions", {
                "prompt": PROMPT, "max_tokens": r.choice([1, 4, 16]), "stream": r.random() < 0.5})
            tally.count("completions during churn", status, text, expect={200, 400})
            if status == 200 and 'data: {"error"' in text:
                tally.failures.append(("completions during churn", "", "error event", text[-300:]))
            await asyncio.sleep(r.uniform(0, 0.05))
    await asyncio.gather(*[sleeper(random.Random(rng.random())) for _ in range(6)],
                         *[requester(random.Random(rng.random())) for _ in range(4)])
    for _ in range(3):  # awake again (a wake_up may race a sleep once more)
        status, text = await call(session, "POST", url + "/wake_up")
        tally.count("sleep final wake_up", status, text, expect={200, 400})
    status, text = await call(session, "GET", url + "/is_sleeping")
    awake = status == 200 and not json.loads(text)["is_sleeping"]
    status, after = await greedy(session, url)
    tally.count("sleep after churn", status, after, expect={200})
    same = after == reference
    if not (awake and same):
        tally.failures.append(("sleep", "after churn", f"awake {awake}, same greedy text {same}", after[:200]))
    counts = {k[12:]: v for k, v in tally.statuses.items() if k.startswith("sleep churn")}
    line = f"sleep: churn {churn_seconds:.0f} s {counts}; awake after: {awake}; greedy text unchanged: {same}"
    tally.notes.append(line)
    print(line, flush=True)


async def run(url, api_key, *, attacks, store_bytes, pid=None, kv_pollers=20, sleep_seconds=30.0, seed=0,
              kv_events=None, kv_events_seconds=30.0, kv_events_clients=300, dp_seconds=120.0) -> Tally:
    """`kv_events`: the server's (endpoint, replay_endpoint or None) to connect to, for the kv-events attack."""
    import stress_fleet  # (issue 60's: KV events and data-parallel replicas; it uses this module's Tally and call)

    tally = Tally()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session, \
            aiohttp.ClientSession(timeout=timeout) as bare:
        for name in attacks:
            start = time.monotonic()
            print(f"--- {name} attack", flush=True)
            if name == "kv":
                await kv_attack(session, bare, url, api_key, tally, pollers=kv_pollers)
            elif name == "responses":
                await responses_attack(session, url, tally, store_bytes, pid)
            elif name == "sleep":
                await sleep_attack(session, bare, url, api_key, tally, sleep_seconds, seed)
            elif name == "kv-events":
                if kv_events is None:
                    tally.notes.append("kv-events: skipped (the server has no --kv-events-config endpoint)")
                    print(tally.notes[-1])
                else:
                    await stress_fleet.kv_events_attack(session, url, tally, *kv_events, pid=pid,
                                                        subscribers=kv_events_clients, replayers=kv_events_clients,
                                                        seconds=kv_events_seconds)
            elif name == "dp":
                await stress_fleet.dp_attack(session, url, tally, seconds=dp_seconds)
            print(f"--- {name} attack: {time.monotonic() - start:.1f} s", flush=True)
    return tally
