"""POST /v1/chat/completions (vLLM's OpenAIServingChat): messages rendered by the chat template,
logprobs in chat's shape, tool calls (serving/tool_calls.py), whole responses and streams."""

import dataclasses
import time
import uuid

from aiohttp import web

from jpaged.sampling_params import SamplingParams
from serving import protocol, tool_calls
from serving.protocol import APIError, field
from serving.request_body import json_body
from serving.serving_engine import ChoiceState, OpenAIServing, json_dumps, raise_generation_errors


class OpenAIServingChat(OpenAIServing):
    async def _chat_request(self, body: dict, stream: bool, logprobs: int | None = None) \
            -> tuple[list[int], SamplingParams, tool_calls.ToolCalling | None]:
        """A chat body's prompt (token ids, or a ProcessedPrompt with images), sampling parameters
        and tool calling; every field is checked before the (costly) template is rendered and the
        images are loaded, and the context and the engine's limits after."""
        max_tokens = field(body, "max_completion_tokens", "integer")
        if max_tokens is None:
            max_tokens = field(body, "max_tokens", "integer")
        tools = tool_calls.parse_tools(body, self.tool_call_parser)
        params = protocol.sampling_params(body, max_tokens=1 if max_tokens is None else max_tokens, best_of=None,
                                          stream=stream, logprobs=logprobs, guided_json=tools and tools.schema)
        prompt = await self._encode_chat(body)  # token ids, or with images a ProcessedPrompt
        ids = getattr(prompt, "token_ids", prompt)
        if max_tokens is None:  # vLLM's default: whatever room the context leaves
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - len(ids)))
        self._check_context(len(ids), params.max_tokens, "messages")
        self._check_request(ids, params)
        return prompt, params, tools

    async def chat_completions(self, request):
        body = await json_body(request, self.body_timeout)
        lora_request = self._check_model(body, request)
        stream = protocol.parse_stream(body)
        want_logprobs = field(body, "logprobs", "boolean", False)
        top_logprobs = self._check_logprobs(field(body, "top_logprobs", "integer"), "top_logprobs")
        if top_logprobs is not None and not want_logprobs:
            raise APIError("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
        ids, params, tools = await self._chat_request(body, stream.stream,
                                                      (top_logprobs or 0) if want_logprobs else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._add_requests(request_id, [ids], params, lora_request)
        try:
            if stream.stream:
                states = [[ChoiceState() for _ in range(params.n)]]

                calls = [tool_calls.StreamedCalls(tools) for _ in range(params.n)] if tools else None

                def chunk(i, out, c, text, tokens):
                    delta, finish_reason = ({"content": text} if text else {}), c.finish_reason
                    if calls is not None:
                        delta, finish_reason = calls[c.index].delta(text, c.finish_reason)
                        if not delta and finish_reason is None and not want_logprobs:
                            return None  # text held back: it may begin a tool call
                    return {"index": c.index, "delta": delta,
                            "logprobs": self.logprobs.chat(c, tokens, params.logprobs) if want_logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason}

                return await self._stream(request, request_id, "chat.completion.chunk", streams, params, states,
                                          chunk, stream.include_usage,
                                          first_delta={"role": "assistant", "content": ""})
            final = await streams[0].final()
        finally:
            streams[0].abort()
        raise_generation_errors([final], params)
        choices = []
        for c in final.outputs:
            message, finish_reason = ({"role": "assistant", "content": c.text}, c.finish_reason) if tools is None \
                else tool_calls.message(c.text, tools, c.finish_reason)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self.logprobs.chat(c, range(len(c.token_ids)), params.logprobs)
                            if want_logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return web.json_response({"id": request_id, "object": "chat.completion", "created": int(time.time()),
                                  "model": request["model"], "choices": choices, "usage": self._usage([final])},
                                 dumps=json_dumps)
