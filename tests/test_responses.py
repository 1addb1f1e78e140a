"""POST /v1/responses (OpenAI's Responses API) over real HTTP, with the official openai SDK,
LangChain and the openai-agents SDK; GET /version; parallel_tool_calls; the server's start-up
corners (a port in use, --help, abbreviated flags). Prompts are checked against the chat template
rendered here (the token counts), texts against the chat endpoint's greedy text."""

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
from typing import Literal

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import ResponseIncompleteEvent
from test_server import Server
from test_server_robustness import assert_healthy_and_idle, assert_openai_error, strict_json

import jpaged
from jpaged.models.tiny import tiny_tokenizer

SEED = 20261124  # fixed: which seeds make parallel calls is part of what the tool test checks
STORE_SIZE = 4
# get_weather / get_time take one enum argument: a random model's calls stay short and whole.
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                         "required": ["city"], "additionalProperties": False}},
         {"type": "function", "name": "get_time", "description": "The time in a zone",
          "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                         "required": ["tz"], "additionalProperties": False}}]
LOGPROBS = "message.output_text.logprobs"
ENUMS = {"get_weather": ("city", {"Paris", "Rome"}), "get_time": ("tz", {"UTC", "CET"})}


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "16", "--max-model-len", "512", "--enforce-eager", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--responses-store-size", str(STORE_SIZE))
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def prompt_len(messages: list[dict]) -> int:
    """Tokens of `messages` rendered by tiny's chat template, as the server should render them."""
    tokenizer = tiny_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def chat_text(client, messages, max_tokens) -> str:
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                          temperature=0).choices[0].message.content


def check_call(item):
    assert item.type == "function_call" and item.status == "completed", item
    assert item.call_id.startswith("call_") and item.id.startswith("fc_"), item
    key, values = ENUMS[item.name]
    assert json.loads(item.arguments) in [{key: v} for v in values], item


def test_text_response_is_the_chat_completion(client):
    rng = random.Random(SEED)
    words = " ".join(rng.choice(["sun", "rain", "hello", "paged", "blocks"]) for _ in range(6))
    print("seed", SEED, words)
    r = client.responses.create(model="tiny", input=words, instructions="Answer briefly.", max_output_tokens=12,
                                temperature=0)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": words}]
    assert r.output_text == chat_text(client, messages, 12)
    assert r.id.startswith("resp_") and r.object == "response" and isinstance(r.created_at, (int, float))
    assert r.model == "tiny" and r.instructions == "Answer briefly." and r.error is None
    assert r.max_output_tokens == 12 and r.temperature == 0 and r.tools == [] and r.tool_choice == "auto"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.usage.input_tokens == prompt_len(messages)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    if r.usage.output_tokens == 12:  # cut short: the status says so
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert item.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    # Items as lists of parts, developer messages (read as system) and max_output_tokens unset.
    r2 = client.responses.create(model="tiny", temperature=0, max_output_tokens=5, input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
        {"role": "user", "content": [{"type": "input_text", "text": words}]}])
    assert r2.output_text == chat_text(client, messages, 5)
    # No max_output_tokens: the room the context leaves (a few tokens after this long input).
    r3 = client.responses.create(model="tiny", input="x" * 470)
    assert r3.max_output_tokens == 512 - r3.usage.input_tokens == r3.usage.output_tokens


async def _sse(url, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", json={**body, "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            text = await r.text()
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        events.append(strict_json(data[len("data: "):]))
        assert events[-1]["type"] == kind[len("event: "):]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_streamed_events_add_up_to_the_response(server, client):
    """Cut by max_output_tokens (ignore_eos makes sure), the stream ends with response.incomplete
    as OpenAI's does (not response.completed), incomplete_details saying why; the SDK reads it as
    its ResponseIncompleteEvent."""
    sdk = {"model": "tiny", "input": "Tell me a story", "max_output_tokens": 10, "temperature": 0}
    body = {**sdk, "ignore_eos": True}
    whole = client.responses.create(**sdk, extra_body={"ignore_eos": True})
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    events = asyncio.run(_sse(server.url, body))
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], types
    assert events[-1]["response"]["status"] == "incomplete" and events[-2]["item"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    text = "".join(e["delta"] for e in deltas)
    final = events[-1]["response"]
    item = final["output"][0]
    assert text == whole.output_text == item["content"][0]["text"] == events[-4]["text"]
    assert all(e["item_id"] == item["id"] and e["output_index"] == 0 and e["content_index"] == 0
               and e["logprobs"] == [] for e in deltas)
    assert final["usage"] == whole.usage.model_dump(exclude_none=True) and final["status"] == whole.status
    # The SDK parses the events as its own types, the last its ResponseIncompleteEvent.
    streamed = list(client.responses.create(**sdk, stream=True, extra_body={"ignore_eos": True}))
    assert isinstance(streamed[-1], ResponseIncompleteEvent) and streamed[-1].response.output_text == text
    assert [type(e).__name__ for e in streamed].count("ResponseCompletedEvent") == 0
    # A response that ends by itself still ends with response.completed, which the stream helper reads.
    eos = tiny_tokenizer().eos_token_id
    with client.responses.stream(**sdk, extra_body={"logit_bias": {str(eos): 100}}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "" and final.incomplete_details is None


def test_an_empty_answer_is_still_a_message(server, client):
    """An end-of-sequence as the first token (forced by logit_bias): one message item with empty
    text, whole and streamed, and that token's logprob reported."""
    eos = tiny_tokenizer().eos_token_id
    body = {"model": "tiny", "input": "Say nothing", "max_output_tokens": 5, "include": [LOGPROBS]}
    r = client.responses.create(**body, extra_body={"logit_bias": {str(eos): 100}})
    [item] = r.output
    assert item.type == "message" and item.status == "completed" and r.status == "completed"
    assert r.output_text == "" and r.usage.output_tokens == 1
    [logprob] = item.content[0].logprobs
    assert logprob.logprob > -1e-3  # the bias makes it all but certain
    events = asyncio.run(_sse(server.url, {**body, "logit_bias": {str(eos): 100}}))
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "" and final["output"][0]["content"][0]["logprobs"] \
        == [logprob.model_dump()]
    assert [e["type"] for e in events][2:4] == ["response.output_item.added", "response.content_part.added"]


def test_previous_response_id_store_and_its_bound(client):
    first = client.responses.create(model="tiny", input="Hello there", instructions="Be terse.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model="tiny", input="And again", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # The conversation goes on without the first request's instructions (OpenAI's rule).
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And again"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_len(history)
    assert second.output_text == chat_text(client, history, 6)
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError):  # nothing runs in the background to cancel
        client.responses.cancel(second.id)
    unstored = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=1)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    later = [client.responses.create(model="tiny", input=f"n{i}", max_output_tokens=1).id for i in range(STORE_SIZE)]
    with pytest.raises(openai.NotFoundError):  # the oldest went first
        client.responses.retrieve(second.id)
    assert [client.responses.retrieve(i).id for i in later] == later


def test_tools_parallel_calls_and_round_trip(server, client):
    named = client.responses.create(model="tiny", input="weather?", tools=TOOLS, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_time"})
    [call] = named.output
    check_call(call)
    assert call.name == "get_time" and named.status == "completed"
    assert named.tool_choice.name == "get_time" and [t.name for t in named.tools] == ["get_weather", "get_time"]
    # Stored: the next turn continues after the call.
    after = client.responses.create(model="tiny", previous_response_id=named.id, max_output_tokens=4, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    call_message = {"role": "assistant", "content": "", "tool_calls": [{
        "id": call.call_id, "type": "function",
        "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]}
    assert after.usage.input_tokens == prompt_len([
        {"role": "user", "content": "weather?"}, call_message,
        {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "12:00"}])
    counts = {True: [], False: []}
    for parallel in (True, False):
        for seed in range(SEED, SEED + 12):
            r = client.responses.create(model="tiny", input="weather and time?", tools=TOOLS, tool_choice="required",
                                        max_output_tokens=200, temperature=1.0, parallel_tool_calls=parallel,
                                        extra_body={"seed": seed})
            assert r.status == "completed" and r.parallel_tool_calls is parallel
            for item in r.output:
                check_call(item)
            counts[parallel].append(len(r.output))
    print("calls per response", counts)
    assert min(counts[True]) >= 1 and max(counts[True]) > 1  # the model does make parallel calls ...
    assert counts[False] == [1] * 12  # ... and parallel_tool_calls false keeps one
    # The chat endpoint honours it too.
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    for seed in range(SEED, SEED + 12):
        c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather and time?"}],
                                           tools=chat_tools, tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=200, temperature=1.0, seed=seed)
        assert len(c.choices[0].message.tool_calls) == 1
    # A tool round trip: the call and its output come back as the input of the next turn.
    items = [{"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "22C and sunny"}]
    follow = client.responses.create(model="tiny", input=items, tools=TOOLS, tool_choice="auto",
                                     max_output_tokens=8, temperature=0)
    expected = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
                {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "22C and sunny"}]
    assert follow.usage.input_tokens == prompt_len(expected)
    assert all(item.type == "message" for item in follow.output)  # tiny writes no <tool_call> blocks
    # tiny's template never renders tools: said once in the log.
    assert sum("does not render 'tools'" in line for line in server.log) == 1, "".join(server.log[-20:])


def test_streamed_function_call(server):
    events = asyncio.run(_sse(server.url, {"model": "tiny", "input": "weather?", "tools": TOOLS,
                                           "tool_choice": "required", "max_output_tokens": 200,
                                           "parallel_tool_calls": False}))
    types = [e["type"] for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert len(added) == 1 and added[0]["item"]["type"] == "function_call"
    item_id = added[0]["item"]["id"]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                        and e["item_id"] == item_id)
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    final = events[-1]["response"]["output"]
    assert done["arguments"] == arguments == final[0]["arguments"] and done["name"] == final[0]["name"]
    assert final[0]["id"] == item_id and final[0]["status"] == "completed"


def test_output_text_logprobs_are_the_chat_logprobs(server, client):
    """include message.output_text.logprobs with top_logprobs: the output_text part's logprobs
    are chat's logprobs.content for the same messages, whole and streamed (the deltas' lists add
    up to the part's); top_logprobs alone asks for none (vLLM's rule)."""
    body = {"model": "tiny", "input": "Count with me", "max_output_tokens": 10, "temperature": 0}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": body["input"]}],
                                          max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    expected = [e.model_dump() for e in chat.choices[0].logprobs.content]
    r = client.responses.create(**body, include=[LOGPROBS, "reasoning.encrypted_content"], top_logprobs=3)
    part = r.output[0].content[0]
    assert r.output_text == chat.choices[0].message.content and r.top_logprobs == 3
    assert [lp.model_dump() for lp in part.logprobs] == expected
    assert len(expected) == r.usage.output_tokens and all(len(e["top_logprobs"]) == 3 for e in expected)
    events = asyncio.run(_sse(server.url, {**body, "include": [LOGPROBS], "top_logprobs": 3}))
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    final_part = events[-1]["response"]["output"][0]["content"][0]
    assert deltas == done["logprobs"] == final_part["logprobs"] == expected
    plain = client.responses.create(**body, top_logprobs=3)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 3


def test_truncation_auto_drops_the_oldest_turns(server, client):
    """A conversation longer than the context (512): 'disabled' is a 400, 'auto' drops the
    fewest oldest turns that make it fit (a function call with its output as one turn; the
    developer message and the last turn stay), found here by trying each count in turn."""
    rng = random.Random(SEED + 2)
    print("seed", SEED + 2)

    def words(n):
        return " ".join(rng.choice(["sun", "rain", "hello", "paged", "blocks"]) for _ in range(n))

    # (Responses items, the chat messages they mean) per turn; the developer message first.
    system = ({"role": "developer", "content": "Be brief."}, {"role": "system", "content": "Be brief."})
    turns = [[({"role": "user", "content": "time?"}, {"role": "user", "content": "time?"})],
             [({"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"tz": "UTC"}'},
               {"role": "assistant", "content": ""}),
              ({"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
               {"role": "tool", "content": "12:00"})]]
    for i in range(14):
        text = words(rng.randint(6, 12))
        role = "user" if i % 2 == 0 else "assistant"
        turns.append([({"role": role, "content": text}, {"role": role, "content": text})])
    items = [system[0]] + [item for turn in turns for item, _ in turn]
    body = {"model": "tiny", "input": items, "max_output_tokens": 8, "temperature": 0}
    status, got = asyncio.run(_post(server.url, body))
    assert_openai_error(status, got, 400, "input")
    assert "context length" in got["error"]["message"]
    for k in range(len(turns)):  # the fewest dropped turns that fit
        messages = [system[1]] + [m for turn in turns[k:] for _, m in turn]
        if prompt_len(messages) + 8 <= 512:
            break
    assert 1 <= k < len(turns) - 1, k  # the test needs some turns dropped, not all
    r = client.responses.create(**body, truncation="auto")
    assert r.truncation == "auto" and r.usage.input_tokens == prompt_len(messages), k
    # Stored truncated: the next turn continues from what the model saw.
    follow = client.responses.create(model="tiny", input="more", previous_response_id=r.id, max_output_tokens=4,
                                     truncation="auto")
    assert follow.usage.input_tokens <= 512 - 4
    # One message longer than the context is too long whatever is dropped.
    status, got = asyncio.run(_post(server.url, {"model": "tiny", "input": "x" * 600, "truncation": "auto"}))
    assert_openai_error(status, got, 400, "input")


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["answer", "n"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="yes or no?", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "reply", "schema": schema,
                                                 "strict": True}})
    reply = json.loads(r.output_text)
    assert reply["answer"] in ("yes", "no") and 0 <= reply["n"] <= 9 and set(reply) == {"answer", "n"}
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs", "everything"]}, "include[1]"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"include": [LOGPROBS], "tools": TOOLS, "tool_choice": "required"}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"),
    ({"tool_choice": {"type": "function"}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "input"),
    ({"temperature": -1}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"model": "other"}, "model"),
])
def test_bad_requests_name_the_field(server, body, param):
    status, got = asyncio.run(_post(server.url, {"model": "tiny", "input": "hi", **body}))
    assert_openai_error(status, got, 404 if param == "model" else 400, param)


TEXT = st.text(max_size=12)
ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                           "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"]),
                                "text": TEXT}), max_size=2), st.none(), st.integers())},
                          optional={"type": st.sampled_from(["message", "reasoning", "item_reference", "x"])}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": st.one_of(TEXT, st.integers()), "name": TEXT, "arguments": st.one_of(TEXT, st.just('{"a": [1]}'))}),
    st.fixed_dictionaries({"type": st.just("function_call_output")}, optional={
        "call_id": TEXT, "output": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("input_text"),
                                                                                   "text": TEXT}), max_size=2))}),
    st.integers(), st.none(), TEXT)
ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 600), st.floats(-2, 3), TEXT,
                st.lists(st.integers(), max_size=2), st.dictionaries(TEXT, st.integers(), max_size=2))
FIELDS = {
    "instructions": st.one_of(TEXT, ANY), "max_output_tokens": st.one_of(st.integers(1, 8), ANY),
    "temperature": st.one_of(st.floats(0, 2), ANY), "top_p": st.one_of(st.floats(0.01, 1), ANY),
    "tools": st.one_of(st.just(TOOLS), st.lists(st.dictionaries(st.sampled_from(["type", "name", "parameters"]),
                                                                ANY, max_size=3), max_size=2), ANY),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function", "name": "get_time"},
                                              {"type": "function", "name": "x"}, {"type": "mcp"}]), ANY),
    "parallel_tool_calls": st.one_of(st.booleans(), ANY),
    "text": st.one_of(st.fixed_dictionaries({"format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "name": "x", "schema": {"enum": ["a", "b"]}},
        {"type": "json_schema"}, {"type": "yaml"}, None, 3])}), ANY),
    "stream": st.booleans(), "store": st.one_of(st.booleans(), ANY),
    "previous_response_id": st.one_of(st.just("resp_none"), ANY), "metadata": ANY,
    "truncation": st.one_of(st.sampled_from(["auto", "disabled"]), ANY),
    "reasoning": ANY, "include": ANY, "user": ANY, "seed": ANY, "top_k": ANY,
}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({"input": st.one_of(TEXT, st.lists(ITEM, max_size=4), ANY)},
                                  optional={k: v for k, v in FIELDS.items()}))
def test_fuzz_responses_never_fail_the_server(server, body):
    """Random and hostile Responses bodies: a 200 (a response, or events ending in
    response.completed) or a 4xx in OpenAI's shape, never a 5xx."""
    body = {"model": "tiny", "max_output_tokens": 4, **body}
    if body.get("stream") is True:
        async def stream():
            async with aiohttp.ClientSession() as session:
                async with session.post(server.url + "/v1/responses", json=body) as r:
                    return r.status, await r.text()
        status, text = asyncio.run(stream())
        if status == 200:
            last = strict_json(text.strip().split("\n\n")[-1].split("\n")[1][len("data: "):])
            assert last["type"] in ("response.completed", "response.incomplete", "error"), text[-500:]
            assert (last["type"] == "response.incomplete") == (last.get("response", {}).get("status") == "incomplete")
            return
        got = strict_json(text)
    else:
        status, got = asyncio.run(_post(server.url, body))
    assert status < 500, (status, got, body)
    if status != 200:
        assert_openai_error(status, got, status)
    else:
        assert got["object"] == "response" and got["status"] in ("completed", "incomplete"), got


async def _post(url, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", json=body) as r:
            return r.status, await r.json()


def test_version_and_idle_after(server):
    async def get():
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/version") as r:
                return r.status, await r.json()
    assert asyncio.run(get()) == (200, {"version": jpaged.__version__})
    assert_healthy_and_idle(server.url)
    # A plain CPU start says nothing about TPUs or PyTorch.
    log = "".join(server.log)
    assert "libtpu" not in log and "PyTorch was not found" not in log, log[:2000]


def test_langchain_responses_api(server, client):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="unused", use_responses_api=True,
                     max_tokens=8, temperature=0, max_retries=0)
    message = llm.invoke([SystemMessage("Be terse."), HumanMessage("hello")])
    expected = chat_text(client, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello"}], 8)
    assert message.text == expected and 1 <= message.usage_metadata["output_tokens"] <= 8
    assert "".join(chunk.text for chunk in llm.stream([SystemMessage("Be terse."), HumanMessage("hello")])) == expected
    caller = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="unused", use_responses_api=True,
                        max_tokens=100, max_retries=0)
    call = caller.bind_tools([get_weather], tool_choice="get_weather").invoke("weather?")
    [tool_call] = call.tool_calls
    assert tool_call["name"] == "get_weather" and tool_call["args"]["city"] in ("Paris", "Rome")


def test_openai_agents_sdk(server):
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    agents.set_tracing_disabled(True)  # no export to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    class Answer(BaseModel):
        city: Literal["Paris", "Rome"]
        sunny: bool

    model = agents.OpenAIResponsesModel("tiny", client)
    structured = agents.Agent(name="structured", instructions="Answer.", output_type=Answer, model=model,
                              model_settings=agents.ModelSettings(max_tokens=100, temperature=0))
    tool_user = agents.Agent(name="tools", model=model, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                 max_tokens=100))

    async def run():
        answer = (await agents.Runner.run(structured, "Weather in Rome?")).final_output
        streamed = agents.Runner.run_streamed(structured, "Weather in Rome?")
        async for _ in streamed.stream_events():
            pass
        tool_output = (await agents.Runner.run(tool_user, "Weather?")).final_output
        return answer, streamed.final_output, tool_output

    answer, streamed_answer, tool_output = asyncio.run(run())
    assert isinstance(answer, Answer) and answer == streamed_answer
    assert len(calls) == 1 and tool_output == f"sunny in {calls[0]}"


# ---------------------------------------------------------------------- the command line's corners
def test_port_in_use_is_a_one_line_error_before_the_warm_up(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--model", "tiny", "--port", str(port)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "JAX_PLATFORMS": "cpu", "JPAGED_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
    assert "Compiling" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_help_says_each_default_once_and_abbreviations_are_refused(capsys):
    from serving.cli import build_parser, main

    parser = build_parser()
    for command in ("serve", "generate"):
        sub = parser._subparsers._group_actions[0].choices[command]
        formatter = sub._get_formatter()
        for action in sub._actions:
            text = formatter._expand_help(action) if action.help else ""
            assert text.count("(default") <= 1, (command, action.option_strings, text)
            if action.default not in (None, False, "==SUPPRESS==") and action.option_strings:
                assert "default" in text, (command, action.option_strings, text)
    # transformers' "PyTorch was not found" advice is silenced by main() before transformers loads:
    # the command line must not load it on import.
    loaded = subprocess.run([sys.executable, "-c", "import sys, serving.cli; print('transformers' in sys.modules)"],
                            capture_output=True, text=True, timeout=120)
    assert loaded.stdout.strip() == "False", loaded.stderr[-2000:]
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-num-seq", "4"])
    assert e.value.code == 2 and "unrecognized arguments: --max-num-seq" in capsys.readouterr().err
