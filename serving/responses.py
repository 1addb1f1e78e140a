"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET / DELETE
/v1/responses/{id} and POST /v1/responses/{id}/cancel.

A Responses request is read as the chat request it means: `input` items become chat messages
(function_call items an assistant message's tool calls, function_call_output items tool
messages), `instructions` a system message first, flat function `tools` chat's tools,
`text.format` chat's `response_format`, `max_output_tokens` `max_tokens` (`max_tool_calls` bounds
the calls, serving/tool_calls.py); so the chat template, tool calling, structured output and every
check are chat's (serving/chat.py). The completion comes back as output items (a message, function
calls), streamed as Responses events (ending in response.incomplete when max_output_tokens cut it).

Responses are kept (`store`, OpenAI's default true) in an in-memory store bounded by count and bytes
(serving/responses_store.py), the oldest dropped first: `previous_response_id` continues a
stored conversation (its input and output, not its instructions), GET returns a stored response.
With `truncation: "auto"` a conversation too long for the context loses its oldest turns.
"""

import itertools
import json
import re
import time
import uuid

from aiohttp import web

from serving import tool_calls
from serving.chat import OpenAIServingChat
from serving.protocol import APIError, check_metadata, field
from serving.request_body import json_body
from serving.responses_store import ResponseStore
from serving.serving_engine import json_dumps, raise_generation_errors

# Responses fields jpaged does not implement, with the value that asks for nothing (None: any
# non-null value): asking for more is a 400 naming the field, as on the other endpoints.
_UNSUPPORTED = {"background": False, "conversation": None, "prompt": None, "context_management": None}
LOGPROBS = "message.output_text.logprobs"
# OpenAI's other `include` values ask for parts of items this server never makes (searches,
# images, encrypted reasoning): accepted, and nothing to add.
_INCLUDE = (LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url", "file_search_call.results",
            "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
            "computer_call_output.output.image_url")
# Sampling fields beyond OpenAI's that vLLM's Responses endpoint also takes, passed on to chat.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "user")
# Chat's parameter names in errors, as the Responses request calls them.
_PARAMS = [(re.compile(r"^messages"), "input"), (re.compile(r"^max_tokens"), "max_output_tokens"),
           (re.compile(r"^response_format.*"), "text.format"), (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
           (re.compile(r"^tool_choice\.function"), "tool_choice")]
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")


def _text(content, param: str, images: bool = False) -> str | list:
    """A message's or a tool output's content: a string, or text parts (input_text, output_text,
    refusal) joined; other parts (files) are a 400. `images`: a message's content with input_image
    parts stays a list of parts, for chat's image handling (serving/images.py) to check and load."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"'{param}' must be a string or an array of content parts", param=param, code="invalid_type")
    if images and any(isinstance(part, dict) and part.get("type") == "input_image" for part in content):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "refusal") or not isinstance(part.get(key), str):
            raise APIError(f"'{param}[{j}]' must be a text part ({{'type': 'input_text', 'text': str}}); "
                           f"got {part!r:.80} (this server's models read text only)", param=f"{param}[{j}]",
                           code="invalid_type" if kind in ("input_text", "output_text", "refusal") else
                           "unsupported_parameter")
        texts.append(part[key])
    return "".join(texts)


def input_messages(body: dict) -> list[dict]:
    """`input` (a string or a list of items) as chat messages. Adjacent function calls (and the
    assistant text before them) form one assistant message, as parallel calls do in chat."""
    items = body.get("input")
    if items is None:
        raise APIError("'input' is a required property", param="input", code="missing_required_parameter")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError("'input' must be a string or a non-empty array of input items", param="input",
                       code="invalid_type")
    messages, call_names = [], {}
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"'{param}' must be an input item object, got {item!r:.80}", param=param,
                           code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise APIError(f"'{param}.role' must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r:.80}",
                               param=f"{param}.role", code="invalid_value")
            content = _text(item.get("content"), f"{param}.content", images=True)
            # Chat templates know "system"; "developer" is OpenAI's newer name for it.
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(f"'{param}.{key}' must be a string", param=f"{param}.{key}", code="invalid_type")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            call_names[item["call_id"]] = item["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(f"'{param}.call_id' must be a string", param=f"{param}.call_id", code="invalid_type")
            message = {"role": "tool", "tool_call_id": item["call_id"],
                       "content": _text(item.get("output"), f"{param}.output")}
            if item["call_id"] in call_names:  # some templates name the tool a result comes from
                message["name"] = call_names[item["call_id"]]
            messages.append(message)
        elif kind == "reasoning":  # replayed by agents; these models write no reasoning items, so none is lost
            continue
        else:
            raise APIError(f"'{param}.type' {kind!r:.80} is not supported (message, function_call, "
                           "function_call_output)", param=f"{param}.type", code="unsupported_parameter")
    return messages


def chat_tools(body: dict) -> tuple[list | None, object]:
    """Flat Responses function tools and tool_choice in chat's nested shape."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(tools, list):
        converted = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                kind = t.get("type") if isinstance(t, dict) else None
                raise APIError(f"tools[{i}] must be a function tool {{'type': 'function', 'name': str, "
                               f"'parameters': {{...}}}}, got {t!r:.80}" + (" (only function tools are supported)"
                                                                          if kind not in (None, "function") else ""),
                               param=f"tools[{i}]", code="unsupported_parameter" if kind not in (None, "function")
                               else "invalid_type")
            converted.append({"type": "function", "function": {
                key: t[key] for key in ("name", "description", "parameters", "strict") if t.get(key) is not None}})
        tools = converted
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': str}, "
                           f"got {choice!r:.80}", param="tool_choice", code="invalid_value")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def response_format(body: dict) -> dict | None:
    """`text.format` ({'type': 'text' | 'json_object' | 'json_schema', ...}, flat) as chat's
    `response_format`; `text.verbosity` other than the default is a 400."""
    text = field(body, "text", "object", {})
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise APIError("'text.verbosity' is not supported by this server", param="text.verbosity",
                       code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(f"'text.format' must be an object, got {fmt!r:.80}", param="text.format", code="invalid_type")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}}
    return fmt  # "text", "json_object", or a type chat's check refuses


def included_logprobs(body: dict, top_logprobs: int | None) -> int | None:
    """How many likeliest tokens each output token's logprobs list (vLLM's rule: only when
    `include` asks for message.output_text.logprobs; `top_logprobs` is 0 unless set)."""
    include = field(body, "include", "array of strings", [])
    for i, name in enumerate(include):
        if name not in _INCLUDE:
            raise APIError(f"'include' value {name!r:.80} is not supported; expected one of {list(_INCLUDE)}",
                           param=f"include[{i}]", code="unsupported_parameter")
    return (top_logprobs or 0) if LOGPROBS in include else None


def check_fields(body: dict):
    for name, harmless in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != harmless:
            raise APIError(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    reasoning = field(body, "reasoning", "object", {})
    if reasoning.get("effort") not in (None, "none") or reasoning.get("summary") is not None:
        raise APIError("'reasoning' is not supported by this server (its models do not reason)", param="reasoning",
                       code="unsupported_parameter")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise APIError(f"'truncation' must be 'auto' or 'disabled', got {truncation!r:.80}", param="truncation",
                       code="invalid_value")
    check_metadata(body)


def _renamed(e: APIError) -> APIError:
    """A chat error with the fields named as the Responses request names them."""
    if e.param is None:
        return e
    param = e.param
    for pattern, name in _PARAMS:
        param = pattern.sub(name, param)
    if param != e.param:
        e.message = e.message.replace(f"'{e.param}'", f"'{param}'").replace(f"{e.param}=", f"{param}=")
        if e.message.startswith(f"{e.param}:"):  # an image part's errors start with its path (serving/images.py)
            e.message = param + e.message[len(e.param):]
        e.param = param
    return e


class OutputItems:
    """A completion's text as Responses output items, built as the text grows: add() returns the
    events the new text makes (a message item with one output_text part, function_call items
    with their arguments); the same items make the finished response, streamed or not."""

    def __init__(self, tools: tool_calls.ToolCalling | None):
        self.calls = tool_calls.StreamedCalls(tools) if tools is not None else None
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.logprobs: list[dict] = []  # of tokens whose text is still held back (a stop string maybe)

    def add(self, text: str, finish_reason: str | None, logprobs: list[dict] | None = None) -> list[dict]:
        """`logprobs`: the new tokens' (chat's `logprobs.content` entries), without tools only."""
        self.logprobs += logprobs or []
        if self.calls is not None:
            delta, _ = self.calls.delta(text, finish_reason)
        else:
            delta = {"content": text} if text else {}
        events = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a new call
                events += self._close("completed")
                events += self._start({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                                       "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
            self.open["arguments"] += call["function"]["arguments"]
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.open["id"],
                           "output_index": len(self.items) - 1, "delta": call["function"]["arguments"]})
        if finish_reason is not None:
            if not self.items:  # no text at all (an end-of-sequence first): still one message, as vLLM's
                events += self._text("")
            # Cut short: a message is unfinished, as are a named function's arguments (streamed as
            # they come); other calls only ever appear whole.
            whole = self.open is not None and self.open["type"] == "function_call" and self.calls.tools.function is None
            events += self._close("incomplete" if finish_reason == "length" and not whole else "completed")
        return events

    def _start(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]

    def _text(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close("completed")
            events += self._start({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                                   "role": "assistant", "content": []})
            self.open["content"].append(_output_text(""))
            events.append({**self._where(), "type": "response.content_part.added", "part": _output_text("")})
        part = self.open["content"][0]
        part["text"] += text
        part["logprobs"] += self.logprobs
        events.append({**self._where(), "type": "response.output_text.delta", "delta": text,
                       "logprobs": self.logprobs})
        self.logprobs = []
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _close(self, status: str) -> list[dict]:
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "message":
            part = item["content"][0]
            if self.logprobs:  # tokens whose text never came (half a character): the deltas still add up
                events += self._text("")
            events += [{**self._where(), "type": "response.output_text.done", "text": part["text"],
                        "logprobs": list(part["logprobs"])},
                       {**self._where(), "type": "response.content_part.done", "part": dict(part)}]
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "name": item["name"], "arguments": item["arguments"]})
        item["status"] = status
        self.open = None
        return [*events, {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                          "item": json.loads(json.dumps(item))}]

    def as_message(self) -> dict | None:
        """The output as one assistant chat message (for the conversation's next turn)."""
        if not self.items:
            return None
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        content = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OpenAIServingResponses(OpenAIServingChat):
    def __init__(self, engine, options):
        super().__init__(engine, options)
        self.responses = ResponseStore(options.responses_store_size, options.responses_store_bytes)

    def add_responses_routes(self, app: web.Application):
        app.router.add_post("/v1/responses", self.create_response)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve_response)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel_response)

    async def create_response(self, request):
        body = await json_body(request, self.body_timeout)
        lora_request = self._check_model(body, request)
        check_fields(body)
        stream, store = field(body, "stream", "boolean", False), field(body, "store", "boolean", True)
        instructions = field(body, "instructions", "string")
        previous_id = field(body, "previous_response_id", "string")
        max_output_tokens = field(body, "max_output_tokens", "integer")
        history = self.responses.get(previous_id, "previous_response_id")[1] if previous_id is not None else []
        conversation = [*history, *input_messages(body)]
        tools, choice = chat_tools(body)
        top_logprobs = self._check_logprobs(field(body, "top_logprobs", "integer"), "top_logprobs")
        logprobs = included_logprobs(body, top_logprobs)
        fmt = response_format(body)

        def chat_body(messages: list[dict]) -> dict:
            return {"messages": ([{"role": "system", "content": instructions}] if instructions else []) + messages,
                    "tools": tools, "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls"),
                    "max_tool_calls": body.get("max_tool_calls"),
                    "response_format": fmt, "max_tokens": max_output_tokens,
                    **{name: body[name] for name in _SAMPLING if name in body}}

        try:
            ids, params, tool_calling = await self._chat_request(chat_body(conversation), stream, logprobs)
        except APIError as e:
            if body.get("truncation") != "auto" or e.code != "context_length_exceeded":
                raise _renamed(e) from None
            conversation, (ids, params, tool_calling) = await self._truncate(conversation, chat_body, stream,
                                                                             logprobs, e)
        if logprobs is not None and tool_calling is not None:  # tokens would not map onto items' text
            raise APIError(f"'include' {LOGPROBS!r} is not supported with tools (unless tool_choice is 'none')",
                           param="include", code="unsupported_parameter")
        response_id = f"resp_{uuid.uuid4().hex}"
        text_format = (body.get("text") or {}).get("format") or {"type": "text"}
        response = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": instructions,
            "max_output_tokens": params.max_tokens, "max_tool_calls": body.get("max_tool_calls"),
            "model": request["model"], "output": [],
            "parallel_tool_calls": field(body, "parallel_tool_calls", "boolean", True),
            "previous_response_id": previous_id, "reasoning": None, "service_tier": body.get("service_tier") or "auto",
            "store": store and self.responses.enabled, "temperature": params.temperature,
            "text": {"format": text_format}, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_logprobs": top_logprobs or 0, "top_p": params.top_p,
            "truncation": body.get("truncation") or "disabled",
            "usage": None, "user": body.get("user"), "metadata": body.get("metadata") or {}}
        output, kept = OutputItems(tool_calling), conversation if response["store"] else None
        streams = await self._add_requests(response_id, [ids], params, lora_request)
        try:
            if stream:
                return await self._stream_response(request, response, streams[0], output, kept)
            final = await streams[0].final()
        finally:
            streams[0].abort()
        raise_generation_errors([final], params)
        c = final.outputs[0]
        output.add(c.text, c.finish_reason, self._logprobs(c, params))
        self._finish(response, final, output, kept)
        return web.json_response(response, dumps=json_dumps)

    async def _truncate(self, conversation: list[dict], chat_body, stream: bool, logprobs: int | None,
                        error: APIError):
        """truncation 'auto': the conversation without as few of its oldest turns as make it fit
        the context, with what its chat request makes. System messages and the last turn stay; an
        assistant's tool calls go with their outputs. Found by bisection: a long history costs a
        few renders (of at most max_model_len messages: more never fit, at any conversation length).
        `error` is raised when even the shortest conversation is too long."""
        turns = []
        for i, m in enumerate(conversation):
            if m["role"] == "system":
                continue
            if m["role"] == "tool" and turns and conversation[turns[-1][0]].get("tool_calls"):
                turns[-1].append(i)
            else:
                turns.append([i])
        droppable = turns[:-1]

        async def attempt(k: int):
            gone = {i for turn in droppable[:k] for i in turn}
            messages = [m for i, m in enumerate(conversation) if i not in gone]
            try:
                return messages, await self._chat_request(chat_body(messages), stream, logprobs)
            except APIError as e:
                if e.code != "context_length_exceeded":
                    raise _renamed(e) from None
                return None

        lo, hi = 0, len(droppable)  # dropping lo turns is too long; find the fewest that fit
        left = len(conversation)  # each message is at least one token: more than the context never fit
        while lo < hi and left - len(droppable[lo]) > self.max_model_len:
            left -= len(droppable[lo])
            lo += 1
        best = await attempt(hi)
        if best is None:
            raise _renamed(error) from None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = await attempt(mid)
            if got is None:
                lo = mid
            else:
                hi, best = mid, got
        return best

    def _logprobs(self, c, params) -> list[dict] | None:
        if params.logprobs is None:
            return None
        return self.logprobs.chat(c, range(len(c.token_ids)), params.logprobs)["content"]

    async def retrieve_response(self, request):
        return web.json_response(self.responses.get(request.match_info["response_id"])[0], dumps=json_dumps)

    async def delete_response(self, request):
        response_id = request.match_info["response_id"]
        self.responses.pop(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def cancel_response(self, request):
        self.responses.get(request.match_info["response_id"])
        raise APIError("Cannot cancel a synchronous response: only background responses can be cancelled, and "
                       "this server runs none", param="response_id")

    def _finish(self, response: dict, final, output: OutputItems, conversation: list[dict] | None):
        """The response completed from the request's final output, and stored with the
        conversation it continues (None: not stored)."""
        c = final.outputs[0]
        response["output"] = output.items
        response["status"] = {"length": "incomplete", "abort": "cancelled"}.get(c.finish_reason, "completed")
        if c.finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        prompt_tokens, output_tokens = len(final.prompt_token_ids), len(c.token_ids)
        response["usage"] = {"input_tokens": prompt_tokens,
                             "input_tokens_details": {"cached_tokens": final.num_cached_tokens or 0},
                             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt_tokens + output_tokens}
        if conversation is not None and response["status"] != "cancelled":
            reply = output.as_message()
            self.responses.put(response, conversation + ([reply] if reply else []))

    async def _stream_response(self, request, response, stream, output: OutputItems, conversation: list[dict] | None):
        """Responses events (`event:` and `data:` lines, numbered from 0): response.created and
        .in_progress, the items' events as the text grows, then the whole response in
        response.completed, or in response.incomplete (as OpenAI sends it, with
        incomplete_details.reason "max_output_tokens") when max_output_tokens cut it short."""
        http = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await http.prepare(request)
        numbers = itertools.count()

        async def send(event: dict):
            event = {"type": event["type"], "sequence_number": next(numbers), **event}
            await http.write(f"event: {event['type']}\ndata: {json_dumps(event)}\n\n".encode())

        await send({"type": "response.created", "response": response})
        await send({"type": "response.in_progress", "response": response})
        try:
            async for out in stream:
                c = out.outputs[0]
                if c.finish_reason == "error":  # the grammar failed (raise_generation_errors' case)
                    await send({"type": "error", "code": "generation_error", "param": "text.format",
                                "message": f"structured output failed during generation: {c.stop_reason}"})
                    break
                for event in output.add(c.text, c.finish_reason, self._logprobs(c, stream.params)):
                    await send(event)
            else:
                self._finish(response, stream.total, output, conversation)
                kind = "incomplete" if response["status"] == "incomplete" else "completed"
                await send({"type": f"response.{kind}", "response": response})
        except ConnectionResetError:  # the client left: the caller aborts the request
            raise
        except Exception as e:  # the engine failed this request (or died): the stream says so and ends
            await send({"type": "error", "code": "server_error", "message": str(e), "param": None})
        await http.write_eof()
        return http
