"""The Responses API's bounds (issues 38, 39): the store bounded by bytes as well as by count,
`metadata` held to OpenAI's limits (Responses and chat), `truncation: "auto"` at any conversation
length, and tool calls cut by max_tokens or repeated without end: never a partial call as content,
at most max_tool_calls calls. Over real HTTP with the openai SDK."""

import asyncio
import json
import random

import aiohttp
import openai
import pytest
from test_responses import ENUMS, TOOLS, check_call, prompt_len
from test_server import Server
from test_server_robustness import assert_openai_error

from serving.responses_store import ResponseStore, stored_bytes
from serving.tool_calls import MAX_TOOL_CALLS

SEED = 20261125
STORE_BYTES = 12_000  # a few small responses
MAX_MODEL_LEN = 512
COMMA = 44  # tiny's byte-level token for ","
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
               "--responses-store-bytes", str(STORE_BYTES))
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def _post(url, path, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as r:
            return r.status, await r.json()


def test_store_accounts_bytes_and_drops_the_oldest():
    rng = random.Random(SEED)
    sizes, store = {}, ResponseStore(size=100, max_bytes=5_000)
    for i in range(40):
        response, history = {"id": f"resp_{i}"}, [{"role": "user", "content": "x" * rng.randint(0, 1_500)}]
        sizes[response["id"]] = stored_bytes(response, history)
        store.put(response, history)
        kept = [f"resp_{j}" for j in range(i + 1) if f"resp_{j}" in store._items]
        assert kept == [f"resp_{j}" for j in range(i + 1 - len(kept), i + 1)]  # the newest, in order
        assert store.bytes == sum(sizes[k] for k in kept) <= 5_000
        assert store.bytes + sizes[f"resp_{i - len(kept)}"] > 5_000 if len(kept) <= i else True  # none dropped early
    store.pop(kept[-1])
    assert store.bytes == sum(sizes[k] for k in kept[:-1])
    store.put({"id": "huge"}, [{"content": "x" * 6_000}])  # larger than the whole bound: not kept, none dropped
    assert "huge" not in store._items and len(store) == len(kept) - 1
    assert not ResponseStore(10, 0).enabled and not ResponseStore(0, 10).enabled


def test_store_bounded_by_bytes_over_http(server, client):
    """--responses-store-bytes: responses go, oldest first, once their bytes pass the bound, long
    before the count bound (1000); what is kept stays retrievable."""
    ids = []
    for i in range(16):
        r = client.responses.create(model="tiny", input=f"hello {i} " * 40, max_output_tokens=8, temperature=0)
        assert r.store is True
        ids.append(r.id)
    kept = []
    for response_id in ids:
        try:
            kept.append(client.responses.retrieve(response_id))
        except openai.NotFoundError:
            assert not kept, "a newer response was dropped before an older one"
    assert 1 <= len(kept) < len(ids) and kept[-1].id == ids[-1]
    assert sum(len(r.model_dump_json()) for r in kept) <= STORE_BYTES


BAD_METADATA = [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, {"k": None},
                ["k", "v"], "k=v", {"k": {"nested": "v"}}]


@pytest.mark.parametrize("metadata", BAD_METADATA)
def test_metadata_beyond_openai_limits_is_a_400(server, metadata):
    """OpenAI's limits: 16 pairs, keys of 64 characters, string values of 512 (the 4 MB metadata
    of 400 stored responses took the server from 603 to 2,151 MB); chat completions too."""
    for path, body in (("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                 "store": True})):
        status, got = asyncio.run(_post(server.url, path, {"model": "tiny", **body, "metadata": metadata}))
        assert_openai_error(status, got, 400, "metadata")


def test_metadata_at_openai_limits_is_kept(client):
    metadata = {"k" * 62 + f"{i:02d}": "v" * 512 for i in range(16)}
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=1, metadata=metadata)
    assert r.metadata == metadata and client.responses.retrieve(r.id).metadata == metadata
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          metadata=metadata)
    assert chat.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("num_messages", [600, 5_000])
def test_truncation_auto_at_any_conversation_length(server, client, num_messages):
    """More messages than the context has tokens (each is at least one): 'auto' drops the oldest
    turns until the rest fits, where it was a 400 beyond 512 messages; 'disabled' is a 400."""
    rng = random.Random(SEED + num_messages)
    words = ["sun", "rain", "hello", "paged", "blocks"]
    items = [{"role": "developer", "content": "Be brief."}]
    items += [{"role": "user" if i % 2 == 0 else "assistant", "content": rng.choice(words)}
              for i in range(num_messages)]
    status, got = asyncio.run(_post(server.url, "/v1/responses", {"model": "tiny", "input": items,
                                                                   "max_output_tokens": 4}))
    assert_openai_error(status, got, 400, "input")
    r = client.responses.create(model="tiny", input=items, max_output_tokens=4, truncation="auto", temperature=0)
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    system = [{"role": "system", "content": "Be brief."}]
    rest = items[1:]

    def fits(k):  # dropping the k oldest messages (each its own turn)
        return prompt_len(system + rest[k:]) + 4 <= MAX_MODEL_LEN

    lo, hi = 0, len(rest) - 1  # the fewest dropped that fit, by bisection as the server does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    assert not fits(lo) and fits(hi)
    assert r.usage.input_tokens == prompt_len(system + rest[hi:])


def _calls_whole(output) -> list:
    """The function calls of a Responses output; its message items (if any) hold no text."""
    for item in output:
        if item.type == "message":
            assert item.content[0].text == "", f"a partial call leaked as text: {item}"
        else:
            check_call(item)
    return [item for item in output if item.type == "function_call"]


def test_required_calls_cut_short_are_dropped_not_content(client):
    """tool_choice 'required' cut by max_tokens inside a call: the whole calls before it and
    finish_reason 'length' (chat) / status incomplete (Responses), never the unfinished call as
    content or a message item (it was `content='{"name":"'` beside 4 calls)."""
    rng = random.Random(SEED)
    cuts = 0
    for _ in range(10):
        seed, max_tokens = rng.randrange(2**31), rng.randint(5, 90)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "weather and time?"}], tools=CHAT_TOOLS,
            tool_choice="required", max_tokens=max_tokens, temperature=1.0, seed=seed, logit_bias={str(COMMA): 5})
        choice = chat.choices[0]
        assert not choice.message.content, (seed, max_tokens, choice.message)
        for call in choice.message.tool_calls or []:
            key, values = ENUMS[call.function.name]
            assert json.loads(call.function.arguments)[key] in values
        r = client.responses.create(model="tiny", input="weather and time?", tools=TOOLS, tool_choice="required",
                                    max_output_tokens=max_tokens, temperature=1.0,
                                    extra_body={"seed": seed, "logit_bias": {str(COMMA): 5}})
        _calls_whole(r.output)
        assert (r.status == "incomplete") == (choice.finish_reason == "length"), (r.status, choice.finish_reason)
        if choice.finish_reason == "length":
            cuts += 1
            assert r.incomplete_details.reason == "max_output_tokens"
        else:
            assert choice.finish_reason == "tool_calls" and r.status == "completed"
    assert cuts >= 3  # the test needs calls cut short
    named = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "time?"}],
                                           tools=CHAT_TOOLS, tool_choice={"type": "function",
                                                                          "function": {"name": "get_time"}},
                                           max_tokens=3)
    assert named.choices[0].finish_reason == "length" and not named.choices[0].message.content
    assert not named.choices[0].message.tool_calls


def test_max_tool_calls_bounds_parallel_calls(client):
    """A model that would go on calling (here: a bias towards ',', which continues the array) stops
    at max_tool_calls calls, MAX_TOOL_CALLS by default, and its response completes, where it ran
    until max_output_tokens and ended incomplete; Responses echoes max_tool_calls."""
    for max_calls in (None, 1, 3):
        extra = {} if max_calls is None else {"max_tool_calls": max_calls}
        r = client.responses.create(model="tiny", input="weather and time?", tools=TOOLS, tool_choice="required",
                                    max_output_tokens=400, temperature=0, **extra,
                                    extra_body={"logit_bias": {str(COMMA): 100}})
        calls = _calls_whole(r.output)
        assert r.status == "completed" and len(calls) == (max_calls or MAX_TOOL_CALLS), (r.status, len(calls))
        assert r.max_tool_calls == max_calls
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                          tools=CHAT_TOOLS, tool_choice="required", max_tokens=400, temperature=0,
                                          logit_bias={str(COMMA): 100})
    assert chat.choices[0].finish_reason == "tool_calls"
    assert len(chat.choices[0].message.tool_calls) == MAX_TOOL_CALLS


@pytest.mark.parametrize("value", [0, -1, 10**6, "3", 1.5])
def test_bad_max_tool_calls_is_a_400(server, value):
    status, got = asyncio.run(_post(server.url, "/v1/responses", {
        "model": "tiny", "input": "hi", "tools": TOOLS, "tool_choice": "required", "max_tool_calls": value}))
    assert_openai_error(status, got, 400, "max_tool_calls")


def test_openai_agents_runner_with_parallel_calls(server):
    """openai-agents' Runner raises on an incomplete response: with parallel calls allowed and a
    model that keeps calling (the ',' bias), the bound ends the array, so the run completes,
    whole and streamed (it ran to max_tokens and failed with response.incomplete)."""
    agents = pytest.importorskip("agents")
    from typing import Literal

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel("tiny", openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                                                  max_retries=0))
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=True, temperature=0,
                                    extra_body={"logit_bias": {str(COMMA): 100}})
    agent = agents.Agent(name="tools", model=model, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                         model_settings=settings)

    async def run():
        whole = await agents.Runner.run(agent, "Weather in Rome?")
        streamed = agents.Runner.run_streamed(agent, "Weather in Rome?")
        async for _ in streamed.stream_events():
            pass
        return whole.final_output, streamed.final_output

    whole, streamed = asyncio.run(run())
    assert len(calls) == 2 * MAX_TOOL_CALLS and whole == streamed == f"sunny in {calls[0]}"
