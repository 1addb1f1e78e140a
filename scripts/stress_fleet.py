"""Issue 60's attacks on the fleet surfaces of a running `jpaged serve`, for scripts/stress_server.py
(through stress_attacks.run): every loop is bounded by time.

  kv-events  (--kv-events-config with an endpoint and replay_endpoint) 300 SUB sockets and 300
             replay clients that never read, for 30 s, while completions make events: one reading
             subscriber times the live batches (alone, during, after), and the server's RSS is read
             before, at the peak and after (kv_events_flood runs it on any publisher).
  dp         (--data-parallel-size >= 2, run on the server's machine: replicas are signalled by the
             pids /health gives) replica 1 stopped with SIGSTOP while requests run: each is answered
             (the fleet kills a replica silent for $JPAGED_DP_HEARTBEAT_TIMEOUT s, 30 by default, and
             moves its queued requests); replica 1 killed, then its replacement killed while it
             starts: it comes back (restarts with backoff); every replica killed: requests get 200
             or 503 with Retry-After until one is back, never a 500.
"""

import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import time

from stress_attacks import _rss_mib, call


# ---------------------------------------------------------------------- KV events (issue 60)
def kv_events_flood(endpoint: str, replay_endpoint: str | None = None, *, subscribers: int = 300,
                    replayers: int = 300, seconds: float = 30.0, pid: int | None = None, calm: float = 3.0,
                    settle: float = 5.0) -> dict:
    """Against a KV events publisher (addresses to connect to): `subscribers` SUB sockets and
    `replayers` replay clients (each asking from 0 again every second) that never read, for
    `seconds`; one reading subscriber times every live batch by its `ts` (`calm` s before, during,
    `settle` s after). Bounded: every loop ends with its phase. Returns the live delays per phase
    (count, median, 99th percentile, largest, in seconds) and the publisher's RSS in MiB (with
    `pid`): before, at the flood's end, its peak (sampled each second) and after."""
    import threading

    import msgspec
    import zmq

    context, reader_context = zmq.Context(), zmq.Context()
    context.setsockopt(zmq.MAX_SOCKETS, max(1024, subscribers + replayers + 64))
    delays = {"alone": [], "flood": [], "after": []}
    phase, stop = ["alone"], threading.Event()

    def read():  # its own context (I/O thread): the flood's 600 connections do not delay what it reads
        sub = reader_context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        while not stop.is_set():
            if sub.poll(100):
                payload = sub.recv_multipart()[-1]
                batch = msgspec.msgpack.decode(payload)  # a map or, by default, an array (KVEventsConfig.encoding)
                delays[phase[0]].append(time.time() - (batch["ts"] if isinstance(batch, dict) else batch[0]))
        sub.close(linger=0)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(calm)
    rss = [_rss_mib(pid) if pid else None]
    phase[0] = "flood"
    hostile = []
    for _ in range(subscribers):  # nothing buffered on their side: the publisher's queues fill
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        hostile.append(sub)
    dealers = []
    for _ in range(replayers if replay_endpoint else 0):
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.setsockopt(zmq.RCVBUF, 4096)
        dealer.connect(replay_endpoint)
        dealers.append(dealer)
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for dealer in dealers:
            try:
                dealer.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
            except zmq.Again:
                pass
        time.sleep(1.0)
        rss.append(_rss_mib(pid) if pid else None)
    for sock in hostile + dealers:
        sock.close(linger=0)
    phase[0] = "after"
    time.sleep(settle)
    after = _rss_mib(pid) if pid else None
    stop.set()
    reader.join()
    context.term()
    reader_context.term()

    def summary(values):
        values = sorted(values)
        pick = (lambda q: values[int(q * (len(values) - 1))]) if values else (lambda q: None)
        return {"count": len(values), "median": pick(0.5), "p99": pick(0.99), "max": values[-1] if values else None}

    known = [r for r in rss if r is not None]
    return {**{k: summary(v) for k, v in delays.items()}, "rss_before": rss[0], "rss_end_of_flood": rss[-1],
            "rss_peak": max(known) if known else None, "rss_after": after}


async def kv_events_attack(session, url, tally, endpoint, replay_endpoint, pid=None, subscribers=300,
                           replayers=300, seconds=30.0, max_growth_mib=256.0, prompt_tokens=128, loaders=8):
    """kv_events_flood against the server's KV events while completions (prefix caching: each a
    new prefix) make events; live batches must arrive within 0.1 s (median) and 1 s (largest),
    and the server must grow by less than `max_growth_mib`."""
    done = asyncio.Event()
    rng = random.Random(60)

    async def load():  # bounded: until the flood is over
        while not done.is_set():
            prompt = [rng.randrange(3, 200) for _ in range(prompt_tokens)]
            status, text = await call(session, "POST", url + "/v1/completions",
                                      {"prompt": prompt, "max_tokens": 4, "temperature": 0})
            tally.count("kv-events load", status, text, expect={200})

    tasks = [asyncio.create_task(load()) for _ in range(loaders)]
    try:
        result = await asyncio.to_thread(kv_events_flood, endpoint, replay_endpoint, subscribers=subscribers,
                                         replayers=replayers, seconds=seconds, pid=pid)
    finally:
        done.set()
        await asyncio.gather(*tasks)

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f}"

    phases = "; ".join(f"{k} {v['count']} batches, median {ms(v['median'])} ms, p99 {ms(v['p99'])} ms, largest "
                       f"{ms(v['max'])} ms" for k, v in result.items() if isinstance(v, dict))
    line = f"kv-events: {subscribers} SUB and {replayers} replay clients not reading for {seconds:.0f} s: {phases}"
    if result["rss_before"] is not None:
        line += (f"; server RSS {result['rss_before']:.0f} -> {result['rss_end_of_flood']:.0f} MiB (peak "
                 f"{result['rss_peak']:.0f}), {result['rss_after']:.0f} MiB after")
        if result["rss_peak"] - result["rss_before"] > max_growth_mib:
            tally.failures.append(("kv-events", "RSS", f"+{result['rss_peak'] - result['rss_before']:.0f} MiB", ""))
    flood = result["flood"]
    if not flood["count"] or flood["median"] > 0.1 or flood["max"] > 1.0:
        tally.failures.append(("kv-events", "live batches late or missing", phases, ""))
    tally.notes.append(line)
    print(line, flush=True)


# ---------------------------------------------------------------------- data-parallel replicas
async def _replicas(session, url) -> dict:
    status, text = await call(session, "GET", url + "/health")
    state = json.loads(text) if text.startswith("{") else {}
    return {**state, "http": status}


async def _until(session, url, condition, seconds: float) -> dict | None:
    """/health polled until `condition(state)` or `seconds` pass (None)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = await _replicas(session, url)
        if condition(state):
            return state
        await asyncio.sleep(0.2)
    return None


async def dp_attack(session, url, tally, seconds: float = 120.0, requests: int = 12):
    state = await _replicas(session, url)
    replicas = state.get("replicas") or []
    if len(replicas) < 2:
        tally.notes.append("dp: skipped (the server has fewer than 2 data-parallel replicas)")
        print(tally.notes[-1])
        return
    timeout = float(os.environ.get("JPAGED_DP_HEARTBEAT_TIMEOUT", "30"))
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    all_up = lambda s: s.get("http") == 200 and s.get("degraded") is False  # noqa: E731
    lines = []

    # 1. SIGSTOP: replica 1 answers nothing; every request is still answered.
    stopped = replicas[1]["pid"]
    os.kill(stopped, signal.SIGSTOP)
    start = time.monotonic()
    try:
        answers = await asyncio.gather(*(call(session, "POST", url + "/v1/completions", body) for _ in range(requests)))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
    took = time.monotonic() - start
    for status, text in answers:
        tally.count("dp stopped replica", status, text, expect={200})
    replaced = await _until(session, url, lambda s: (s.get("replicas") or [{}, {}])[1].get("pid") != stopped,
                            timeout + seconds)
    lines.append(f"SIGSTOP: {requests} requests answered in {took:.1f} s, replica 1 "
                 + ("replaced" if replaced else "NOT replaced"))
    if replaced is None:
        tally.failures.append(("dp", "stopped replica", "not replaced", ""))
    await _until(session, url, all_up, seconds)

    # 2. Killed, then its replacement killed while it starts: it comes back.
    first = (await _replicas(session, url))["replicas"][1]["pid"]
    os.kill(first, signal.SIGKILL)
    restarted = await _until(session, url, lambda s: s["replicas"][1]["pid"] not in (None, first), seconds)
    if restarted is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(restarted["replicas"][1]["pid"], signal.SIGKILL)
    back = await _until(session, url, all_up, seconds)
    lines.append("killed while restarting: " + ("back up" if back else "NOT back"))
    if back is None:
        tally.failures.append(("dp", "killed while restarting", "did not come back", json.dumps(
            (await _replicas(session, url)).get("replicas"))[:300]))

    # 3. Every replica killed: 200 or 503 with Retry-After until one is back, never a 500.
    for replica in (await _replicas(session, url))["replicas"]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(replica["pid"], signal.SIGKILL)
    deadline, seen = time.monotonic() + seconds, collections.Counter()
    while time.monotonic() < deadline:
        status, text = await call(session, "POST", url + "/v1/completions", body)
        seen[status] += 1
        tally.count("dp none up", status, text, expect={200, 503})
        if status == 200:
            break
        await asyncio.sleep(0.2)
    lines.append(f"all killed: {dict(seen)} until served again")
    await _until(session, url, all_up, seconds)
    line = "dp: " + "; ".join(lines)
    tally.notes.append(line)
    print(line, flush=True)

