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


async def _victim(url, log: list, started: asyncio.Event):
    body = {"model": "tiny", "prompt": "a victim", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    log.append("chunk")
                    if log.count("chunk") == 5:
                        started.set()


async def _health(url, stop: asyncio.Event, log: list, latencies: list):
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            start = time.monotonic()  # for the printout only
            async with session.get(url + "/health") as r:
                assert r.status == 200
            latencies.append(time.monotonic() - start)
            log.append("health")
            await asyncio.sleep(0.1)


def test_freezing_schema_leaves_health_and_streams_alone(server):
    """The 540-byte schema that froze the whole server for 74 s: a 400 naming the compile limit,
    while the victim's tokens keep coming and /health keeps answering during the compile. (How
    fast: scripts/stress_server.py --grammars measures the gaps and /health's latency; PERF.md.)"""
    schema = _all_of(21)

    async def scenario():
        log, latencies, started, stop = [], [], asyncio.Event(), asyncio.Event()
        victim = asyncio.create_task(_victim(server.url, log, started))
        await asyncio.wait_for(started.wait(), 120)
        health = asyncio.create_task(_health(server.url, stop, log, latencies))
        log.append("attack")
        status, body = await post(server.url, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 4,
                                                                  "guided_json": schema}, headers=HEADERS)
        log.append("refused")
        stop.set()
        await health
        await victim
        return status, body, log, latencies

    status, body, log, latencies = run(scenario())
    during = log[log.index("attack"):log.index("refused")]
    print(f"attack: {status} {body}; victim: {log.count('chunk')} chunks, {during.count('chunk')} during the "
          f"attack; /health: {len(latencies)} polls, {during.count('health')} during, slowest {max(latencies):.3f} s")
    assert_openai_error(status, body, 400)
    message = body["error"]["message"]
    assert message.startswith("guided_json=") and "grammar_compile_timeout=8" in message
    # The compile ran out its 8 s budget in the worker, and meanwhile the stream went on and
    # /health answered: orderings of events, not speeds.
    assert log.count("chunk") > 100 and during.count("chunk") > 0 and during.count("health") > 0, log


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
