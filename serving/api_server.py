"""The OpenAI-compatible HTTP server (aiohttp) in front of the AsyncLLMEngine.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /tokenize, POST /detokenize, GET /metrics, GET /kv (serving/kv_page.py). Handlers check
the whole request before anything reaches the engine, tokenize prompts themselves (to check the
context length with both numbers), and abort their requests in `finally`: a client that leaves
(the handler is cancelled) frees its blocks before the next engine step.
"""

import asyncio
import codecs
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import signal
import ssl
import sys
import threading
import time
import uuid
import zlib
from http import HTTPStatus

from aiohttp import web, web_protocol

from jpaged.config import EngineConfig
from jpaged.core.detokenizer import token_bytes_fn
from jpaged.engine.llm_engine import LLMEngine, StepFailedError
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import SamplingParams
from serving import kv_page, protocol, tool_calls
from serving.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from serving.metrics import Metrics
from serving.protocol import APIError, field

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20  # larger bodies get a 413
# Seconds a connection may sit idle or take to send a whole request (vLLM's --timeout-keep-alive):
# then a half-sent head closes the connection and a half-sent body gets a 408.
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 30
MAX_PROMPTS = 1024  # prompts in one completions request
RETRY_AFTER_S = 1  # what a 503 tells clients to wait
# Logprobs of impossible tokens are -inf, which JSON cannot carry: report them as vLLM does.
MIN_LOGPROB = -9999.0
json_dumps = functools.partial(json.dumps, allow_nan=False)  # NaN / Infinity are not JSON


@dataclasses.dataclass
class ChoiceState:
    """Whether one streamed choice has ended."""

    done: bool = False

    def advance(self, c: CompletionOutput, with_tokens: bool) -> tuple[str, range] | None:
        """The text and token positions of the DELTA output `c` to send; None when there is
        nothing to send (no new text, no new tokens whose logprobs are wanted, not finished, or
        finished before). The engine holds back text that might still become a stop string."""
        if self.done:
            return None
        self.done = c.finish_reason is not None
        if not c.text and not (with_tokens and c.token_ids) and not self.done:
            return None
        return c.text, range(len(c.token_ids))


class OpenAIServer:
    def __init__(self, engine: AsyncLLMEngine, options: "ServerOptions"):
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.vocab_size = engine.engine.hf_config.vocab_size
        self.max_model_len = engine.engine.max_model_len
        self.model_name, self.api_key, self.max_queue = options.served_model_name, options.api_key, options.max_queue
        self.body_timeout, self.max_logprobs = options.timeout_keep_alive, options.max_logprobs
        self.chat_template = options.chat_template
        self.tool_call_parser = options.tool_call_parser if options.enable_auto_tool_choice else None
        if self.chat_template is not None and os.path.isfile(self.chat_template):
            with open(self.chat_template) as f:
                self.chat_template = f.read()
        self.created = int(time.time())
        # A text of C characters is at least C / (longest token's characters) tokens: prompts that
        # are surely too long are refused without tokenizing them.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.token_bytes = token_bytes_fn(self.tokenizer)  # logprobs' `bytes`: a token's own, even half a character
        # Tokenizing and rendering chat templates is CPU work: one thread, off the event loop.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jpaged-tokenize")

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/metrics", self.metrics)
        kv_page.add_routes(app, self.engine, self.model_name)
        return app

    # ------------------------------------------------------------------ middlewares
    @web.middleware
    async def _errors(self, request, handler):
        """Every error leaves in OpenAI's shape, whatever raised it."""
        try:
            return await handler(request)
        except APIError as e:
            error = e
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            if e.status < 400:
                raise
            error = APIError(e.reason, status=e.status)
        except (EngineDeadError, StepFailedError) as e:
            error = APIError(str(e), status=500)
        except ConnectionResetError:  # the client left (a stream's headers found the socket closing)
            return web.Response(status=499)  # nginx's "client closed request", for the access log only
        except Exception as e:  # a bug: say so in the same shape, keep serving
            logger.exception("%s %s failed", request.method, request.path)
            error = APIError(f"internal error: {e!r}", status=500)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
        return web.json_response(error.to_json(), status=error.status, headers=headers, dumps=json_dumps)

    @web.middleware
    async def _auth(self, request, handler):
        if self.api_key is not None and request.path.startswith("/v1/"):
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                raise APIError("Incorrect API key provided.", status=401, code="invalid_api_key")
        return await handler(request)

    # ------------------------------------------------------------------ simple endpoints
    async def health(self, request):
        if self.engine.dead is not None:
            raise APIError(f"the engine stopped after an error: {self.engine.dead!r}", status=503)
        return web.Response(status=200)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        self._check_model({"model": request.match_info["model"]})
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "jpaged",
                "root": self.engine.engine.config.model, "max_model_len": self.max_model_len}

    async def metrics(self, request):
        kv_usage = await self.engine.call(lambda e: e.kv_usage()) if self.engine.dead is None else None
        return web.Response(body=self.engine.metrics.render(self.engine.stats, kv_usage).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def tokenize(self, request):
        body = await _json_body(request, self.body_timeout)
        self._check_model(body)
        if "messages" in body:
            ids = await self._encode_chat(body)
        else:
            prompt = field(body, "prompt", "string", required=True)
            ids = await self._encode(prompt, "prompt", add_special_tokens=field(body, "add_special_tokens",
                                                                                "boolean", True))
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def detokenize(self, request):
        body = await _json_body(request, self.body_timeout)
        self._check_model(body)
        tokens = body.get("tokens")
        if isinstance(tokens, list) and len(tokens) > self.max_model_len:
            raise APIError(f"'tokens' holds {len(tokens)} token ids; at most max_model_len={self.max_model_len}",
                           param="tokens")
        ids = field(body, "tokens", "array of integers", required=True)
        self._check_token_ids(ids, "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    # ------------------------------------------------------------------ completions
    async def completions(self, request):
        body = await _json_body(request, self.body_timeout)
        self._check_model(body)
        prompts = protocol.parse_prompts(body, max_prompts=MAX_PROMPTS, max_tokens=self.max_model_len)
        stream = protocol.parse_stream(body)
        echo = field(body, "echo", "boolean", False)
        logprobs = self._check_logprobs(field(body, "logprobs", "integer"), "logprobs")
        max_tokens = field(body, "max_tokens", "integer", 16)
        # echo with max_tokens 0 (lm-eval's loglikelihood): the prompt alone; one token is computed, not sent.
        prompt_only = echo and max_tokens == 0
        params = protocol.sampling_params(body, max_tokens=1 if prompt_only else max_tokens, logprobs=logprobs,
                                          best_of=field(body, "best_of", "integer"), stream=stream.stream,
                                          prompt_logprobs=logprobs if echo else None)
        token_prompts = []
        for p in prompts:
            if isinstance(p, str):
                ids = await self._encode(p, "prompt", max_tokens=params.max_tokens)
            else:
                ids = p  # _check_request checks them against the vocabulary
            self._check_context(len(ids), params.max_tokens, "prompt")
            self._check_request(ids, params)
            token_prompts.append(ids)
        echoes = [(p if isinstance(p, str) else self.tokenizer.decode(p)) if echo else "" for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._add_requests(request_id, token_prompts, params)
        try:
            if stream.stream:
                return await self._stream_completions(request, request_id, streams, params, echoes,
                                                      stream.include_usage, prompt_only)
            finals = await asyncio.gather(*(s.final() for s in streams))
        finally:
            for s in streams:
                s.abort()
        _raise_generation_errors(finals, params)
        if prompt_only:
            finals = [dataclasses.replace(out, outputs=[dataclasses.replace(c, text="", token_ids=[], logprobs=[])
                                                        for c in out.outputs]) for out in finals]
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choice_logprobs = None
                if logprobs is not None and echo:  # the prompt's tokens first, then the completion's
                    prompt = self._prompt_logprobs(out, logprobs)
                    completion = self._completion_logprobs(c, range(len(c.token_ids)), sum(map(len, prompt["tokens"])))
                    choice_logprobs = {k: prompt[k] + completion[k] for k in prompt}
                elif logprobs is not None:
                    choice_logprobs = self._completion_logprobs(c, range(len(c.token_ids)), len(echoes[i]))
                choices.append({"index": i * params.n + c.index, "text": echoes[i] + c.text,
                                "logprobs": choice_logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return web.json_response({"id": request_id, "object": "text_completion", "created": int(time.time()),
                                  "model": self.model_name, "choices": choices, "usage": _usage(finals)},
                                 dumps=json_dumps)

    async def _stream_completions(self, request, request_id, streams, params, echoes, include_usage, prompt_only):
        states = [[ChoiceState() for _ in range(params.n)] for _ in streams]
        offsets = [[len(e)] * params.n for e in echoes]  # text_offset of the next token
        echoed = set()

        def chunk(i, out, c, text, tokens):
            if prompt_only:  # echo with max_tokens 0: the token computed is not sent
                text, tokens = "", range(0)
            first = (i, c.index) not in echoed  # the choice's first chunk carries the echoed prompt
            echoed.add((i, c.index))
            logprobs = None
            if params.logprobs is not None:
                # echo: the prompt's logprobs come first, as in the whole response
                prompt = self._prompt_logprobs(out, params.logprobs) if first and params.prompt_logprobs is not None \
                    else None
                if prompt is not None:
                    offsets[i][c.index] = sum(map(len, prompt["tokens"]))
                logprobs = self._completion_logprobs(c, tokens, offsets[i][c.index])
                offsets[i][c.index] += sum(len(t) for t in logprobs["tokens"])
                if prompt is not None:
                    logprobs = {k: prompt[k] + logprobs[k] for k in prompt}
            if first:
                text = echoes[i] + text
            return {"index": i * params.n + c.index, "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

        return await self._stream(request, request_id, "text_completion", streams, params, states, chunk,
                                  include_usage, first_delta=None)

    # ------------------------------------------------------------------ chat
    async def chat_completions(self, request):
        body = await _json_body(request, self.body_timeout)
        self._check_model(body)
        stream = protocol.parse_stream(body)
        want_logprobs = field(body, "logprobs", "boolean", False)
        top_logprobs = self._check_logprobs(field(body, "top_logprobs", "integer"), "top_logprobs")
        if top_logprobs is not None and not want_logprobs:
            raise APIError("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
        max_tokens = field(body, "max_completion_tokens", "integer")
        if max_tokens is None:
            max_tokens = field(body, "max_tokens", "integer")
        tools = tool_calls.parse_tools(body, self.tool_call_parser)
        # Every field is checked before the (costly) template is rendered.
        params = protocol.sampling_params(body, max_tokens=1 if max_tokens is None else max_tokens, best_of=None,
                                          stream=stream.stream, logprobs=(top_logprobs or 0) if want_logprobs else None,
                                          guided_json=tools and tools.schema)
        ids = await self._encode_chat(body)
        if max_tokens is None:  # vLLM's default: whatever room the context leaves
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - len(ids)))
        self._check_context(len(ids), params.max_tokens, "messages")
        self._check_request(ids, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._add_requests(request_id, [ids], params)
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
                            "logprobs": self._chat_logprobs(c, tokens, params.logprobs) if want_logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason}

                return await self._stream(request, request_id, "chat.completion.chunk", streams, params, states,
                                          chunk, stream.include_usage,
                                          first_delta={"role": "assistant", "content": ""})
            final = await streams[0].final()
        finally:
            streams[0].abort()
        _raise_generation_errors([final], params)
        choices = []
        for c in final.outputs:
            message, finish_reason = ({"role": "assistant", "content": c.text}, c.finish_reason) if tools is None \
                else tool_calls.message(c.text, tools, c.finish_reason)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c, range(len(c.token_ids)), params.logprobs)
                            if want_logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return web.json_response({"id": request_id, "object": "chat.completion", "created": int(time.time()),
                                  "model": self.model_name, "choices": choices, "usage": _usage([final])},
                                 dumps=json_dumps)

    async def _encode_chat(self, body: dict) -> list[int]:
        messages = protocol.parse_messages(body, max_messages=self.max_model_len)
        add_generation_prompt = field(body, "add_generation_prompt", "boolean", True)
        tools = body.get("tools") or None  # the template tells the model about them (parse_tools checked them)
        self._check_text_length(sum(len(m["content"]) for m in messages), "messages")

        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                          tokenize=False, chat_template=self.chat_template)
            except Exception as e:  # jinja errors, a missing template: the messages cannot be rendered
                raise APIError(f"the chat template could not render the messages: {e}", param="messages") from None

        text = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, render)
        # The template writes its own special tokens (BOS); don't add them twice.
        return await self._encode(text, "messages", add_special_tokens=False)

    async def _encode(self, text: str, param: str, *, add_special_tokens: bool = True,
                      max_tokens: int = 0) -> list[int]:
        """Token ids of `text`, tokenized off the event loop; a text surely longer than the context
        is refused first, without tokenizing it."""
        self._check_text_length(len(text), param, max_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    def _check_text_length(self, num_chars: int, param: str, max_tokens: int = 0):
        min_tokens = math.ceil(num_chars / self.max_token_chars)
        if min_tokens > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, the "
                           f"{param} has {num_chars} characters: at least {min_tokens} tokens. Please reduce the "
                           "length of the prompt.", param=param, code="context_length_exceeded")

    # ------------------------------------------------------------------ shared
    def _check_model(self, body: dict):
        model = field(body, "model", "string")
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")

    def _check_logprobs(self, value: int | None, param: str) -> int | None:
        if value is not None and not 0 <= value <= self.max_logprobs:
            raise APIError(f"{param}={value}; expected an int in [0, max_logprobs={self.max_logprobs}]", param=param)
        return value

    def _check_token_ids(self, ids: list[int], param: str):
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)

    def _check_context(self, prompt_len: int, max_tokens: int, param: str):
        if prompt_len + max_tokens > self.max_model_len:
            raise protocol.context_length_error(self.max_model_len, prompt_len, max_tokens, param)

    def _check_request(self, ids: list[int], params: SamplingParams):
        """The engine's own limits (n and best_of, the KV pool, the vocabulary), before anything
        is built for the request."""
        try:
            self.engine.engine.check_request(ids, params)
        except ValueError as e:
            raise APIError(str(e), param=protocol.param_of(str(e))) from None

    async def _add_requests(self, request_id: str, prompts: list[list[int]],
                            params: SamplingParams) -> list[RequestStream]:
        """All of the request's prompts, or none (a rejected one aborts those already added)."""
        if self.max_queue is not None:
            waiting = self.engine.stats["num_waiting"] + self.engine.num_pending_adds
            if waiting + len(prompts) > self.max_queue:
                raise APIError(f"the server is busy: {waiting} requests are waiting (max_queue={self.max_queue}); "
                               f"retry in {RETRY_AFTER_S} s", status=503, code="queue_full")
        streams = []
        try:
            if params.guided:  # compiled here, in a thread, under its budget: the loop and the engine never wait
                await asyncio.to_thread(self.engine.engine.structured_output.prepare, params)
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", ids, params))
        except ValueError as e:
            raise APIError(str(e), param=protocol.param_of(str(e))) from None
        finally:
            if len(streams) < len(prompts):
                for s in streams:
                    s.abort()
        return streams

    async def _stream(self, request, request_id, kind, streams, params, states, chunk, include_usage, first_delta):
        """Server-sent events: one `data: {json}` per new piece of each choice, `data: [DONE]` last."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())

        async def send(choices, **extra):
            event = {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                     "choices": choices, **extra}
            if include_usage and "usage" not in extra:
                event["usage"] = None
            await response.write(f"data: {json_dumps(event)}\n\n".encode())

        if first_delta is not None:
            await send([{"index": i, "delta": first_delta, "logprobs": None, "finish_reason": None}
                        for i in range(params.n)])
        try:
            errors = []
            async for i, out in _merge(streams):  # DELTA outputs; the stream's total has the prompt's logprobs
                for c in out.outputs:
                    new = states[i][c.index].advance(c, params.logprobs is not None)
                    if new is not None and (choice := chunk(i, streams[i].total, c, *new)) is not None:
                        await send([choice])
                    if c.finish_reason == "error":
                        errors.append(_generation_error(params, c))
            for error in errors:  # after the choice's last chunk (finish_reason "error"): why it ended
                await response.write(f"data: {json_dumps(error.to_json())}\n\n".encode())
            if include_usage:
                await send([], usage=_usage([s.total for s in streams]))
        except ConnectionResetError:  # the client left: the caller aborts its requests
            raise
        except Exception as e:  # the engine failed this request (or died): the stream says so and ends
            if not isinstance(e, (EngineDeadError, StepFailedError)):
                logger.exception("stream %s failed", request_id)
            await response.write(f"data: {json_dumps(APIError(str(e), status=500).to_json())}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, c: CompletionOutput, tokens: range, offset: int) -> dict:
        texts = [self._token_text(c.token_ids[t]) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": [_json_logprob(c.logprobs[t][c.token_ids[t]]) for t in tokens],
                "top_logprobs": [self._top_logprobs(c.logprobs[t], c.token_ids[t]) for t in tokens],
                "text_offset": offsets}

    def _top_logprobs(self, logprobs: dict[int, float], chosen: int, top: int | None = None) -> dict[str, float]:
        """A completions `top_logprobs` entry, {token text: logprob}: the `top` likeliest of
        `logprobs` (None: all) and the `chosen` token, likeliest first. Distinct tokens can decode
        to the same text (each byte of a multi-byte character decodes alone to "\ufffd"); a text
        already taken keys its token as "token_id:N" (vLLM's --return-tokens-as-token-ids form),
        so no entry is lost and the chosen token keeps its own text, the one in `tokens`."""
        ranked = sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:top]
        if chosen not in dict(ranked):
            ranked.append((chosen, logprobs[chosen]))
        keys = {chosen: self._token_text(chosen)}
        taken = set(keys.values())
        for token_id, _ in ranked:
            if token_id not in keys:
                text = self._token_text(token_id)
                keys[token_id] = text if text not in taken else f"token_id:{token_id}"
                taken.add(keys[token_id])
        return {keys[token_id]: _json_logprob(logprob) for token_id, logprob in ranked}

    def _prompt_logprobs(self, out: RequestOutput, top: int) -> dict:
        """OpenAI's completion logprobs of the prompt's tokens (echo): the first has none."""
        texts = [self._token_text(t) for t in out.prompt_token_ids]
        offsets = [0, *itertools.accumulate(map(len, texts[:-1]))]
        entries = out.prompt_logprobs or [None] * len(texts)
        return {"tokens": texts,
                "token_logprobs": [None if e is None else _json_logprob(e[t]) for e, t in zip(entries, out.prompt_token_ids)],
                "top_logprobs": [None if e is None else self._top_logprobs(e, t, max(top, 1))
                                 for e, t in zip(entries, out.prompt_token_ids)],
                "text_offset": offsets}

    def _chat_logprobs(self, c: CompletionOutput, tokens: range, top: int) -> dict:
        def entry(token_id, logprob):
            text = self._token_text(token_id)
            return {"token": text, "logprob": _json_logprob(logprob), "bytes": list(self.token_bytes(token_id))}

        content = []
        for t in tokens:
            ranked = sorted(c.logprobs[t].items(), key=lambda kv: kv[1], reverse=True)[:top]
            content.append({**entry(c.token_ids[t], c.logprobs[t][c.token_ids[t]]),
                            "top_logprobs": [entry(k, v) for k, v in ranked]})
        return {"content": content}


def _generation_error(params: SamplingParams, c: CompletionOutput) -> APIError:
    """A completion that ended with finish_reason "error": its grammar engine failed mid-way (the
    only cause today), so the request's grammar is named."""
    guide = next((name for name in ("guided_json", "guided_regex", "guided_choice")
                  if getattr(params, name) is not None), None)
    return APIError(f"structured output ({guide}) failed during generation of choice {c.index}: {c.stop_reason}",
                    param=guide, code="generation_error")


def _raise_generation_errors(finals: list[RequestOutput], params: SamplingParams):
    """A whole response with a completion that ended in error is a 400, not a 200 with text that
    breaks its grammar."""
    for out in finals:
        for c in out.outputs:
            if c.finish_reason == "error":
                raise _generation_error(params, c)


def _json_logprob(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN fails the test too


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def _json_body(request, timeout: float) -> dict:
    """The body as a JSON object; anything else (a slow, undecodable, malformed or hostile body) is
    a 4xx in OpenAI's shape."""
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise APIError(f"the request body was not received within {timeout:g} s", status=408,
                       code="request_timeout") from None
    except web.HTTPException:  # 413: too large
        raise
    except Exception as e:  # a corrupt compressed body, a broken transfer encoding
        raise APIError(f"the request body could not be read: {e}", code="invalid_body") from None
    raw = _decompress(raw, request.headers.get("Content-Encoding"))
    charset = _body_charset(request.charset)
    try:
        text = raw.decode(charset)
    except UnicodeError as e:
        raise APIError(f"the request body could not be decoded as {charset}: {e}", code="invalid_body") from None
    # Parsing up to MAX_BODY_BYTES takes a while: in a thread, so the event loop keeps answering.
    body = await asyncio.to_thread(_parse_json, text)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    return body


# Charsets a body may declare (JSON is UTF-8, RFC 8259; the rest are its Unicode siblings and
# ASCII's supersets). Not every Python codec: "undefined" fails on any input, "rot13" or "base64"
# are not text encodings, and "punycode" takes quadratic time (a 16 MiB body: hours).
BODY_CHARSETS = frozenset({"utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le",
                           "utf-32-be", "ascii", "iso8859-1", "cp1252"})  # codecs.lookup(...).name


def _body_charset(declared: str | None) -> str:
    """The codec for a body's `Content-Type: ...; charset=X` (none: UTF-8); a 400 naming X for a
    charset that is unknown or not one of BODY_CHARSETS."""
    if declared is None:
        return "utf-8"
    try:
        name = codecs.lookup(declared).name
    except (LookupError, ValueError):  # ValueError: a name with a NUL in it
        name = None
    if name not in BODY_CHARSETS:
        raise APIError(f"the request body's charset {declared!r:.80} is not supported; send JSON as UTF-8",
                       param="Content-Type", code="unsupported_charset")
    return name


def _decompress(raw: bytes, encoding: str | None) -> bytes:
    """The body without its Content-Encoding. Decoded here, not by aiohttp, so that a corrupt
    body is a 400 in OpenAI's shape and a decompression bomb stops at MAX_BODY_BYTES."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return raw
    wbits = {"gzip": 31, "x-gzip": 31, "deflate": 15}.get(encoding)
    if wbits is None:
        raise APIError(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)", status=415,
                       code="unsupported_encoding")
    for bits in (wbits, -15) if encoding == "deflate" else (wbits,):  # "deflate": zlib-wrapped, or raw
        decoder = zlib.decompressobj(bits)
        try:
            body = decoder.decompress(raw, MAX_BODY_BYTES + 1)
        except zlib.error:
            continue
        if len(body) > MAX_BODY_BYTES:
            raise APIError(f"the decompressed body exceeds {MAX_BODY_BYTES} bytes", status=413)
        if decoder.eof:
            return body
    raise APIError(f"the request body is not valid {encoding} data", code="invalid_body")


def _parse_json(text: str):
    protocol.check_json_depth(text, None, "the request body")  # before json.loads recurses
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError("the request body nests arrays or objects too deeply", code="invalid_json") from None
    except ValueError as e:  # malformed JSON, NaN / Infinity, an integer of more than 4300 digits
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    _check_strings(body)
    return body


def _check_strings(value):
    """A 400 for strings that are not Unicode text: a lone surrogate ("\\ud800") survives JSON but
    not UTF-8, which every tokenizer needs."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(f"the request contains a string that is not valid Unicode ({e.reason} at "
                               f"character {e.start}): {item[max(0, e.start - 20):e.start + 20]!r}",
                               code="invalid_string") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


async def _merge(streams: list[RequestStream]):
    """(index, output) from several streams as they arrive, until all have finished."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(finals: list[RequestOutput]) -> dict:
    return protocol.usage(sum(len(o.prompt_token_ids) for o in finals),
                          sum(len(c.token_ids) for o in finals for c in o.outputs))


# ---------------------------------------------------------------------- running it
@dataclasses.dataclass
class ServerOptions:
    """What `jpaged serve` takes besides the engine's options (vLLM's flag names)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "tiny"
    api_key: str | None = None
    max_queue: int | None = None
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    chat_template: str | None = None  # a template, or a file holding one
    max_logprobs: int = 20
    enable_auto_tool_choice: bool = False  # tool_choice "auto", read by tool_call_parser
    tool_call_parser: str | None = None  # one of tool_calls.TOOL_CALL_PARSERS
    log_requests: bool = True
    log_stats: bool = True
    allowed_origins: str | None = None  # comma-separated, or "*"
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None


STATS_INTERVAL_S = 10


class _RequestHandler(web_protocol.RequestHandler):
    """aiohttp answers requests it cannot parse (a bad request line, oversized headers, a broken
    chunked body) before any middleware runs, in plain text: answer in OpenAI's shape instead."""

    def handle_error(self, request, status=500, exc=None, message=None):
        super().handle_error(request, status, exc, message)  # logs, and refuses if a response began
        reason = HTTPStatus(status).phrase
        response = web.json_response(APIError(f"{reason}: {exc or message or reason}", status=status).to_json(),
                                     status=status)
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


class _AppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server, making our request handlers
        return server


async def _log_stats(async_engine: AsyncLLMEngine):
    """vLLM's periodic line: throughput since the last line, queues and KV cache usage."""
    metrics = async_engine.metrics
    last = (time.monotonic(), metrics.prompt_tokens, metrics.generation_tokens)
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        now, prompt, generation = time.monotonic(), metrics.prompt_tokens, metrics.generation_tokens
        stats = async_engine.stats
        busy = stats["num_running"] or stats["num_waiting"] or stats["num_swapped"]
        if busy or (prompt, generation) != last[1:]:
            elapsed = now - last[0]
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Swapped: %d reqs, Pending: %d reqs, GPU KV cache usage: %.1f%%, "
                        "CPU KV cache usage: %.1f%%", (prompt - last[1]) / elapsed, (generation - last[2]) / elapsed,
                        stats["num_running"], stats["num_swapped"], stats["num_waiting"],
                        100 * (1 - stats["num_free_gpu_blocks"] / stats["num_gpu_blocks"]),
                        100 * (1 - stats["num_free_cpu_blocks"] / max(stats["num_cpu_blocks"], 1)))
        last = (now, prompt, generation)


def _cors(allowed_origins: str):
    origins = {o.strip() for o in allowed_origins.split(",") if o.strip()}

    @web.middleware
    async def cors(request, handler):
        origin = request.headers.get("Origin")
        allowed = origin is not None and ("*" in origins or origin in origins)
        if request.method == "OPTIONS" and allowed:  # preflight
            response = web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
                "Access-Control-Max-Age": "600"})
        else:
            response = await handler(request)
        if allowed:
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in origins else origin
            response.headers["Vary"] = "Origin"
        return response

    return cors


async def serve(engine: LLMEngine, options: ServerOptions) -> int:
    """Serve until SIGTERM or SIGINT (then stop accepting, abort in-flight requests and return 0)
    or until the engine dies (then return 1, so that a supervisor restarts the server)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # first thing: they replace run_server's start-up handler
        loop.add_signal_handler(sig, stop.set)
    async_engine = AsyncLLMEngine(engine, Metrics(options.served_model_name))
    async_engine.on_dead = stop.set
    async_engine.start()
    app = OpenAIServer(async_engine, options).build_app()
    if options.allowed_origins:
        app.middlewares.insert(0, _cors(options.allowed_origins))
    # keepalive_timeout also closes connections that never finish sending their headers (slowloris).
    runner = _AppRunner(app, handler_cancellation=True, keepalive_timeout=options.timeout_keep_alive,
                           auto_decompress=False,  # _json_body decompresses, with limits and JSON errors
                           access_log=logging.getLogger("jpaged.access") if options.log_requests else None,
                           access_log_format='%a "%r" %s %b %Tfs')
    await runner.setup()
    ssl_context = None
    if options.ssl_certfile:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(options.ssl_certfile, options.ssl_keyfile)
    site = web.TCPSite(runner, options.host, options.port, ssl_context=ssl_context)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    scheme = "https" if ssl_context else "http"
    print(f"jpaged: serving {options.served_model_name!r} at {scheme}://{bound_host}:{bound_port}/v1 "
          "(OpenAI API; also /health, /metrics, /kv, /tokenize, /detokenize)", flush=True)
    stats_task = asyncio.create_task(_log_stats(async_engine)) if options.log_stats else None
    await stop.wait()  # already set by a signal during the set-up: shut down at once
    if async_engine.dead is not None:
        print(f"jpaged: the engine failed ({async_engine.dead!r}); exiting", flush=True)
    else:
        print("jpaged: shutting down", flush=True)
    if stats_task is not None:
        stats_task.cancel()
    await site.stop()  # no new connections
    await async_engine.shutdown()  # in-flight requests end with finish_reason "abort"
    await runner.cleanup()
    return 0 if async_engine.dead is None else 1


# After SIGTERM / SIGINT during start-up, how long the start-up may take to unwind (the compiles
# already queued finish) before the process exits without waiting for them.
START_UP_EXIT_GRACE_S = 10


def _exit_now(*_):
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _exit_during_start_up(signum, frame):
    """SIGTERM or SIGINT while the engine loads and compiles (before the server listens): exit 0,
    as after serving, not killed by the signal (-15) or with a KeyboardInterrupt traceback.
    SystemExit unwinds the start-up in the main thread (the executable cache removes its loading
    marker, so the next start still loads from it); a second signal, or START_UP_EXIT_GRACE_S
    later, exits at once."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_now)
    timer = threading.Timer(START_UP_EXIT_GRACE_S, _exit_now)
    timer.daemon = True
    timer.start()
    print(f"jpaged: {signal.Signals(signum).name} during start-up; exiting", flush=True)
    raise SystemExit(0)


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    """Serve; returns the process exit status (0 after SIGTERM / SIGINT, also during start-up; 1
    if the engine died)."""
    if threading.current_thread() is threading.main_thread():  # serve() installs its own once it runs
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_during_start_up)
    engine = LLMEngine(config)  # loads the weights and compiles every step shape before we listen
    # Multi-host: process 0 serves HTTP; the other processes run its device steps until it stops.
    return engine.runner.lead(lambda: asyncio.run(serve(engine, options)))
