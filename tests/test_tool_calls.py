"""Tool calling's text split (serving/tool_calls.py): random calls written in each format must come
back as the same calls, whole or streamed in random pieces, and text that is not a call must come
back as content, nothing lost."""

import json
import random
import string

import pytest

from serving.protocol import MAX_JSON_DEPTH, APIError
from serving.tool_calls import MAX_TOOL_CALLS, StreamedCalls, ToolCalling, message, parse_tools

SEED = 20261125

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def random_calls(rng, n):
    def value():
        return rng.choice([rng.randint(-99, 99), rng.random() < 0.5, "".join(rng.choices(string.printable, k=6)),
                           [rng.randint(0, 9)], {"x": "y <tool_call>"}])
    return [("".join(rng.choices(string.ascii_lowercase + "_", k=rng.randint(1, 10))),
             {"".join(rng.choices(string.ascii_lowercase, k=4)): value() for _ in range(rng.randint(0, 3))})
            for _ in range(n)]


def random_content(rng):
    return "".join(rng.choices(string.ascii_letters + " .,<>{}\n", k=rng.randint(0, 30))).replace("<tool", "<tool ")


def write(calls, parser):
    if parser == "hermes":
        return "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in calls)
    if parser == "llama3_json":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return json.dumps([{"name": n, "parameters": a} for n, a in calls])  # "required"


def stream(text, tools, rng, finish_reason="stop"):
    """The text fed in random pieces: the content and calls the deltas add up to, and the last finish reason."""
    streamed, content, calls = StreamedCalls(tools), "", []
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
    for i, piece in enumerate(pieces):
        delta, reason = streamed.delta(piece, finish_reason if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls.append([call["function"]["name"], ""])
            calls[call["index"]][1] += call["function"]["arguments"]
    return content, [(n, json.loads(a)) for n, a in calls], reason


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json", None])
def test_calls_come_back_whole_and_streamed(parser, parallel):
    """Every call written comes back; with parallel_tool_calls false, the first only (the rest is
    dropped, not sent as content)."""
    rng = random.Random()
    tools = ToolCalling(None, parser=parser, parallel=parallel) if parser else \
        ToolCalling({"type": "array"}, parallel=parallel)
    for _ in range(30):
        calls = random_calls(rng, rng.randint(1, 3))
        expected = calls if parallel else calls[:1]
        content = random_content(rng) if parser == "hermes" else ""
        text = content + write(calls, parser)
        msg, reason = message(text, tools, "stop")
        assert reason == "tool_calls" and (msg["content"] or "") == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == expected
        assert len({c["id"] for c in msg["tool_calls"]}) == len(expected)
        assert stream(text, tools, rng) == (content, expected, "tool_calls")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_text_that_is_not_a_call_is_content(parser):
    rng = random.Random()
    tools = ToolCalling(None, parser=parser)
    cut_short = '<tool_call>{"name": "f", "argu' if parser == "hermes" else '{"name": "f", "param'
    for _ in range(30):
        text = random_content(rng).lstrip("{<")
        for candidate in (text, text + cut_short if parser == "hermes" else cut_short):
            msg, reason = message(candidate, tools, "length")
            assert msg == {"role": "assistant", "content": candidate} and reason == "length"
            assert stream(candidate, tools, rng, "length") == (candidate, [], "length")
    text = write([("f", {"a": 1})], parser) + " and then some text"  # after the calls: kept
    msg, _ = message(text, tools, "stop")
    assert msg["content"].endswith("and then some text") and msg["tool_calls"][0]["function"]["name"] == "f"


def test_hermes_holds_back_a_tag_being_written():
    tools = ToolCalling(None, parser="hermes")
    streamed = StreamedCalls(tools)
    assert streamed.delta("Let me look.<tool", None) == ({"content": "Let me look."}, None)
    assert streamed.delta("_ca", None) == ({}, None)
    delta, reason = streamed.delta('ll>{"name": "f", "arguments": {"a": 1}}</tool_call>', "stop")
    assert reason == "tool_calls" and delta["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    streamed = StreamedCalls(tools)  # a "<" that turns out not to be a tag is sent
    assert streamed.delta("a <", None) == ({"content": "a "}, None)
    assert streamed.delta("b", None) == ({"content": "<b"}, None)


def test_named_function_streams_its_arguments():
    rng = random.Random()
    for _ in range(10):
        (name, arguments), = random_calls(rng, 1)
        tools = ToolCalling({"type": "object"}, function=name)
        assert stream(json.dumps(arguments), tools, rng) == ("", [(name, arguments)], "tool_calls")
        msg, reason = message(json.dumps(arguments)[:-1], tools, "length")  # cut short: no call, no content
        assert msg == {"role": "assistant", "content": ""} and reason == "length"


def test_required_cut_short_drops_the_unfinished_call():
    """tool_choice "required" cut by max_tokens inside a call: the whole calls before it, never
    the unfinished one as content (it was `content='{"name":"'` beside the calls), whole or
    streamed, and finish_reason "length"."""
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    tools = ToolCalling({"type": "array"})
    for _ in range(30):
        calls = random_calls(rng, rng.randint(1, 4))
        text = write(calls, None)
        cut = text[:rng.randint(1, len(text) - 1)]  # a cut anywhere before the closing "]"
        ends = [1 + sum(len(json.dumps({"name": n, "parameters": a})) + 2 for n, a in calls[:i + 1]) - 2
                for i in range(len(calls))]  # where each element of '[c1, c2, ...]' ends
        whole = [call for call, end in zip(calls, ends) if end <= len(cut)]
        msg, reason = message(cut, tools, "length")
        assert reason == "length" and not msg["content"], (cut, msg)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in msg.get("tool_calls", [])] == whole, cut
        assert stream(cut, tools, rng, "length") == ("", whole, "length")


def test_max_tool_calls_bounds_the_calls():
    """The grammar of "required" takes at most max_tool_calls elements (MAX_TOOL_CALLS by default,
    one without parallel calls), so a model cannot repeat calls until max_tokens; a parser reads
    no more than that many either."""
    body = {"tools": TOOLS, "tool_choice": "required"}
    assert parse_tools(body, None).schema["maxItems"] == MAX_TOOL_CALLS
    assert parse_tools({**body, "max_tool_calls": 3}, None).schema["maxItems"] == 3
    assert parse_tools({**body, "max_tool_calls": 3, "parallel_tool_calls": False}, None).schema["maxItems"] == 1
    for bad in (0, -1, 10**6, "3", 2.5, True):
        with pytest.raises(APIError) as e:
            parse_tools({**body, "max_tool_calls": bad}, None)
        assert e.value.status == 400 and e.value.param == "max_tool_calls"
    rng = random.Random(SEED)
    calls = random_calls(rng, 5)
    for parser in ("hermes", "llama3_json"):
        tools = parse_tools({"tools": TOOLS, "max_tool_calls": 2}, parser)
        msg, reason = message(write(calls, parser), tools, "stop")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
            calls[:2] and reason == "tool_calls" and not msg["content"]


def test_parse_tools_choices():
    body = {"tools": TOOLS}
    with pytest.raises(APIError) as e:  # "auto" (the default with tools) needs a parser, as in vLLM
        parse_tools(body, None)
    assert e.value.param == "tool_choice" and "--tool-call-parser" in str(e.value)
    assert parse_tools(body, "hermes") == ToolCalling(None, parser="hermes")
    assert parse_tools({**body, "tool_choice": "none"}, None) is None
    assert parse_tools({**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                       None).function == "get_weather"
    assert parse_tools({**body, "tool_choice": "required"}, None).schema["minItems"] == 1
    assert parse_tools({**body, "tool_choice": "required"}, None).schema["maxItems"] == MAX_TOOL_CALLS
    # parallel_tool_calls false: the grammar of "required" takes one element.
    assert parse_tools({**body, "tool_choice": "required", "parallel_tool_calls": False}, None).schema["maxItems"] == 1


def test_history_tool_call_arguments_reach_the_template_as_objects():
    from serving.protocol import parse_messages
    arguments = {"city": "Oslo", "days": random.randint(1, 9)}
    body = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}},
            {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    messages = parse_messages(body, max_messages=10)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == arguments
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == "not json"  # left as it came
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", None])
def test_a_call_nested_too_deep_is_content(parser):
    """A model can write a call nested a thousand deep (json.loads: RecursionError): whole or
    streamed, it is content with the finish reason it had, never an exception. Calls before it
    still count; a call MAX_JSON_DEPTH deep is still a call."""
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    tools = ToolCalling(None, parser=parser) if parser else ToolCalling({"type": "array"})
    for _ in range(5):
        depth = rng.randint(MAX_JSON_DEPTH + 1, 3000)  # the call's object is one level: its arguments the rest
        closed = rng.random() < 0.5  # finished, or cut short inside the arguments
        args = "[" * (depth - 1) + ("]" * (depth - 1) if closed else "")
        call = {"hermes": f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>',
                "llama3_json": f'{{"name": "f", "parameters": {args}}}', None: f'[{{"name": "f", "parameters": {args}}}]'}
        text = call[parser] if closed else call[parser][:call[parser].index(args) + len(args)]
        for reason in ("stop", "length"):
            msg, got_reason = message(text, tools, reason)
            assert "tool_calls" not in msg and got_reason == reason, str(msg)[:200]
            assert msg["content"] == text if parser else text.startswith("[" + msg["content"])
            content, calls, got_reason = stream(text, tools, rng, reason)
            assert calls == [] and got_reason == reason and content == msg["content"]
    ok = [[]]
    for _ in range(MAX_JSON_DEPTH - 5):  # MAX_JSON_DEPTH - 3 deep: with "required"'s array, the call and its
        ok = [ok]                         # arguments' objects, MAX_JSON_DEPTH
    text = write([("f", {"a": 1}), ("g", {"deep": ok})], parser)
    msg, reason = message(text, tools, "stop")
    assert reason == "tool_calls" and [c["function"]["name"] for c in msg["tool_calls"]] == ["f", "g"]
    if parser == "llama3_json":  # a call, then one too deep: the first is a call, the rest content
        text = write([("f", {"a": 1})], parser) + "; " + '{"name": "g", "parameters": ' + "[" * 2000
        msg, reason = message(text, tools, "length")
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["f"] and msg["content"].endswith("[" * 2000)


@pytest.mark.parametrize("choice, param", [
    ({"type": "function", "function": "get_weather"}, "tool_choice.function"),
    ({"type": "function"}, "tool_choice.function"),
    ({"type": "function", "function": {"name": ["get_weather"]}}, "tool_choice.function.name"),
    ({"type": "function", "function": {}}, "tool_choice.function.name"),
    ({"type": "other", "function": {"name": "get_weather"}}, "tool_choice.type"),
    ({"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (["auto"], "tool_choice"), ([], "tool_choice"), (0, "tool_choice"), (False, "tool_choice"),
    ("any", "tool_choice"),
])
def test_parse_tools_refuses_malformed_tool_choice(choice, param):
    for tools in (TOOLS, None):
        with pytest.raises(APIError) as e:
            parse_tools({"tools": tools, "tool_choice": choice}, "hermes")
        assert e.value.status == 400 and e.value.param in (param, "tool_choice"), (tools, e.value.message)
        assert e.value.param in e.value.message
    # null is the default: "auto" with tools (and a parser), nothing without
    assert parse_tools({"tools": TOOLS, "tool_choice": None}, "hermes") == ToolCalling(None, parser="hermes")
    assert parse_tools({"tool_choice": None}, None) is None
    # a named function without "type" is what vLLM accepts too
    assert parse_tools({"tools": TOOLS, "tool_choice": {"function": {"name": "get_weather"}}}, None).function == \
        "get_weather"


@pytest.mark.parametrize("tools, param", [
    ({"get_weather": {}}, "tools"), ("get_weather", "tools"), (5, "tools"), ([5], "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([TOOLS[0], {"type": "function", "function": "f"}], "tools[1]"),
])
def test_parse_tools_refuses_malformed_tools(tools, param):
    with pytest.raises(APIError) as e:
        parse_tools({"tools": tools, "tool_choice": "required"}, None)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message
