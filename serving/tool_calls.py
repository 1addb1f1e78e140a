"""Tool calling: what `tools` + `tool_choice` ask of the completion, and its text split into
content and tool calls as it grows (the same split serves a finished text and a stream).

- A named function: the completion is constrained to that function's arguments (JSON).
- "required": constrained to a JSON array of {"name", "parameters"} objects, at least one.
- "auto": the model writes calls in its own format, read by a parser chosen at start-up
  (vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`):
  - "hermes" (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
    after optional content;
  - "llama3_json" (Llama 3.1+): a completion that is `{"name": ..., "parameters": {...}}` objects
    (separated by ";", optionally after `<|python_tag|>`); any other completion is content;
  - "mistral" (Mistral 7B v0.3, Nemo): `[TOOL_CALLS]` then a JSON array of
    `{"name": ..., "arguments": {...}}` objects, after optional content.
Chat templates that tell a model about tools in each format ship in serving/tool_templates/.
"""

import dataclasses
import json
import uuid

from serving.protocol import MAX_JSON_DEPTH, APIError, field, json_depth

# The most tool calls one completion makes unless `max_tool_calls` says otherwise (with parallel
# calls), and the most `max_tool_calls` may ask for (the grammar of "required" grows with it).
MAX_TOOL_CALLS, MAX_TOOL_CALLS_LIMIT = 8, 128
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
_decoder = json.JSONDecoder()


@dataclasses.dataclass
class ToolCalling:
    """How a request calls tools: `schema` constrains the completion (None: free text, read by
    `parser`); `function` names the one function a constrained completion holds the arguments of."""

    schema: dict | None
    function: str | None = None
    parser: str | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps a completion to one call
    max_calls: int = 0  # the most calls a completion makes (0: MAX_TOOL_CALLS; 1 without parallel calls)

    def __post_init__(self):
        self.max_calls = 1 if not self.parallel else self.max_calls or MAX_TOOL_CALLS


def parse_tools(body: dict, auto_parser: str | None) -> ToolCalling | None:
    """`tools` + `tool_choice` (None: the completion is plain text). OpenAI's default with tools is
    "auto", which needs the server's tool-call parser: without one it is a 400, as in vLLM. A
    null tool_choice is the default. Any other shape than OpenAI's is a 400 naming the field.
    `parallel_tool_calls: false` allows one call: the grammar of "required" takes one element, and
    the parser of "auto" reads the first call only (a named function is one call anyway).
    Otherwise `max_tool_calls` (OpenAI's Responses field; default MAX_TOOL_CALLS) bounds the calls
    the same way: the grammar of "required" ends the array there, so a model cannot repeat calls
    until max_tokens."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = field(body, "parallel_tool_calls", "boolean", True)
    max_calls = field(body, "max_tool_calls", "integer", MAX_TOOL_CALLS)
    if not 1 <= max_calls <= MAX_TOOL_CALLS_LIMIT:
        raise APIError(f"'max_tool_calls' must be between 1 and {MAX_TOOL_CALLS_LIMIT}, got {max_calls}",
                       param="max_tool_calls", code="invalid_value")
    max_calls = max_calls if parallel else 1
    _check_choice_shape(choice)
    if tools is not None and not isinstance(tools, list):
        raise APIError(f"'tools' must be an array of {_TOOL_SHAPE}, got {type(tools).__name__}: {tools!r:.80}",
                       param="tools", code="invalid_type")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)):
            raise APIError(f"tools[{i}] must be {_TOOL_SHAPE}, got {t!r:.80}", param=f"tools[{i}]",
                           code="invalid_type")
        parameters = t["function"].get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object, got {parameters!r:.80}",
                           param=f"tools[{i}].function.parameters", code="invalid_type")
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
                 for t in tools}
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if auto_parser is None:
            raise APIError("tool_choice 'auto' (the default with tools) needs the server started with "
                           "--enable-auto-tool-choice and --tool-call-parser; or use tool_choice 'required' "
                           "or name a function", param="tool_choice", code="unsupported_parameter")
        return ToolCalling(None, parser=auto_parser, parallel=parallel, max_calls=max_calls)
    if choice == "required":
        return ToolCalling({"type": "array", "minItems": 1, "maxItems": max_calls, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, parameters in functions.items()]}}, parallel=parallel, max_calls=max_calls)
    name = choice["function"]["name"]  # _check_choice_shape: a named function
    if name not in functions:
        raise APIError(f"tool_choice names the function {name!r:.80}, which is not in 'tools' "
                       f"({', '.join(map(repr, functions))})"[:300], param="tool_choice")
    return ToolCalling(functions[name], function=name)


_TOOL_SHAPE = "{'type': 'function', 'function': {'name': str, 'parameters': {...}}}"
_CHOICE_SHAPE = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': str}}"


def _check_choice_shape(choice):
    """A 400 unless `tool_choice` has one of OpenAI's shapes (null: the default)."""
    if choice is None or (isinstance(choice, str) and choice in ("none", "auto", "required")):
        return
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type", "function") != "function":
            raise APIError(f"'tool_choice.type' is {choice.get('type')!r:.80}; expected 'function'",
                           param="tool_choice.type", code="invalid_value")
        if not isinstance(function, dict):
            raise APIError(f"'tool_choice.function' must be an object {{'name': str}}, got {function!r:.80}",
                           param="tool_choice.function", code="invalid_type")
        if not isinstance(function.get("name"), str):
            raise APIError(f"'tool_choice.function.name' must be a string, got {function.get('name')!r:.80}",
                           param="tool_choice.function.name", code="invalid_type")
        return
    raise APIError(f"'tool_choice' must be {_CHOICE_SHAPE}, got {choice!r:.80}", param="tool_choice",
                   code="invalid_value" if isinstance(choice, str) else "invalid_type")


@dataclasses.dataclass
class Split:
    """A completion's text read as content and tool calls [name, arguments as JSON text]. As the
    text grows, content and the calls only grow, and only the last call's arguments can: so a
    stream sends differences."""

    content: str
    calls: list[tuple[str, str]]


def split(text: str, tools: ToolCalling, final: bool) -> Split:
    """`text` (the completion so far; `final`: all of it) as content and calls. An unfinished text
    holds back what may still become a call; a finished one gives back as content whatever did not
    parse as a call, so nothing the model wrote is lost. Only the first `tools.max_calls` calls
    count (1 without parallel calls; the text of later ones is dropped, not given back as content)."""
    result = _split(text, tools, final)
    if len(result.calls) > tools.max_calls:
        return Split(result.content, result.calls[:tools.max_calls])
    return result


def _split(text: str, tools: ToolCalling, final: bool) -> Split:
    if tools.function is not None:  # the whole completion is the arguments, streamed as they come
        return Split("", [(tools.function, text)])
    if tools.parser is None:  # "required": the elements of a JSON array, each once complete; the grammar
        return Split("", _calls(text, text.find("[") + 1, ",")[0])  # makes it all: an unfinished one is dropped
    if tools.parser == "hermes":
        return _split_hermes(text, final)
    if tools.parser == "mistral":
        return _split_mistral(text, final)
    return _split_llama3_json(text, final)


def _split_hermes(text: str, final: bool) -> Split:
    start = text.find(_HERMES_OPEN)
    if start < 0:  # content; unfinished, a tail that may begin a tag waits
        return Split(text if final else text[:len(text) - _partial_prefix(text, _HERMES_OPEN)], [])
    calls, after = [], start  # `after`: the end of the last whole call
    while (pos := text.find(_HERMES_OPEN, after)) >= 0:
        end = text.find(_HERMES_CLOSE, pos)
        call = _named(_loads(text[pos + len(_HERMES_OPEN):end])) if end >= 0 else None
        if call is None:
            break
        calls.append(call)
        after = end + len(_HERMES_CLOSE)
    return Split(text[:start] + (text[after:].strip() if final else ""), calls)


def _split_llama3_json(text: str, final: bool) -> Split:
    body = text.lstrip().removeprefix(_PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        if not final and (not body or _PYTHON_TAG.startswith(body)):  # may still become a call
            return Split("", [])
        return Split(text, [])
    calls, end = _calls(body, 0, ";")
    if final and not calls:
        return Split(text, [])  # not a call after all: the model answered in text
    return Split(body[end:].strip() if final else "", calls)


def _split_mistral(text: str, final: bool) -> Split:
    start = text.find(_MISTRAL_TOOL_CALLS)
    if start < 0:  # content; unfinished, a tail that may begin the tag waits
        return Split(text if final else text[:len(text) - _partial_prefix(text, _MISTRAL_TOOL_CALLS)], [])
    body = text[start + len(_MISTRAL_TOOL_CALLS):]
    first = len(body) - len(body.lstrip())  # an array of calls, or one call object
    calls, end = _calls(body, first + body.startswith("[", first), ",")
    rest = body[end:].strip().removesuffix("]").strip() if final else ""
    return Split(text[:start] + rest, calls)


def _calls(text: str, pos: int, separator: str) -> tuple[list[tuple[str, str]], int]:
    """The complete JSON calls from `pos` on, separated by `separator`, and where the rest (an
    incomplete value, or one that is not a call) starts."""
    calls = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == separator):
            pos += 1
        if json_depth(text[pos:], first_value=True) > MAX_JSON_DEPTH:  # never given to a recursive parser
            return calls, pos
        try:
            value, after = _decoder.raw_decode(text, pos)
        except ValueError:
            return calls, pos
        call = _named(value)
        if call is None:
            return calls, pos
        calls.append(call)
        pos = after


def _loads(text: str):
    """The JSON value of `text`; None when it is not JSON, or nests too deeply to be a call (a
    model can write a thousand "[": json.loads would raise RecursionError)."""
    if json_depth(text) > MAX_JSON_DEPTH:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _named(value) -> tuple[str, str] | None:
    """(name, arguments as JSON) of {"name": ..., "arguments" or "parameters": {...}}; None otherwise."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return value["name"], json.dumps(value.get("arguments", value.get("parameters", {})))


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message(text: str, tools: ToolCalling, finish_reason: str | None) -> tuple[dict, str | None]:
    """The chat message of a finished completion, and its finish reason ("tool_calls" when it
    called any)."""
    result = split(text, tools, final=True)
    if tools.function is not None and finish_reason != "stop":
        result = Split("", [])  # cut short: the arguments are not whole, so no call (and no content)
    if not result.calls:
        return {"role": "assistant", "content": result.content}, finish_reason
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
             for name, arguments in result.calls]
    return {"role": "assistant", "content": result.content or None, "tool_calls": calls}, \
        "tool_calls" if finish_reason == "stop" else finish_reason


class StreamedCalls:
    """One streamed choice's tool calling: each chunk's text delta becomes content and tool-call
    deltas in OpenAI's shape (a call's first delta carries its id and name)."""

    def __init__(self, tools: ToolCalling):
        self.tools = tools
        self.text = ""
        self.content_sent = 0
        self.arguments_sent: list[int] = []  # per call sent so far
        self.ids: list[str] = []

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        self.text += text
        result = split(self.text, self.tools, final=finish_reason is not None)
        delta = {}
        if result.content[self.content_sent:]:
            delta["content"] = result.content[self.content_sent:]
            self.content_sent = len(result.content)
        calls = []
        for index, (name, arguments) in enumerate(result.calls):
            if index == len(self.arguments_sent):
                self.ids.append(new_call_id())
                self.arguments_sent.append(0)
                calls.append({"index": index, "id": self.ids[index], "type": "function",
                              "function": {"name": name, "arguments": arguments}})
            elif arguments[self.arguments_sent[index]:]:
                calls.append({"index": index, "function": {"arguments": arguments[self.arguments_sent[index]:]}})
            self.arguments_sent[index] = len(arguments)
        if calls:
            delta["tool_calls"] = calls
        if self.ids and finish_reason == "stop":
            finish_reason = "tool_calls"
        return delta, finish_reason
