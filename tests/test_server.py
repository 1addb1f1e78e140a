"""The OpenAI-compatible server, driven over real HTTP on 127.0.0.1 with aiohttp and the official
`openai` client. The server runs in a subprocess (`python -m serving.cli serve`), as users run it."""

import asyncio
import base64
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import typing

import aiohttp
import numpy as np
import openai
import pytest

from jpaged.models import tiny
from jpaged.models.tiny import tiny_tokenizer

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256


class Server:
    """`jpaged serve` in a subprocess on a free port; its log is kept for failure messages."""

    def __init__(self, *flags: str, startup_timeout: float = 600, env: dict | None = None):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", "--model", "tiny", "--port", "0",
                                      *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        self.url = None
        ready = threading.Event()

        def drain():
            for line in self.proc.stdout:
                self.log.append(line)
                if self.url is None and line.startswith("jpaged: serving"):
                    self.url = line.split(" at ")[1].split("/v1")[0]
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(startup_timeout) or self.url is None:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.log))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def real_model_env() -> dict:
    """A real model's server (SmolLM2) compiles at XLA's -O1, not the suite's -O0 (conftest.py):
    there its steps' run time outweighs their compile time (test_smollm2.py alone at idle: 163 s
    at -O0, 103 s at -O1). A level set from outside the suite stays."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": flags.replace("--xla_backend_optimization_level=0", "--xla_backend_optimization_level=1")}


# --chat-template replaces the tokenizer's: a file holding tiny's own with a system line before it.
CHAT_TEMPLATE = "[custom template]\n" + tiny.CHAT_TEMPLATE
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    s = Server("--api-key", API_KEY, "--max-num-seqs", "64", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", "512", "--enforce-eager", "--chat-template", str(template),
               "--max-logprobs", "5", "--allowed-origins", ORIGIN, "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--profile", str(tmp_path_factory.mktemp("profile")))
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def run(coro):
    return asyncio.run(coro)


async def post(url, path, body=None, *, data=None, headers=AUTH):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body if data is None else None, data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None)


async def get(url, path, headers=AUTH):
    async with aiohttp.ClientSession() as session:
        async with session.get(url + path, headers=headers) as r:
            return r.status, await r.text()


async def stream_events(url, path, body):
    """The parsed `data:` events of a streamed response, up to and including [DONE]."""
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json={**body, "stream": True}, headers=AUTH) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line:
                    assert line.startswith("data: ")
                    events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def metrics(url) -> dict[str, float]:
    status, text = run(get(url, "/metrics"))
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = values[name.split("{")[0]] = float(value)
    return values


def random_prompt(rng, n_words=4):
    return " ".join("".join(rng.choice("abcdefghij klmno") for _ in range(rng.randint(2, 6))) for _ in range(n_words))


# ---------------------------------------------------------------------- endpoints
def test_requests_ask_for_delta_outputs():
    """The server asks the engine for DELTA outputs (a step's output carries only what is new, not
    the whole text and token list again) whenever the engine can give them; best_of > n and beam
    search keep cumulative outputs, which rank the candidates at the end."""
    from jpaged import RequestOutputKind
    from serving import protocol

    for stream in (True, False):
        params = protocol.sampling_params({"n": 2, "temperature": 1}, max_tokens=4, logprobs=1, best_of=None,
                                          stream=stream)
        assert params.output_kind is RequestOutputKind.DELTA
    for body, best_of in (({"n": 1, "temperature": 1}, 3), ({"use_beam_search": True, "n": 2, "temperature": 0}, None)):
        params = protocol.sampling_params(body, max_tokens=4, logprobs=None, best_of=best_of, stream=False)
        assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_health_models_auth(server):
    assert run(get(server.url, "/health", headers={}))[0] == 200  # no key needed for health
    status, text = run(get(server.url, "/v1/models"))
    assert status == 200
    model = json.loads(text)["data"][0]
    assert model["id"] == "tiny" and model["max_model_len"] == MAX_MODEL_LEN
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, text = run(get(server.url, "/v1/models", headers=headers))
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    # /kv follows --api-key too: the bearer key, or HTTP Basic with the key as password (what a
    # browser sends on each reload once asked by WWW-Authenticate); nothing without it.
    basic = {"Authorization": "Basic " + base64.b64encode(f"anyone:{API_KEY}".encode()).decode()}
    for headers in (AUTH, basic):
        status, text = run(get(server.url, "/kv", headers=headers))
        assert status == 200 and "KV cache of tiny" in text, text[:200]
    wrong = {"Authorization": "Basic " + base64.b64encode(b"anyone:wrong").decode()}

    async def kv(headers):
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/kv", headers=headers) as r:
                return r.status, r.headers.get("WWW-Authenticate", ""), await r.json()

    for headers in ({}, {"Authorization": "Bearer wrong"}, wrong, {"Authorization": "Basic %%%"}):
        status, challenge, body = run(kv(headers))
        assert status == 401 and body["error"]["code"] == "invalid_api_key" and challenge.startswith("Basic ")


def test_pooling_endpoints_refused_naming_the_runner(server):
    """A generation server answers the pooling endpoints with a 400 naming the runner to start."""
    for path in ("/v1/embeddings", "/rerank", "/score"):
        status, body = run(post(server.url, path, {"model": "tiny", "input": "hi"}))
        assert status == 400 and "--runner pooling" in body["error"]["message"], body


def test_completions_stream_equals_non_stream(server):
    rng = random.Random()
    prompt = random_prompt(rng)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    status, full = run(post(server.url, "/v1/completions", body))
    assert status == 200, full
    text = full["choices"][0]["text"]
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 40
    events = run(stream_events(server.url, "/v1/completions", body))
    assert "".join(e["choices"][0]["text"] for e in events) == text
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    # A stop string from the middle of the greedy text: cut there in both modes, never leaked in a chunk.
    stop = text[10:13]
    if stop.strip() and len(stop) == 3:
        body = {**body, "stop": [stop]}
        status, cut = run(post(server.url, "/v1/completions", body))
        expected = text[:text.index(stop)]
        assert cut["choices"][0]["text"] == expected and cut["choices"][0]["finish_reason"] == "stop"
        events = run(stream_events(server.url, "/v1/completions", body))
        assert "".join(e["choices"][0]["text"] for e in events) == expected


def test_openai_client_completions_and_chat(client):
    rng = random.Random()
    prompt = random_prompt(rng)
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == chat.choices[0].finish_reason
    model = client.models.retrieve("tiny")  # GET /v1/models/{id}
    assert model.id == "tiny" and model.owned_by == "jpaged"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")
    # Chat logprob `bytes` are each token's own bytes: tiny's byte tokens join into the text's UTF-8.
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True})
    specials = set(tiny_tokenizer().all_special_tokens)  # their text is not in the output
    joined = b"".join(bytes(e.bytes) for e in chat.choices[0].logprobs.content if e.token not in specials)
    expected = joined.decode("utf-8", errors="replace")  # invalid byte runs read U+FFFD, as in the text
    assert chat.choices[0].message.content in (expected, expected.rstrip("\ufffd"))  # a cut last character


def test_chat_template_and_tokenize(server, client):
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    rendered = tokenizer.apply_chat_template([{**m, "content": m["content"] if isinstance(m["content"], str) else
                                               "again"} for m in messages], add_generation_prompt=True, tokenize=False,
                                               chat_template=CHAT_TEMPLATE)
    assert rendered.startswith("[custom template]")
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    status, tok = run(post(server.url, "/tokenize", {"messages": messages}))
    assert status == 200 and tok["tokens"] == expected and tok["count"] == len(expected)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert chat.usage.prompt_tokens == len(expected)
    assert chat.usage.prompt_tokens_details is None  # only with --enable-prompt-tokens-details
    status, tok = run(post(server.url, "/tokenize", {"prompt": "héllo"}))
    assert tok["tokens"] == tokenizer.encode("héllo")
    status, detok = run(post(server.url, "/detokenize", {"tokens": tok["tokens"]}))
    assert status == 200 and detok["prompt"] == "<s>héllo"  # special tokens kept, as tokenizer.decode does


def test_token_id_prompts_and_batches(server, client):
    rng = random.Random()
    prompts = [random_prompt(rng) for _ in range(3)]
    texts = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in prompts]
    ids = [run(post(server.url, "/tokenize", {"prompt": p}))[1]["tokens"] for p in prompts]
    single = client.completions.create(model="tiny", prompt=ids[0], max_tokens=12, temperature=0)
    assert single.choices[0].text == texts[0]
    for batch in (prompts, ids):
        out = client.completions.create(model="tiny", prompt=batch, max_tokens=12, temperature=0)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.text for c in out.choices] == texts
        assert out.usage.prompt_tokens == sum(len(i) for i in ids)
    streamed = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True)
    joined = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            joined[c.index] += c.text
    assert joined == texts


def test_n_samples_seed_logprobs_echo(client):
    prompt = random_prompt(random.Random())
    # ignore_eos: an early EOS would make a choice shorter than 10 tokens (about 1 run in 100).
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=1.0, n=3, seed=1234, logprobs=3,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1
    for c in a.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
        for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            # Top entries are keyed by token text; byte tokens that are not whole characters all read
            # "\ufffd" and collapse into one key, so up to logprobs + 1 (the sampled one) remain.
            assert token_lp <= 0 and 1 <= len(top) <= 4 and token in top
    streamed = client.completions.create(**kwargs, stream=True)
    joined = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            joined[c.index] += c.text
    assert joined == [c.text for c in a.choices]
    echo = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert echo.choices[0].text == prompt + plain.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2, n=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


def test_beam_search(client):
    prompt = random_prompt(random.Random())
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    one = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"use_beam_search": True})
    assert one.choices[0].text == greedy.choices[0].text  # width 1 is greedy
    beams = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, n=3, logprobs=0,
                                      extra_body={"use_beam_search": True, "early_stopping": "never",
                                                  "ignore_eos": True})
    # (Distinct beams can still read the same: tiny's byte tokens that are not whole characters.)
    assert [c.index for c in beams.choices] == [0, 1, 2] and beams.usage.completion_tokens == 3 * 8
    scores = [sum(c.logprobs.token_logprobs) for c in beams.choices]
    assert scores == sorted(scores, reverse=True)  # ranked best first (same lengths: by cumulative logprob)


# ---------------------------------------------------------------------- bad input
LONG = "x" * (MAX_MODEL_LEN + 10)
BAD_REQUESTS = [
    # (path, body or raw bytes, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1, "temperature": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3, "temperature": 1, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "temperature": 0, "stream": True}, 400,
     "stream"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "temperature": 1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "temperature": 0, "early_stopping": "sometimes"},
     400,
     "early_stopping"),
    ("/v1/completions", {"prompt": "hi", "length_penalty": 2}, 400, "length_penalty"),
    ("/v1/completions", {"prompt": "hi", "n": 100, "temperature": 1}, 400, "n"),
    ("/v1/completions", {"prompt": [5, 999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [-1]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400,
     "max_tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/v1/completions", {"prompt": "hi", "suffix": " the end"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a"], "guided_regex": "b"}, 400, "guided_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     400, "guided_json"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                        "function": {"name": "g"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": "f"}, 400, "tools"),
    ("/tokenize", {}, 400, "prompt"),
]


def test_bad_requests_get_openai_errors(server, client):
    async def send_all():
        results = []
        for path, body, _, _ in BAD_REQUESTS:
            if isinstance(body, bytes):
                results.append(await post(server.url, path, data=body, headers={**AUTH, "Content-Type":
                                                                                 "application/json"}))
            else:
                results.append(await post(server.url, path, body))
        return results

    for (path, body, status, param), (got_status, got) in zip(BAD_REQUESTS, run(send_all())):
        assert got_status == status, (path, body, got)
        error = got["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], got
        assert error["param"] == param, (body, error)
    too_long = run(post(server.url, "/v1/completions", {"prompt": LONG}))[1]["error"]["message"]
    assert str(MAX_MODEL_LEN) in too_long and str(len(LONG) + 1 + 16) in too_long  # BOS + text + max_tokens
    # Oversized body: 413 with an OpenAI error object.
    status, got = run(post(server.url, "/v1/completions", {"prompt": "x" * (17 * 2**20)}))
    assert status == 413 and "error" in got
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    # Asking for nothing of an unsupported feature is fine, and unknown non-OpenAI fields are ignored.
    status, got = run(post(server.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {"type": "text"},
        "tools": [], "tool_choice": "none", "logit_bias": {}, "suffix": None, "x_custom_field": 1}))
    assert status == 200, got
    # None of that harmed the server: a good request still works and nothing is left running.
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens >= 1
    m = metrics(server.url)
    assert m["jpaged:num_requests_running"] == 0 and m["jpaged:num_requests_waiting"] == 0


# ---------------------------------------------------------------------- load and disconnects
def test_64_concurrent_streams(server):
    rng = random.Random()
    bodies = [{"prompt": random_prompt(rng, rng.randint(1, 12)), "max_tokens": rng.randint(4, 32),
               "temperature": rng.choice([0, 0.8]), "ignore_eos": True} for _ in range(64)]

    async def all_streams():
        return await asyncio.gather(*(stream_events(server.url, "/v1/completions", b) for b in bodies))

    async def greedy_non_streamed():
        return await asyncio.gather(*(post(server.url, "/v1/completions", b) for b in bodies if b["temperature"] == 0))

    streamed = run(all_streams())
    reference = iter(run(greedy_non_streamed()))
    for body, events in zip(bodies, streamed):
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        if body["temperature"] == 0:
            assert "".join(e["choices"][0]["text"] for e in events) == next(reference)[1]["choices"][0]["text"]
    m = metrics(server.url)
    assert m["jpaged:num_requests_running"] == 0 and m["jpaged:gpu_cache_usage_perc"] == 0
    assert m["jpaged:time_to_first_token_seconds_count"] >= 64


def test_step_phases_in_metrics_and_a_profile_on_request(server, client):
    """Where the steps' time goes, per phase (jpaged/step_clock.py), as counters in /metrics; with
    --profile DIR, POST /start_profile and /stop_profile write a jax.profiler trace under DIR."""
    before = metrics(server.url)
    status, _ = run(post(server.url, "/start_profile"))
    assert status == 200
    assert run(post(server.url, "/start_profile"))[0] == 400  # one at a time
    assert client.completions.create(model="tiny", prompt="hello there", max_tokens=8).usage.completion_tokens == 8
    status, body = run(post(server.url, "/stop_profile"))
    assert status == 200 and os.path.isdir(body["profile_dir"])
    traces = [os.path.join(d, f) for d, _, files in os.walk(body["profile_dir"]) for f in files]
    assert any(t.endswith(".xplane.pb") and os.path.getsize(t) > 0 for t in traces), traces
    assert run(post(server.url, "/stop_profile"))[0] == 400
    assert run(post(server.url, "/start_profile", headers={}))[0] == 401  # behind --api-key
    after = metrics(server.url)
    steps = after["jpaged:engine_steps_total"] - before["jpaged:engine_steps_total"]
    assert steps >= 8  # a prefill and 7 decode steps at least
    phase = 'jpaged:step_phase_seconds_total{model_name="tiny",phase="%s"}'
    for name in ("schedule", "prepare", "launch", "read", "update", "outputs"):
        assert after[phase % name] > before[phase % name], name
    # Its text decides nothing on the engine thread (no stop strings): made on the output thread.
    output_thread = 'jpaged:output_thread_seconds_total{model_name="tiny"}'
    assert after[phase % "detokenize"] == before[phase % "detokenize"]
    assert after[output_thread] > before[output_thread]
    # A stop string is looked for on the engine thread, in the text it detokenizes there.
    client.completions.create(model="tiny", prompt="hello there", max_tokens=8, stop=["\x00\x01"])
    assert metrics(server.url)[phase % "detokenize"] > after[phase % "detokenize"]


def test_profile_routes_need_the_flag():
    from serving.profiling import OpenAIServingProfile
    from serving.protocol import APIError

    with pytest.raises(APIError, match="--profile DIR") as refused:
        OpenAIServingProfile.__new__(OpenAIServingProfile)._check_profiling()
    assert refused.value.status == 404


def _wait_idle(url, timeout=60.0) -> float:
    """Seconds until no request runs and no KV block is in use."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        m = metrics(url)
        if m["jpaged:num_requests_running"] == 0 and m["jpaged:gpu_cache_usage_perc"] == 0:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"requests still running after {timeout}s: {m}")


def _generated(url) -> float:
    return metrics(url)["jpaged:generation_tokens_total"]


def _aborted(url) -> float:
    return metrics(url).get('jpaged:request_success_total{model_name="tiny",finished_reason="abort"}', 0)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_request(server, stream):
    body = {"prompt": f"disconnect {stream}", "max_tokens": MAX_MODEL_LEN - 20, "ignore_eos": True}
    aborted, generated = _aborted(server.url), _generated(server.url)

    async def leave_early():
        async with aiohttp.ClientSession() as session:
            if stream:
                async with session.post(server.url + "/v1/completions", json={**body, "stream": True},
                                        headers=AUTH) as r:
                    await r.content.readline()  # the first event arrived: the request is running
                # leaving the block closes the connection mid-response
            else:  # no byte comes before the end: give up (closing the connection) once tokens are counted
                request = asyncio.create_task(session.post(server.url + "/v1/completions", json=body, headers=AUTH))
                while await asyncio.to_thread(_generated, server.url) == generated:
                    assert not request.done(), "the request ended before it generated a token"
                    await asyncio.sleep(0.01)
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request

    run(leave_early())
    _wait_idle(server.url)
    assert _aborted(server.url) == aborted + 1
    # The request stopped when its client left, not when it ran out of tokens (counted, not timed).
    assert _generated(server.url) - generated < body["max_tokens"] / 2, (generated, _generated(server.url))


# ---------------------------------------------------------------------- queue limit and shutdown
def test_max_queue_and_sigterm():
    # Real warm-up here (no --enforce-eager), on tiny limits so it is quick.
    s = Server("--max-num-seqs", "1", "--max-model-len", "64", "--max-num-batched-tokens", "64", "--max-queue", "1",
               "--no-background-warmup")
    try:
        compiled = metrics(s.url)["jpaged:num_compilations"]
        body = {"prompt": "queue", "max_tokens": 40, "ignore_eos": True}

        async def one(session):
            async with session.post(s.url + "/v1/completions", json=body) as r:
                return r.status, r.headers.get("Retry-After"), await r.json()

        async def burst():
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(one(session) for _ in range(8)))

        answers = run(burst())
        statuses = [status for status, _, _ in answers]
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        assert set(statuses) <= {200, 503}
        for status, retry_after, got in answers:  # a 503 says when to come back, in OpenAI's shape
            assert status == 200 or (int(retry_after) >= 1 and got["error"]["code"] == "queue_full")
        assert metrics(s.url)["jpaged:num_compilations"] == compiled  # warmed up: serving compiled nothing

        async def stream_then_sigterm():
            events = []
            async with aiohttp.ClientSession() as session:
                async with session.post(s.url + "/v1/completions", json={**body, "stream": True}) as r:
                    async for line in r.content:
                        line = line.decode().strip()
                        if line:
                            events.append(line)
                            if len(events) == 2:
                                s.proc.send_signal(signal.SIGTERM)
            return events

        events = run(stream_then_sigterm())
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] in ("abort", "length")
        assert s.proc.wait(60) == 0, "".join(s.log[-30:])
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


# ---------------------------------------------------------------------- the serving benchmark
def test_bench_serving_against_the_server(server, tmp_path):
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_serving.py")
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, script, "--base-url", server.url, "--api-key", API_KEY, "--model", "tiny",
                           "--num-prompts", "12", "--length-scale", "0.05", "--request-rate", "20", "--seed", "5",
                           "--output-json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout and "Median TTFT (ms)" in done.stdout
    result = json.loads(out.read_text())
    sys.path.insert(0, os.path.dirname(script))
    import bench_serving

    expected = bench_serving.make_requests(bench_serving.parse_args(["--num-prompts", "12", "--length-scale", "0.05",
                                                                     "--seed", "5"]))
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == sum(r.output_len for r in expected)  # ignore_eos: exact lengths
    assert result["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"] and result["output_throughput"] > 0


# ---------------------------------------------------------------------- operator features
def test_cors_logprob_limit_and_log_lines(server):
    async def preflight_and_post():
        async with aiohttp.ClientSession() as session:
            async with session.options(server.url + "/v1/completions", headers={
                    "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type"}) as r:
                preflight = r.status, dict(r.headers)
            async with session.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                    headers={**AUTH, "Origin": ORIGIN}) as r:
                allowed = r.headers.get("Access-Control-Allow-Origin")
            async with session.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                    headers={**AUTH, "Origin": "http://evil.example"}) as r:
                other = r.headers.get("Access-Control-Allow-Origin")
        return preflight, allowed, other

    (status, headers), allowed, other = run(preflight_and_post())
    assert status == 204 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert allowed == ORIGIN and other is None
    status, got = run(post(server.url, "/v1/completions", {"prompt": "hi", "logprobs": 6}))
    assert status == 400 and got["error"]["param"] == "logprobs" and "max_logprobs=5" in got["error"]["message"]
    # One access line per request; the periodic stats line (every 10 s) once something ran.
    deadline = time.monotonic() + 15
    while not any("Avg generation throughput" in line for line in server.log):
        assert time.monotonic() < deadline, "".join(server.log[-20:])
        run(post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}))
        time.sleep(1)
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in server.log)
    # ... but none for the probes (/health, /metrics) below --log-level debug (serving/access_log.py).
    assert run(get(server.url, "/health"))[0] == 200 and run(get(server.url, "/metrics"))[0] == 200
    run(post(server.url, "/v1/completions?after-probes", {"prompt": "hi", "max_tokens": 1}))  # logged after them
    deadline = time.monotonic() + 15
    while not any('"POST /v1/completions?after-probes HTTP/1.1" 200' in line for line in server.log):
        assert time.monotonic() < deadline, "".join(server.log[-20:])
        time.sleep(0.1)
    assert not any('"GET /health' in line or '"GET /metrics' in line for line in server.log)


# ---------------------------------------------------------------------- structured output and tools
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
                 "required": ["answer", "sure"], "additionalProperties": False}


def test_structured_output_and_logit_bias(client):
    """response_format, vLLM's guided_* fields and logit_bias through the openai SDK: the output
    follows the grammar (tiny's random weights alone would never write JSON)."""
    messages = [{"role": "user", "content": random_prompt(random.Random())}]
    for response_format in ({"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
                            {"type": "json_object"}):
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=1.0,
                                              seed=random.randrange(2**31), response_format=response_format)
        choice = chat.choices[0]
        if response_format["type"] == "json_schema":
            assert choice.finish_reason == "stop", choice
            value = json.loads(choice.message.content)
            assert value["answer"] in ("yes", "no", "maybe") and isinstance(value["sure"], bool) and len(value) == 2
        else:  # any object; it may run out of tokens, but what is there is the start of one
            assert choice.message.content.startswith("{")
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content), dict)
    choices = ["red", "green", "light blue"]
    out = client.completions.create(model="tiny", prompt="Colour:", max_tokens=10, temperature=1.0, n=3,
                                    extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, temperature=1.0,
                                    extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.choices[0].text), out.choices[0].text
    z = tiny_tokenizer().convert_tokens_to_ids("Z")
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=6, temperature=0, logit_bias={str(z): 100},
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == "Z" * 6


def test_tool_calls(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                 "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=40,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call, = chat.choices[0].message.tool_calls
    assert chat.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    chat = client.chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="required",
                                          max_tokens=80, temperature=0)
    calls = chat.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        json.loads(c.function.arguments)


def streamed_chat(client, **kwargs):
    """A streamed chat through the openai SDK, its deltas added up: (content, [(name, arguments)], finish reason)."""
    content, calls, reason = "", [], None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    assert call.id and call.function.name
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [(name, json.loads(arguments)) for name, arguments in calls], reason


def test_tool_calls_auto_and_streamed(client):
    """tool_choice "auto" (the server runs --tool-call-parser hermes): a completion in Hermes'
    format becomes tool calls, the text before them content; tiny's random weights are made to write
    one by vLLM's guided_regex. Streamed, the deltas add up to the same; and so do streamed
    "required" and named-function calls."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": random_prompt(random.Random())}]
    regex = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n</tool_call>'
    forced = dict(messages=messages, tools=tools, max_tokens=120, temperature=1.0, seed=random.randrange(2**31),
                  extra_body={"guided_regex": regex})
    chat = client.chat.completions.create(model="tiny", **forced)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n", choice
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert streamed_chat(client, **forced) == (choice.message.content, [
        (call.function.name, json.loads(call.function.arguments))], "tool_calls")
    # No call written: plain content, finish reason as usual.
    plain = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "length" and not plain.choices[0].message.tool_calls
    assert streamed_chat(client, messages=messages, tools=tools, max_tokens=8, temperature=0,
                         extra_body={"ignore_eos": True}) == (plain.choices[0].message.content, [], "length")
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(messages=messages, tools=tools, tool_choice=tool_choice, max_tokens=150, temperature=0)
        whole = client.chat.completions.create(model="tiny", **kwargs).choices[0]
        assert whole.finish_reason == "tool_calls", whole
        expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
        assert streamed_chat(client, **kwargs) == ("", expected, "tool_calls")


def test_streamed_echo_logprobs(server):
    """echo + logprobs streamed (max_tokens 0 too): the events add up to the whole response."""
    ids = tiny_tokenizer().encode(random_prompt(random.Random(), 5))
    for max_tokens in (0, 4):
        body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        status, whole = run(post(server.url, "/v1/completions", body))
        assert status == 200, whole
        events = run(stream_events(server.url, "/v1/completions", body))
        streamed = {k: sum((e["choices"][0]["logprobs"][k] for e in events), []) for k in whole["choices"][0]["logprobs"]}
        assert streamed == whole["choices"][0]["logprobs"]
        assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
        assert len(streamed["tokens"]) == len(ids) + max_tokens


def test_langchain_structured_output_and_tools(server):
    """LangChain's ChatOpenAI against the server: with_structured_output (JSON schema and function
    calling) returns a filled model, bind_tools with a required tool returns tool calls."""
    import pydantic
    from langchain_openai import ChatOpenAI

    class Answer(pydantic.BaseModel):
        answer: typing.Literal["yes", "no"]
        sure: bool

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model="tiny", max_tokens=120, temperature=0,
                      max_retries=0)
    for method in ("json_schema", "function_calling"):
        result = chat.with_structured_output(Answer, method=method).invoke("Is the sky blue?")
        assert isinstance(result, Answer), (method, result)

    def get_weather(city: typing.Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return "sunny"

    message = chat.bind_tools([get_weather], tool_choice="required").invoke("Weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")


def test_lm_eval_loglikelihood_requests(server):
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1 or
    0; it sums token_logprobs[ctxlen:-1]) answered with the model's own numbers: HF transformers
    running tiny's weights in float64."""
    import torch
    import transformers as tf

    config = tiny.tiny_config()
    hf = tf.LlamaForCausalLM(config)
    hf.load_state_dict({name: torch.from_numpy(np.asarray(w)) for name, w in tiny.tiny_weights(config)}, strict=False)
    hf = hf.double().eval()
    rng = random.Random()
    tokenizer = tiny_tokenizer()
    context = tokenizer.encode(random_prompt(rng, 6))
    continuation = tokenizer.encode(" " + random_prompt(rng, 2), add_special_tokens=False)
    ids = context + continuation
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
    expected = sum(logprobs[i - 1, ids[i]] for i in range(len(context), len(ids)))
    for max_tokens in (1, 0):
        status, got = run(post(server.url, "/v1/completions", {"model": "tiny", "prompt": ids, "echo": True,
                                                               "logprobs": 1, "max_tokens": max_tokens,
                                                               "temperature": 0}))
        assert status == 200, got
        lp = got["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        ctx = len(context)
        total = sum(lp["token_logprobs"][ctx:len(ids)])
        assert abs(total - expected) < 1e-3 * max(1, abs(expected)), (total, expected)
        for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert max(top.values()) >= token_lp - 1e-6  # is_greedy reads max(top) against the token's
        assert got["usage"]["completion_tokens"] == max_tokens
        assert got["choices"][0]["text"].startswith(tokenizer.decode(ids))
