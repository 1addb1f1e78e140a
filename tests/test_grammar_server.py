"""Hostile grammars against `jpaged serve`: a schema that takes llguidance minutes to compile is
refused within --grammar-compile-timeout while /health and another request's stream keep their
pace (the compile runs in a worker process, awaited in a thread); grammars the engine cannot honour
are 400s; a grammar engine that fails during generation ends the request with an error, never a
200 "stop"."""

import asyncio
import json
import time

import aiohttp
import pytest

from test_server import Server, post, run, stream_events
from test_server_robustness import assert_healthy_and_idle, assert_openai_error
from test_structured_output import _all_of

HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    # Warmed up (no --enforce-eager), so the victim's steps never compile while measured.
    s = Server("--max-num-seqs", "4", "--max-model-len", "512", "--max-num-batched-tokens", "128",
               "--grammar-compile-timeout", "8", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


async def _victim(url, arrivals: list, started: asyncio.Event):
    body = {"model": "tiny", "prompt": "a victim", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 5:
                        started.set()


async def _health_latencies(url, stop: asyncio.Event, latencies: list, answered: list):
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            start = time.monotonic()
            async with session.get(url + "/health") as r:
                assert r.status == 200
            answered.append(time.monotonic())
            latencies.append(answered[-1] - start)
            await asyncio.sleep(0.1)


def test_freezing_schema_leaves_health_and_streams_alone(server):
    """The 540-byte schema that froze the whole server for 74 s: a 400 naming the compile limit,
    while the victim's tokens keep coming and /health keeps answering during the compile. (How
    fast: scripts/stress_server.py --grammars measures the gaps and /health's latency; PERF.md.)"""
    schema = _all_of(21)

    async def scenario():
        arrivals, latencies, answered, started, stop = [], [], [], asyncio.Event(), asyncio.Event()
        victim = asyncio.create_task(_victim(server.url, arrivals, started))
        await asyncio.wait_for(started.wait(), 120)
        health = asyncio.create_task(_health_latencies(server.url, stop, latencies, answered))
        start = time.monotonic()
        status, body = await post(server.url, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 4,
                                                                  "guided_json": schema}, headers=HEADERS)
        elapsed = time.monotonic() - start
        await asyncio.sleep(0.5)
        stop.set()
        await health
        during = [t for t in arrivals if start <= t <= start + elapsed]
        health_during = [t for t in answered if start <= t <= start + elapsed]
        await victim
        return status, body, elapsed, arrivals, during, latencies, health_during

    status, body, elapsed, arrivals, during, latencies, health_during = run(scenario())
    gaps = [b - a for a, b in zip(arrivals[4:], arrivals[5:])]
    print(f"attack answered in {elapsed:.2f} s: {status} {body}; victim: {len(arrivals)} chunks, {len(during)} "
          f"during the attack, largest gap {max(gaps):.3f} s; /health: {len(latencies)} polls, "
          f"slowest {max(latencies):.3f} s")
    assert_openai_error(status, body, 400)
    message = body["error"]["message"]
    assert message.startswith("guided_json=") and "grammar_compile_timeout=8" in message
    # The compile ran out its 8 s budget in the worker, and meanwhile the stream went on and
    # /health answered: orderings of events, not speeds.
    assert len(arrivals) > 100 and len(during) > 0 and len(health_during) > 0
    assert_healthy_and_idle(server.url)


BAD_GRAMMARS = [  # (path, body): each a 400 before any generation
    ("/v1/completions", {"prompt": "a", "guided_choice": [str(i) for i in range(100_000)]}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"enum": list(range(100_000))}}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"anyOf": [{"const": i} for i in range(2000)]}}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "object", "patternProperties": {
        f"^k{i}[a-z]*$": {} for i in range(1000)}}}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "integer", "minimum": 10**30}}),
    ("/v1/completions", {"prompt": "a", "guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}}}}),
    ("/v1/completions", {"prompt": "a", "guided_regex": ""}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
                                  "type": "object", "properties": {"x": {"type": "integer"}}}}}
                                        for i in range(1000)]}),
]


def test_grammars_the_engine_cannot_honour_are_400s(server):
    for path, body in BAD_GRAMMARS:
        start = time.monotonic()
        status, answer = run(post(server.url, path, {"model": "tiny", "max_tokens": 4, **body}, headers=HEADERS))
        print(f"{time.monotonic() - start:.2f} s {status} {json.dumps(answer)[:200]}")
        assert_openai_error(status, answer, 400)
        assert "backtrace" not in answer["error"]["message"] and "<state>" not in answer["error"]["message"]
    assert_healthy_and_idle(server.url)


def test_grammar_engine_error_during_generation_is_an_error_not_stop(server):
    """`a{1000}{1000}` compiles, then the grammar engine fails at the first token: the whole
    response is a 400 with an error object; the streamed one ends its choice with finish_reason
    "error" and an error event. Never a 200 "stop" with text that breaks the grammar."""
    body = {"model": "tiny", "prompt": "a", "max_tokens": 8, "guided_regex": "a{1000}{1000}", "temperature": 1.0}
    status, answer = run(post(server.url, "/v1/completions", body, headers=HEADERS))
    assert_openai_error(status, answer, 400)
    assert "lexer" in answer["error"]["message"] and "during generation" in answer["error"]["message"]
    events = run(stream_events(server.url, "/v1/completions", {**body, "stream": True}))
    finishes = [c["finish_reason"] for e in events if "choices" in e for c in e["choices"] if c["finish_reason"]]
    errors = [e["error"] for e in events if "error" in e]
    assert finishes == ["error"] and len(errors) == 1 and "lexer" in errors[0]["message"], events
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "guided_regex": "a{1000}{1000}"}
    status, answer = run(post(server.url, "/v1/chat/completions", chat, headers=HEADERS))
    assert_openai_error(status, answer, 400)
    assert "lexer" in answer["error"]["message"]
    assert_healthy_and_idle(server.url)
