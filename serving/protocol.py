"""The OpenAI protocol: request bodies checked field by field, errors in OpenAI's shape.

Every check raises APIError, which the server answers with its status and
{"error": {"message", "type", "param", "code"}}. Unknown fields are ignored (with a debug line), as
clients send extras freely; known fields of the wrong type or out of range, and OpenAI fields that
jpaged does not implement (suffix, audio, functions, ...), are a 400 naming them.
"""

import dataclasses
import json
import logging
import re
from typing import Any

import numpy as np

from jpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def to_json(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# Arrays and objects nested deeper than this are refused before any JSON parser recurses into them:
# the request body, tool-call arguments in the history, a guided_json schema given as text (a 400
# naming the field), and a tool call the model generated (read as content, not as a call).
# Python's json recurses once per level and fails near 1000 (RecursionError); jpaged's own readers
# of what it parsed (schemas, templates) recurse too. 128 is serde_json's default limit, and far
# beyond what any real request nests (OpenAI allows JSON schemas 10 levels deep).
MAX_JSON_DEPTH = 128
_QUOTE, _BACKSLASH, _OPEN, _CLOSE = ord('"'), ord("\\"), ord("{"), ord("}")  # "[" | 0x20 == "{", "]" | 0x20 == "}"


def json_depth(text: str, *, first_value: bool = False) -> int:
    """How deep arrays and objects nest in the JSON `text` (0: none), brackets inside strings not
    counted; `first_value`: only up to where the first array or object closes. Found without
    parsing, in linear time (numpy: 16 MB of "[" in 0.5 s), so that a recursive parser is only
    given text whose depth is known. For any text, at least the depth a JSON parser reaches
    before it finishes or fails: both read strings the same way up to the first error."""
    if "[" not in text and "{" not in text:
        return 0
    # Bytes: every byte of a multi-byte UTF-8 character is >= 0x80, so none is a bracket or quote.
    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    quotes = np.flatnonzero(data == _QUOTE)
    backslashes = np.flatnonzero(data == _BACKSLASH)
    if quotes.size and backslashes.size:  # a quote after an odd run of backslashes is escaped
        last = np.flatnonzero(np.diff(backslashes) != 1)  # where runs of consecutive backslashes end
        run_ends = backslashes[np.append(last, backslashes.size - 1)]
        run_starts = backslashes[np.insert(last + 1, 0, 0)]
        run = np.minimum(np.searchsorted(run_ends, quotes - 1), run_ends.size - 1)
        escaped = (run_ends[run] == quotes - 1) & ((run_ends[run] - run_starts[run]) % 2 == 0)
        quotes = quotes[~escaped]
    folded = data | 0x20
    steps = (folded == _OPEN).view(np.int8) - (folded == _CLOSE).view(np.int8)  # +1 opens, -1 closes
    if quotes.size:  # inside a string: after an odd number of quotes (parity survives uint8 wrapping)
        marks = np.zeros(data.size, np.uint8)
        marks[quotes] = 1
        steps *= (np.cumsum(marks, dtype=np.uint8) & 1 ^ 1).view(np.int8)
    if first_value:
        first = np.flatnonzero(steps)
        if not first.size or steps[first[0]] < 0:
            return 0
        steps = steps[first[0]:]
    depth = np.cumsum(steps, dtype=np.int32)
    if first_value:
        closed = np.flatnonzero(depth <= 0)
        if closed.size:
            depth = depth[:closed[0]]
    return int(depth.max(initial=0))


def check_json_depth(text: str, param: str | None, what: str):
    """A 400 naming `param` when `text` (JSON) nests arrays and objects deeper than MAX_JSON_DEPTH."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # cheap: it cannot be deeper
        return
    # A prefix nests no deeper than the whole: a hostile body is usually told by its first 64 KiB.
    if json_depth(text[:2**16]) > MAX_JSON_DEPTH or json_depth(text) > MAX_JSON_DEPTH:
        raise APIError(f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep", param=param,
                       code="invalid_json")


def _type_name(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int_list(x) -> bool:
    return isinstance(x, list) and all(_is_int(t) for t in x)


_KINDS = {
    "integer": (_is_int, "an integer"),
    "number": (_is_number, "a number"),
    "boolean": (lambda x: isinstance(x, bool), "a boolean"),
    "string": (lambda x: isinstance(x, str), "a string"),
    "object": (lambda x: isinstance(x, dict), "an object"),
    "string or array of strings": (lambda x: isinstance(x, str) or (isinstance(x, list) and all(
        isinstance(s, str) for s in x)), "a string or an array of strings"),
    "array of integers": (_is_int_list, "an array of integers"),
    "boolean or 'never'": (lambda x: isinstance(x, bool) or x == "never", "a boolean or 'never'"),
    "array of strings": (lambda x: isinstance(x, list) and all(isinstance(s, str) for s in x), "an array of strings"),
    "object or string": (lambda x: isinstance(x, (dict, str)), "an object or a string"),
}


def field(body: dict, name: str, kind: str, default=None, required: bool = False):
    """body[name] checked against `kind`; null or absent gives `default` (or a 400 if required)."""
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(f"'{name}' is a required property", param=name, code="missing_required_parameter")
        return default
    ok, expected = _KINDS[kind]
    if not ok(value):
        raise APIError(f"'{name}' must be {expected}, got {_type_name(value)}: {value!r:.80}", param=name,
                       code="invalid_type")
    return value


def parse_prompts(body: dict, *, max_prompts: int, max_tokens: int) -> list[str | list[int]]:
    """`prompt` as a string, a list of strings, token ids, or a list of token-id lists; at most
    `max_prompts` prompts, token-id prompts at most `max_tokens` long (checked first: cheap)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("'prompt' is a required property", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt:
        token_lists = [prompt] if _is_int(prompt[0]) else [p for p in prompt if isinstance(p, list)]
        if not _is_int(prompt[0]) and len(prompt) > max_prompts:
            raise APIError(f"'prompt' holds {len(prompt)} prompts; at most {max_prompts} are allowed in one request",
                           param="prompt")
        longest = max(map(len, token_lists), default=0)
        if longest > max_tokens:
            raise context_length_error(max_tokens, longest, 0, "prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_int_list(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int_list(p) for p in prompt):
        prompts = prompt
    else:
        raise APIError("'prompt' must be a string, an array of strings, an array of token ids or an array of "
                       f"token-id arrays, got {_type_name(prompt)}: {prompt!r:.80}", param="prompt",
                       code="invalid_type")
    if any(len(p) == 0 for p in prompts):
        raise APIError("'prompt' must not be empty", param="prompt")
    return prompts


def parse_messages(body: dict, *, max_messages: int) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise APIError("'messages' is a required property", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty array of message objects", param="messages",
                       code="invalid_type")
    if len(messages) > max_messages:  # each renders to at least one token (Responses' truncation drops them)
        raise APIError(f"'messages' holds {len(messages)} messages; at most {max_messages} fit the context",
                       param="messages", code="context_length_exceeded")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]",
                           code="invalid_type")
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            pass  # a message with images, as serving/images.py left it (the client's own parts checked there)
        elif isinstance(content, list):  # content parts: only text parts carry meaning for a text model
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}",
                               param=f"messages[{i}].content", code="invalid_type")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or an array of text parts, got "
                           f"{_type_name(content)}", param=f"messages[{i}].content", code="invalid_type")
        parsed.append({**m, "content": content or ""})
        if isinstance(m.get("tool_calls"), list):  # earlier calls: templates expect arguments as objects
            parsed[-1]["tool_calls"] = [_arguments_as_object(c, f"messages[{i}].tool_calls[{j}].function.arguments")
                                        for j, c in enumerate(m["tool_calls"])]
    return parsed


def _arguments_as_object(call, param: str):
    """A call from the history, its `function.arguments` JSON text read as an object (as vLLM does)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    check_json_depth(function["arguments"], param, f"'{param}'")
    try:
        return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
    except ValueError:
        return call


@dataclasses.dataclass
class StreamOptions:
    stream: bool
    include_usage: bool


def parse_stream(body: dict) -> StreamOptions:
    stream = field(body, "stream", "boolean", False)
    options = field(body, "stream_options", "object", {})
    include_usage = field(options, "include_usage", "boolean", False)
    if options and not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return StreamOptions(stream, include_usage)


_SAMPLING_FIELDS = [  # (name, kind) shared by completions and chat, passed to SamplingParams as is
    ("n", "integer"), ("temperature", "number"), ("top_p", "number"), ("top_k", "integer"), ("min_p", "number"),
    ("seed", "integer"), ("min_tokens", "integer"), ("stop_token_ids", "array of integers"),
    ("ignore_eos", "boolean"), ("presence_penalty", "number"), ("frequency_penalty", "number"),
    ("repetition_penalty", "number"), ("length_penalty", "number"), ("use_beam_search", "boolean"),
    ("early_stopping", "boolean or 'never'"), ("guided_regex", "string"), ("guided_choice", "array of strings"),
]


# OpenAI fields jpaged does not implement, with the value that asks for nothing (or None: any
# non-null value). Asking for them is a 400 naming the field: never silently ignored.
_UNSUPPORTED = {
    "suffix": None, "functions": [], "function_call": "none", "prediction": None, "audio": None,
    "modalities": ["text"], "guided_grammar": None,
}
# Fields read elsewhere, or that change nothing here (metadata, storage, routing hints).
_KNOWN = {"user", "store", "metadata", "service_tier", "parallel_tool_calls", "stream_options",
          "prompt", "messages", "model", "max_tokens", "max_completion_tokens", "echo", "logprobs",
          "top_logprobs", "best_of", "stream", "add_generation_prompt", "stop", "add_special_tokens",
          "logit_bias", "response_format", "guided_json", "tools", "tool_choice", "max_tool_calls"}


def check_fields(body: dict):
    """A 400 for OpenAI fields jpaged does not implement; a debug line for fields it does not know."""
    for name, harmless in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != harmless:
            raise APIError(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    check_metadata(body)
    known = _KNOWN | {name for name, _ in _SAMPLING_FIELDS} | set(_UNSUPPORTED)
    unknown = sorted(set(body) - known)
    if unknown:
        logger.debug("ignoring unknown request fields %s", unknown)


# OpenAI's limits on `metadata` (Responses; Chat Completions, stored or not).
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(body: dict) -> dict:
    """`metadata` ({} when absent or null): at most 16 string pairs, keys of at most 64 characters,
    values of at most 512; anything else is a 400 naming `metadata`."""
    metadata = body.get("metadata")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise APIError(f"'metadata' must be an object of strings, got {type(metadata).__name__}", param="metadata",
                       code="invalid_type")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(f"'metadata' holds {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed",
                       param="metadata", code="invalid_value")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise APIError(f"'metadata' values must be strings; {key!r:.80} is {type(value).__name__}",
                           param="metadata", code="invalid_type")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise APIError(f"'metadata' keys must be at most {MAX_METADATA_KEY_CHARS} characters; {key!r:.80} has "
                           f"{len(key)}", param="metadata", code="invalid_value")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(f"'metadata' values must be at most {MAX_METADATA_VALUE_CHARS} characters; the value of "
                           f"{key!r:.80} has {len(value)}", param="metadata", code="invalid_value")
    return metadata


def parse_logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: JSON object keys are strings of token ids."""
    bias = field(body, "logit_bias", "object")
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise APIError("'logit_bias' keys must be token ids", param="logit_bias") from None


def parse_response_format(body: dict) -> dict | None:
    """The JSON schema `response_format` asks the completion to follow (None: plain text). Its
    shape is OpenAI's: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema":
    {"name": str, "schema": {...}, "strict": bool}} (the schema is required here: it is the point)."""
    response_format = field(body, "response_format", "object")
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise APIError(f"'response_format.type' is {kind!r:.80}; expected 'text', 'json_object' or 'json_schema'",
                       param="response_format", code="invalid_value")
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict):
        raise APIError("'response_format.json_schema' must be an object {'name': ..., 'schema': {...}} (type "
                       f"'json_schema'), got {_type_name(json_schema)}: {json_schema!r:.80}",
                       param="response_format.json_schema",
                       code="invalid_type")
    for name, kind_name in (("name", "string"), ("strict", "boolean"), ("description", "string")):
        value = json_schema.get(name)
        if value is not None and not _KINDS[kind_name][0](value):
            raise APIError(f"'response_format.json_schema.{name}' must be {_KINDS[kind_name][1]}, got "
                           f"{_type_name(value)}: {value!r:.80}", param=f"response_format.json_schema.{name}",
                           code="invalid_type")
    schema = json_schema.get("schema")
    if not isinstance(schema, dict):
        raise APIError("'response_format.json_schema.schema' must be a JSON schema object, got "
                       f"{_type_name(schema)}: {schema!r:.80}", param="response_format.json_schema.schema",
                       code="invalid_type" if schema is not None else "missing_required_parameter")
    return schema


def sampling_params(body: dict, *, max_tokens: int, logprobs: int | None, best_of: int | None,
                    stream: bool, guided_json: dict | str | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the body's sampling fields; SamplingParams' own range checks become
    400s naming the field. `guided_json`: a schema the caller derived (tools)."""
    check_fields(body)
    kwargs = {name: body[name] for name, kind in _SAMPLING_FIELDS if field(body, name, kind) is not None}
    kwargs["stop"] = field(body, "stop", "string or array of strings")
    kwargs["logit_bias"] = parse_logit_bias(body)
    field(body, "user", "string")  # accepted and unused, as in vLLM
    guided = field(body, "guided_json", "object or string")
    if isinstance(guided, str):  # a schema as JSON text: parsed later, so bounded now
        check_json_depth(guided, "guided_json", "'guided_json'")
    schemas = [s for s in (guided, parse_response_format(body), guided_json) if s is not None]
    if len(schemas) > 1:
        raise APIError("ask for one structured output at a time (guided_json, response_format or tools)",
                       param="response_format")
    kwargs["guided_json"] = schemas[0] if schemas else None
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, best_of=best_of,
                                prompt_logprobs=prompt_logprobs, **kwargs)
    except ValueError as e:
        raise APIError(str(e), param=param_of(str(e))) from None
    if stream and params.best_of != params.n:
        raise APIError(f"best_of ({params.best_of}) must equal n ({params.n}) when streaming", param="best_of")
    if stream and params.use_beam_search:
        raise APIError("beam search cannot stream: its beams are only ranked at the end", param="stream")
    if params.best_of == params.n and not params.use_beam_search:  # else only whole outputs rank them
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)  # outputs carry what is new
    return params


def param_of(message: str) -> str | None:
    """The field a jpaged ValueError names ("temperature=-1; expected >= 0" -> "temperature")."""
    m = re.match(r"(\w+)=", message)
    if m:
        return m.group(1)
    if message.startswith("prompt"):
        return "prompt"
    return None


def context_length_error(max_model_len: int, prompt_len: int, max_tokens: int, param: str) -> APIError:
    return APIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                    f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} in the "
                    "completion). Please reduce the length of the prompt or completion.",
                    param=param, code="context_length_exceeded")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
