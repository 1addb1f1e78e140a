"""Hostile clients against `jpaged serve` over real HTTP: values that used to kill the engine, bodies
that used to give aiohttp's plain-text 500s, requests that used to freeze the event loop,
half-sent requests, and a property-based fuzz over the request schema. Whatever comes in, the
answer is a 4xx in OpenAI's shape or a correct 200, never a 5xx; the engine stays alive and no
KV block stays held."""

import asyncio
import json
import logging
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import types
import zlib

import aiohttp
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from serving.protocol import MAX_JSON_DEPTH, APIError, check_json_depth, json_depth
from test_server import Server, get, metrics, post, run

MAX_MODEL_LEN = 128
TIMEOUT = 3  # --timeout-keep-alive


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "128",
               "--num-gpu-blocks-override", "40", "--enforce-eager", "--timeout-keep-alive", str(TIMEOUT))
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every JSON parser but Python's does."""
    def refuse(name):
        raise ValueError(f"{name} in the response")
    return json.loads(text, parse_constant=refuse)


async def raw_post(url, path, data: bytes, headers: dict):
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(url + path, data=data, headers=headers) as r:
            return r.status, strict_json(await r.text())


def assert_openai_error(status, body, expected_status, param="*"):
    assert status == expected_status, (status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], body
    if param != "*":
        assert error["param"] == param, body


def assert_healthy_and_idle(url, timeout=60):
    assert run(get(url, "/health"))[0] == 200
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["jpaged:num_requests_running"] == m["jpaged:num_requests_waiting"] == 0 \
                and m["jpaged:gpu_cache_usage_perc"] == 0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


JSON = {"Content-Type": "application/json"}
KILLER_VALUES = [  # (path, body, param): each once killed the engine (or slipped through with a 200)
    ("/v1/completions", {"prompt": "hi", "top_k": 2**31, "temperature": 1}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 100000, "temperature": 1}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**31], "min_tokens": 1}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [300]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "temperature": 0,
                         "length_penalty": 1000}, "length_penalty"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "temperature": 0,
                         "length_penalty": -1000}, "length_penalty"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "temperature": 0,
                         "length_penalty": 400, "early_stopping": "never"}, "length_penalty"),
    ("/v1/completions", {"prompt": "hi", "n": 3000000, "temperature": 1}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 8, "max_tokens": 100, "temperature": 1}, "max_tokens"),  # > pool
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-300, "logprobs": 2}, "repetition_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', "temperature"),  # parses as inf
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 100000, "stream": True}, "stop"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"prompt": [-1, 5], "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": [2**64], "echo": True}, "prompt"),
    ("/v1/completions", {"prompt": [[1]] * 5000}, "prompt"),
    ("/v1/completions", {"prompt": [1] * 100000}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1e999}',
     "temperature"),
    ("/detokenize", {"tokens": [1] * 100000}, "tokens"),
]


def test_killer_values_get_400s_and_the_engine_lives(server):
    async def send_all():
        return [await (raw_post(server.url, path, body, JSON) if isinstance(body, bytes) else
                       post(server.url, path, body, headers={})) for path, body, _ in KILLER_VALUES]

    for (path, body, param), (status, got) in zip(KILLER_VALUES, run(send_all())):
        assert_openai_error(status, got, 400, param)
    status, got = run(post(server.url, "/v1/completions", {"prompt": "still alive", "max_tokens": 5,
                                                           "ignore_eos": True}, headers={}))
    assert status == 200 and got["usage"]["completion_tokens"] == 5
    assert_healthy_and_idle(server.url)


MALFORMED = [  # (path, raw body, headers): each used to be a 500 in aiohttp's plain-text shape
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', JSON),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', JSON),
    ("/tokenize", b'{"prompt": "\\ud800"}', JSON),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, JSON),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", JSON),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', JSON),
    ("/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "application/json; charset=bogus"}),
    ("/v1/completions", b"\xff\xfe{", JSON),
    ("/v1/completions", b"this is not deflate", {**JSON, "Content-Encoding": "deflate"}),
    ("/v1/completions", zlib.compress(b'{"prompt": "hi"')[:-3], {**JSON, "Content-Encoding": "deflate"}),
]


def test_malformed_bodies_get_openai_errors(server):
    async def send_all():
        return [await raw_post(server.url, path, data, headers) for path, data, headers in MALFORMED]

    for (path, data, _), (status, got) in zip(MALFORMED, run(send_all())):
        assert 400 <= status < 500, (data[:60], status, got)
        assert_openai_error(status, got, status)
    # A well-formed compressed body is fine.
    status, got = run(raw_post(server.url, "/v1/completions", zlib.compress(b'{"prompt": "hi", "max_tokens": 2}'),
                               {**JSON, "Content-Encoding": "deflate"}))
    assert status == 200 and got["usage"]["completion_tokens"] >= 1
    assert_healthy_and_idle(server.url)


def test_huge_requests_do_not_stall_the_event_loop(server):
    """While requests that used to freeze the server for seconds are refused, /health keeps
    answering: /health answers arrive between the first huge request and the last one's answer."""
    huge = [
        ("/v1/completions", {"prompt": "hi", "n": 3000000, "temperature": 1}),
        ("/v1/completions", {"prompt": "x" * (15 * 2**20)}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * (15 * 2**20)}]}),
        ("/tokenize", {"prompt": "z" * (4 * 2**20)}),
        ("/v1/completions", {"prompt": "hi", "stop": ["s" * 20] * 100000, "stream": True}),
        ("/v1/completions", {"prompt": [[1, 2]] * 2000000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 200000}),
    ]

    async def scenario():
        log, latencies, polled, done = [], [], asyncio.Event(), asyncio.Event()

        async def poll():
            async with aiohttp.ClientSession() as session:
                while not done.is_set():
                    start = time.monotonic()  # for the printout only
                    async with session.get(server.url + "/health") as r:
                        assert r.status == 200
                    latencies.append(time.monotonic() - start)
                    log.append("health")
                    polled.set()
                    await asyncio.sleep(0.02)

        poller = asyncio.create_task(poll())
        await polled.wait()
        statuses = []
        for path, body in huge:
            log.append("sent")
            statuses.append(await post(server.url, path, body, headers={}))
            log.append("answered")
        done.set()
        await poller
        return statuses, latencies, log

    statuses, latencies, log = run(scenario())
    for (path, body), (status, got) in zip(huge, statuses):
        assert_openai_error(status, got, 400)
    # /health kept answering through them: events in order, not speeds (how fast:
    # scripts/stress_server.py --malformed, PERF.md).
    during = log[log.index("sent"):len(log) - log[::-1].index("answered")]
    assert during.count("health") > 0, log
    print(f"/health during huge requests: {during.count('health')} answers, max {max(latencies) * 1e3:.0f} ms")
    assert_healthy_and_idle(server.url)


def test_half_sent_requests_time_out(server):
    host, port = server.url.removeprefix("http://").split(":")

    def exchange(data: bytes) -> tuple[bytes, bool]:
        """What the server sent back until it closed the connection, and whether the connection
        was still open, unanswered, after the server had answered a whole request sent after
        `data` on another connection (so it had read `data` and chose to wait for the rest)."""
        with socket.create_connection((host, int(port)), timeout=TIMEOUT * 5) as sock:
            sock.sendall(data)
            assert run(get(server.url, "/health"))[0] == 200
            sock.setblocking(False)
            try:
                sock.recv(1, socket.MSG_PEEK)
                waited = False  # an answer, or the end of the stream, was there already
            except BlockingIOError:  # nothing to read and no end of stream: still open
                waited = True
            # The socket's own timeout catches a server that never closes.
            sock.settimeout(TIMEOUT * 5)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
            return received, waited

    # Requests aiohttp cannot even parse are answered in OpenAI's shape too.
    for garbage in (b"NOT A REQUEST\r\n\r\n", b"GET / HTTP/1.1\r\nX-Long: " + b"x" * 20000 + b"\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        received, _ = exchange(garbage)
        head, _, body = received.partition(b"\r\n\r\n")
        assert head[:9] in (b"HTTP/1.0 ", b"HTTP/1.1 ") and head[9:10] == b"4", received
        assert_openai_error(int(head[9:12]), strict_json(body.decode()), int(head[9:12]))
    # Headers never finished: the connection is closed without an answer.
    received, waited = exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applica")
    # Closed by --timeout-keep-alive: the server still waited after reading it, then closed it unanswered.
    assert received == b"" and waited
    # Body half-sent: 408 with an OpenAI error object.
    received, waited = exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 100\r\nConnection: close\r\n\r\n{\"prompt\":")
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received
    assert_openai_error(408, strict_json(body.decode()), 408)


def test_a_client_that_left_is_not_a_server_error(caplog):
    """Writing a stream to a client that closed its socket raises ConnectionResetError (the stress
    script saw it at the stream's headers and mid-stream). That is the client's doing: an access
    log status of 499 (nginx's "client closed request"), not a 500 with a traceback."""
    from serving.api_server import OpenAIServer

    async def handler(request):
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    async def bug(request):
        raise KeyError("a bug")

    request = types.SimpleNamespace(method="POST", path="/v1/completions")
    with caplog.at_level(logging.INFO):
        response = asyncio.run(OpenAIServer._errors(None, request, handler))
    assert response.status == 499 and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with caplog.at_level(logging.INFO):  # what anything else still gets
        response = asyncio.run(OpenAIServer._errors(None, request, bug))
    assert response.status == 500 and any(r.levelno == logging.ERROR for r in caplog.records)


def test_malformed_http_is_one_warning_line_not_a_traceback(caplog):
    """A request line or header over aiohttp's 8,190 bytes (stress_server's sleep?level=1...1) is
    the client's doing: a 400 in OpenAI's shape and one WARNING line, not an ERROR with a traceback
    per request (issue 38: a client could fill the log)."""
    from aiohttp import web

    from serving.api_server import _AppRunner

    async def attempt(raw: bytes) -> bytes:
        runner = _AppRunner(web.Application())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
            writer.write(raw)
            await writer.drain()
            received = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return received
        finally:
            await runner.cleanup()

    for raw in (b"POST /sleep?level=" + b"1" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n"):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            received = asyncio.run(attempt(raw))
        head, _, body = received.partition(b"\r\n\r\n")
        assert re.match(rb"HTTP/1\.[01] 400 ", head), received[:200]
        assert_openai_error(400, strict_json(body.decode()), 400)
        logged = [r for r in caplog.records if r.name == "aiohttp.server"]
        assert [r.levelno for r in logged] == [logging.WARNING], [(r.levelname, r.getMessage()) for r in logged]
        assert not any(r.exc_info for r in caplog.records) and "LineTooLong" in logged[0].getMessage()


# ---------------------------------------------------------------------- malformed fields (issue 30)
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def nested(depth: int, rng) -> str:
    """JSON text nesting arrays and objects `depth` deep, in a random mix, with brackets and escaped
    quotes inside its strings (they must not count)."""
    opens, closes = [], []
    for _ in range(depth):
        if rng.random() < 0.5:
            opens.append("[")
            closes.append("]")
        else:
            opens.append('{"k[\\"{": ')
            closes.append("}")
    return "".join(opens) + '"[{\\\\"' + "".join(reversed(closes))


def malformed_fields(rng):
    """(path, raw body, headers, param): each once a 500 or a RecursionError, now a 400 naming the field."""
    deep = rng.randint(MAX_JSON_DEPTH + 1, 3000)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "f", "arguments": "[" * deep + "]" * deep}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    cases = [(CHAT, {"messages": HI, "response_format": rf}, param) for rf, param in [
        ({"type": "json_schema", "json_schema": "s"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": ["s"]}, "response_format.json_schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": "s"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
        ({}, "response_format"), ({"type": ["text"]}, "response_format"), ("json", "response_format")]]
    cases += [(CHAT, {"messages": HI, "tools": TOOLS, "tool_choice": choice}, param) for choice, param in [
        ({"type": "function", "function": "f"}, "tool_choice.function"),
        ({"type": "function", "function": ["f"]}, "tool_choice.function"),
        ({"type": "function"}, "tool_choice.function"),
        ({"type": "function", "function": {"name": ["f"]}}, "tool_choice.function.name"),
        ({"type": "function", "function": {"name": {"f": 1}}}, "tool_choice.function.name"),
        ({"type": "tool", "function": {"name": "f"}}, "tool_choice.type"),
        ({"type": "function", "function": {"name": "g"}}, "tool_choice"),
        (["auto"], "tool_choice"), ([], "tool_choice"), (5, "tool_choice"), (True, "tool_choice"),
        ("sometimes", "tool_choice"), (None, "tool_choice")]]  # null: the default, "auto", needs a parser
    cases += [(CHAT, {"messages": HI, "tool_choice": ["auto"]}, "tool_choice"),
              (CHAT, {"messages": HI, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice.function"),
              (CHAT, {"messages": HI, "tools": {"f": 1}}, "tools"),
              (CHAT, {"messages": HI, "tools": [TOOLS[0], "f"]}, "tools[1]"),
              (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": "s"}}],
                      "tool_choice": "required"}, "tools[0].function.parameters"),
              (CHAT, {"messages": history, "max_tokens": 1}, "messages[1].tool_calls[0].function.arguments"),
              ("/v1/completions", {"prompt": "hi", "guided_json": nested(deep, rng)}, "guided_json")]
    cases = [(path, json.dumps(body).encode(), JSON, param) for path, body, param in cases]
    for charset in ("undefined", "punycode", "rot13", "base64", "utf-7", "no-such-charset"):
        cases.append(("/v1/completions", b'{"prompt": "hi", "max_tokens": 1}',
                      {"Content-Type": f"application/json; charset={charset}"}, "Content-Type"))
    for path in ("/v1/completions", CHAT, "/tokenize"):  # the body itself: refused before json.loads recurses
        cases.append((path, nested(deep, rng).encode(), JSON, None))
        cases.append((path, b'{"prompt": "hi", "x": ' + nested(MAX_JSON_DEPTH, rng).encode() + b"}", JSON, None))
    return cases


def test_json_depth_is_the_parsed_depth():
    """json_depth, found without parsing, is the depth json.loads finds, whatever the strings hold
    (brackets, quotes, runs of backslashes, multi-byte characters); check_json_depth refuses one
    level past MAX_JSON_DEPTH, in a 400 naming the field."""
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)

    def value(depth):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice([1, None, True, "".join(rng.choices('[]{}"\\ aé🙂', k=rng.randint(0, 6)))])
        if rng.random() < 0.5:
            return [value(depth - 1) for _ in range(rng.randint(0, 3))]
        return {"".join(rng.choices('[{"\\k', k=3)): value(depth - 1) for _ in range(rng.randint(0, 3))}

    def depth_of(v):
        children = v if isinstance(v, list) else v.values() if isinstance(v, dict) else None
        return 0 if children is None else 1 + max(map(depth_of, children), default=0)

    for _ in range(2000):
        v = value(rng.randint(0, 8))
        text = json.dumps(v, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        assert json_depth(text) == depth_of(v), text
        if isinstance(v, (list, dict)):  # first_value: the first array or object
            tail = " ; " + "[" * rng.randint(0, 50)
            assert json_depth(text + tail, first_value=True) == depth_of(v), text + tail
    for depth in (MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 10**5):
        text = nested(depth, rng)
        assert json_depth(text) == depth
        if depth <= MAX_JSON_DEPTH:
            check_json_depth(text, "x", "'x'")
        else:
            with pytest.raises(APIError) as e:
                check_json_depth(text, "x", "'x'")
            assert e.value.status == 400 and e.value.param == "x" and "'x'" in e.value.message


def test_malformed_fields_get_400s_naming_them(server):
    """Malformed response_format, tool_choice and tools, charsets Python cannot (or must not) decode
    with, and JSON nested deeper than MAX_JSON_DEPTH (the body, tool-call arguments in the history,
    a guided_json schema as text): a 400 naming the field, never a 500 or a RecursionError."""
    seed = random.randrange(2**32)
    print("seed", seed)
    cases = malformed_fields(random.Random(seed))

    async def send_all():
        return [await raw_post(server.url, path, data, headers) for path, data, headers, _ in cases]

    for (path, data, _, param), (status, got) in zip(cases, run(send_all())):
        assert_openai_error(status, got, 400, param)
        assert param is None or param in got["error"]["message"] or "charset" in got["error"]["message"], got
    # What is allowed still is: a declared UTF-8 or Latin-1 charset, MAX_JSON_DEPTH levels, brackets in strings.
    rng = random.Random(seed)
    fine = [("/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', {"Content-Type": f"application/json; charset={c}"})
            for c in ("utf-8", "UTF8", "latin-1", "us-ascii")]
    fine.append(("/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "x": ' +
                 nested(MAX_JSON_DEPTH - 1, rng).encode() + b"}", JSON))
    fine.append(("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1, "user": "[{" * 5000}).encode(), JSON))
    fine.append((CHAT, json.dumps({"messages": HI, "max_tokens": 1, "tool_choice": None}).encode(), JSON))
    fine.append((CHAT, json.dumps({"messages": HI, "max_tokens": 1, "tools": [], "tool_choice": "none"}).encode(), JSON))

    async def send_fine():
        return [await raw_post(server.url, path, data, headers) for path, data, headers in fine]

    for (_, data, headers), (status, got) in zip(fine, run(send_fine())):
        assert status == 200 and got["usage"]["completion_tokens"] == 1, (data[:80], headers, got)
    assert_healthy_and_idle(server.url)


def test_completion_top_logprobs_has_every_token_asked_for(server):
    """Tokens that decode to the same text (tiny's bytes 0x80-0xff each decode to "\\ufffd") are
    all in `top_logprobs`: the chosen token under its text, the others under "token_id:N" when
    their text is taken. logit_bias pushes those bytes to the top, so every step has such ties."""
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    logprobs = rng.randint(2, 5)
    bias = {str(t): 30 for t in rng.sample(range(0x80, 0x100), 12)}
    prompt = [rng.randrange(0x80, 0x100) for _ in range(rng.randint(4, 12))]
    for echo in (False, True):
        status, got = run(post(server.url, "/v1/completions", {
            "prompt": prompt, "max_tokens": 6, "logprobs": logprobs, "logit_bias": bias, "echo": echo,
            "temperature": 1.0, "seed": rng.randrange(2**31), "ignore_eos": True}, headers={}))
        assert status == 200, got
        lp = got["choices"][0]["logprobs"]
        entries = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
        assert len(entries) == 6 + (len(prompt) if echo else 0)
        for i, (token, logprob, top) in enumerate(entries):
            if top is None:  # the prompt's first token has none
                assert echo and i == 0
                continue
            assert len(top) in (logprobs, logprobs + 1), (i, top)  # the chosen token may be outside the top
            assert top[token] == logprob, (i, token, top)
            assert all(0 <= int(k[len("token_id:"):]) < 259 for k in top if k.startswith("token_id:"))
        generated = [top for _, _, top in entries[-6:]]
        assert sum(k.startswith("token_id:") for top in generated for k in top) >= 6  # the ties were kept apart


def test_a_deep_generated_tool_call_is_content():
    """A model that writes a tool call nested ~1000 deep (json.loads: RecursionError) gets it back
    as content with its finish_reason, whole and streamed; the server serves on."""
    s = Server("--max-num-seqs", "2", "--max-model-len", "1100", "--enforce-eager", "--disable-log-requests",
               "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    try:
        seed = random.randrange(2**32)
        print("seed", seed)
        rng = random.Random(seed)
        prefix = '{"name": "f", "parameters": '
        max_tokens = rng.randint(990, 1050)
        # The regex writes the call's start, then "[" as long as the model likes; logit_bias makes it like that.
        body = {"messages": HI, "tools": TOOLS, "guided_regex": re.escape(prefix) + r"\[+", "logit_bias": {"91": 100},
                "max_tokens": max_tokens, "temperature": rng.choice([0, 1.0]), "seed": rng.randrange(2**31)}

        async def both():
            return await asyncio.gather(post(s.url, CHAT, body, headers={}), _stream_text(s.url, CHAT, body))

        (status, whole), events = run(both())
        assert status == 200, whole
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"], choice["finish_reason"]
        assert choice["message"]["content"] == prefix + "[" * (max_tokens - len(prefix)), choice["message"]["content"][:80]
        assert all("error" not in e for e in events), [e for e in events if "error" in e]
        finished = [c for e in events for c in e["choices"] if c.get("finish_reason")]
        assert [c["finish_reason"] for c in finished] == ["length"]
        assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == \
            choice["message"]["content"]
        assert not any(c["delta"].get("tool_calls") for e in events for c in e["choices"])
        status, got = run(post(s.url, CHAT, {"messages": HI, "max_tokens": 3, "ignore_eos": True}, headers={}))
        assert status == 200 and got["usage"]["completion_tokens"] == 3
    finally:
        assert s.stop() == 0, "".join(s.log[-30:])


async def _stream_text(url, path, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            text = await r.text()
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text[-300:]
    return [strict_json(e) for e in events[:-1]]


@pytest.mark.slow
def test_sigterm_during_warm_up_exits_0(tmp_path):
    """SIGTERM while `jpaged serve` compiles its step buckets (a fresh executable cache: it
    compiles for a while) ends the process with status 0, as SIGTERM while serving does."""
    seed = random.randrange(2**32)
    print("seed", seed)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JPAGED_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", "--model", "tiny", "--port", "0",
                             "--max-num-seqs", "4", "--max-model-len", "64", "--no-background-warmup"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    output = b""
    try:
        deadline = time.monotonic() + 300
        while b"Compiling step buckets" not in output:  # tqdm's bar, on stderr
            assert time.monotonic() < deadline and proc.poll() is None, output.decode()[-2000:]
            output += os.read(proc.stdout.fileno(), 4096)
        time.sleep(random.Random(seed).uniform(0, 1.5))  # somewhere in the warm-up
        assert proc.poll() is None, output.decode()[-2000:]
        proc.send_signal(signal.SIGTERM)
        output += proc.communicate(timeout=60)[0]  # (a hang fails here)
    finally:
        proc.kill()
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-2000:]
    assert "jpaged: serving" not in text and "SIGTERM during start-up" in text and "Traceback" not in text, text[-2000:]
    # No loading marker left behind: the next start would take it for a crash and load nothing.
    assert not any(p.name.startswith(".loading") for p in tmp_path.iterdir())


# SIGTERM delivered while the main thread runs a garbage-collector callback: the handler's
# SystemExit is dropped by Python there (CI saw jax's `_xla_gc_callback` swallow it).
SIGTERM_IN_GC_CALLBACK = """
import gc, os, signal, sys
import jpaged.runner.model_runner as model_runner
fired = []
def in_gc(phase, info):
    if phase == "start" and not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs here, inside the callback
            pass
warm_up = model_runner.ModelRunner.warm_up
def warm_up_hit_in_gc(self, stop=None):
    gc.callbacks.append(in_gc)
    gc.collect()
    return warm_up(self, stop)
model_runner.ModelRunner.warm_up = warm_up_hit_in_gc
from serving.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_lost_in_gc_callback_still_exits_0(tmp_path):
    """A SIGTERM whose SystemExit Python drops (raised inside a gc callback) still stops the
    warm-up, with status 0, no traceback, no server and no loading marker left."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JPAGED_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SIGTERM_IN_GC_CALLBACK, "serve", "--model", "tiny", "--port", "0",
                           "--max-num-seqs", "4", "--max-model-len", "64", "--no-background-warmup"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=300)
    text = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, text[-2000:]
    assert "SIGTERM during start-up" in text and "jpaged: serving" not in text, text[-2000:]
    assert "Traceback" not in text and "Exception ignored" not in text, text[-2000:]
    # Unwound by the warm-up's check (the grace timer's os._exit would leave the bar unfinished
    # mid-shape and skip the cache's clean-up): no loading marker.
    assert not any(p.name.startswith(".loading") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------- property-based fuzz
def _values(valid):
    hostile = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=8), st.lists(st.integers(-5, 300), max_size=4),
                        st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
    return st.one_of(valid, valid, valid, hostile)  # mostly plausible values, some hostile


FIELDS = {
    "max_tokens": st.integers(0, 24), "n": st.integers(1, 3), "best_of": st.integers(1, 4),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1.0, 2.0, 1e-6]), "top_p": st.floats(0, 1), "top_k": st.integers(-2, 300),
    "min_p": st.floats(0, 1), "seed": st.integers(-2**63, 2**64), "ignore_eos": st.booleans(),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "min_tokens": st.integers(0, 8),
    "logprobs": st.integers(0, 25), "echo": st.booleans(), "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(0, 3),
    "use_beam_search": st.booleans(), "length_penalty": st.floats(-20, 20),
    "early_stopping": st.sampled_from([True, False, "never"]), "stream": st.booleans(),
    "model": st.sampled_from(["tiny", "tiny", "other"]),
}
PROMPTS = st.one_of(st.text(max_size=30), st.lists(st.integers(-2, 300), max_size=12),
                    st.lists(st.text(max_size=12), max_size=3), st.integers())
MESSAGES = st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                     "content": st.text(max_size=20)}), min_size=1, max_size=3),
                     st.text(max_size=5))
HOSTILE = st.one_of(
    st.tuples(st.just("/v1/completions"),
              st.fixed_dictionaries({"prompt": PROMPTS}, optional={k: _values(v) for k, v in FIELDS.items()})),
    st.tuples(st.just("/v1/chat/completions"),
              st.fixed_dictionaries({"messages": MESSAGES}, optional={
                  **{k: _values(v) for k, v in FIELDS.items() if k not in ("echo", "logprobs", "best_of")},
                  "logprobs": _values(st.booleans()), "top_logprobs": _values(st.integers(0, 22))})),
)
ASCII = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=20)


@st.composite
def plausible(draw):
    """Valid requests of every kind the engine runs (they must all succeed): beam search, parallel
    sampling, best_of, penalties, stops, logprobs, token-id and batched prompts, streams."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    n = draw(st.integers(1, 3))
    body = {"n": n, "max_tokens": draw(st.integers(1, 24)), "ignore_eos": draw(st.booleans())}
    if draw(st.integers(0, 3)) == 0:
        body.update(use_beam_search=True, temperature=0, length_penalty=draw(st.floats(-10, 10)),
                    early_stopping=draw(st.sampled_from([True, False, "never"])))
    else:
        body.update(temperature=draw(st.sampled_from([0.7, 1.0, 2.0] if n > 1 else [0, 0.7, 1.0])),
                    top_p=draw(st.floats(0.05, 1)), top_k=draw(st.integers(-1, 259)), min_p=draw(st.floats(0, 1)),
                    seed=draw(st.one_of(st.none(), st.integers(0, 2**64))),
                    presence_penalty=draw(st.floats(-2, 2)), frequency_penalty=draw(st.floats(-2, 2)),
                    repetition_penalty=draw(st.floats(0.5, 2)), min_tokens=draw(st.integers(0, body["max_tokens"])),
                    stop=draw(st.lists(ASCII, max_size=2)), stop_token_ids=draw(st.lists(st.integers(0, 258), max_size=2)))
        if path == "/v1/completions" and body["temperature"] > 0 and draw(st.booleans()):
            body["best_of"] = n + 1
    stream_ok = not body.get("use_beam_search") and body.get("best_of", n) == n
    body["stream"] = stream_ok and draw(st.booleans())
    if path == "/v1/completions":
        body["prompt"] = draw(st.one_of(ASCII, st.lists(st.integers(0, 258), min_size=1, max_size=30),
                                        st.lists(ASCII, min_size=1, max_size=2)))
        body["logprobs"] = draw(st.one_of(st.none(), st.integers(0, 5)))
    else:
        body["messages"] = [{"role": "user", "content": draw(ASCII)}]
        if draw(st.booleans()):
            body.update(logprobs=True, top_logprobs=draw(st.integers(0, 5)))
    return path, body


async def _fuzz_one(url, path, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as r:
            status, text = r.status, await r.text()
    if body.get("stream") is True and status == 200:
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", text[-300:]
        chunks = [strict_json(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        return status, chunks
    return status, strict_json(text)


def _check_completion(path, body, got):
    """A 200 must be what was asked for: one choice per prompt and sample, finished, with
    max_tokens tokens exactly when it says "length"."""
    n = body.get("n") or 1
    max_tokens = body.get("max_tokens") or (16 if path == "/v1/completions" else None)
    prompt = body.get("prompt")
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    assert len(got["choices"]) == n * num_prompts
    for choice in got["choices"]:
        assert choice["finish_reason"] in ("stop", "length"), choice
        logprobs = choice["logprobs"]
        if logprobs is not None and max_tokens is not None:
            num_tokens = len(logprobs["tokens"] if path == "/v1/completions" else logprobs["content"])
            if body.get("echo") is True:
                continue  # echo with logprobs is refused; echo alone has no logprobs
            assert num_tokens <= max_tokens
            if choice["finish_reason"] == "length":
                assert num_tokens == max_tokens, (choice, body)
            for lp in logprobs.get("token_logprobs") or []:
                assert lp <= 0 and math.isfinite(lp)
    assert got["usage"]["completion_tokens"] <= n * num_prompts * (max_tokens or MAX_MODEL_LEN)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=st.one_of(plausible(), HOSTILE))
def test_fuzz_request_schema(server, request):
    """4xx in OpenAI's shape or a correct 200, never a 5xx; valid requests always succeed."""
    path, body = request
    status, got = run(_fuzz_one(server.url, path, body))
    event(f"{path} {status}")
    assert status < 500, (status, got, body)
    if status != 200:
        assert_openai_error(status, got, status)
        return
    if body.get("stream") is True:
        finished = [c for chunk in got for c in chunk["choices"] if c.get("finish_reason")]
        assert sorted(c["index"] for c in finished) == list(range(len(finished)))
        assert all(c["finish_reason"] in ("stop", "length") for c in finished)
    else:
        _check_completion(path, body, got)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=plausible())
def test_fuzz_valid_requests_succeed(server, request):
    path, body = request
    status, got = run(_fuzz_one(server.url, path, body))
    assert status == 200, (got, body)
    if body["stream"] is not True:
        _check_completion(path, body, got)


def test_after_the_fuzz_the_engine_is_alive_and_holds_no_block(server):
    assert_healthy_and_idle(server.url)
    status, got = run(post(server.url, "/v1/completions", {"prompt": "after", "max_tokens": 4, "ignore_eos": True},
                           headers={}))
    assert status == 200 and got["usage"]["completion_tokens"] == 4
