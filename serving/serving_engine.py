"""What the OpenAI endpoints share (vLLM's OpenAIServing): the server's state, the checks of a
request against the model and the engine, tokenizing off the event loop, adding a request's
prompts to the engine, and streaming choices as server-sent events.

Handlers check the whole request before anything reaches the engine, tokenize prompts themselves
(to check the context length with both numbers), and abort their requests in `finally`: a client
that leaves (the handler is cancelled) frees its blocks before the next engine step.
"""

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import os
import time

from aiohttp import web

from jpaged.engine.llm_engine import StepFailedError
from jpaged.lora.request import LoRARequest
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import SamplingParams
from serving import protocol
from serving.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from serving.images import ServerImages
from serving.logprobs import LogprobFormatter
from serving.protocol import APIError, field
from serving.server_options import ServerOptions

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 tells clients to wait
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


class OpenAIServing:
    """The state and helpers of the endpoints (serving/completions.py, chat.py, tokenization.py)."""

    def __init__(self, engine: AsyncLLMEngine, options: ServerOptions):
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.vocab_size = engine.engine.hf_config.vocab_size
        self.max_model_len = engine.engine.max_model_len
        self.model_name, self.api_key, self.max_queue = options.served_model_name, options.api_key, options.max_queue
        self.profile_dir = options.profile_dir
        self.body_timeout, self.max_logprobs = options.timeout_keep_alive, options.max_logprobs
        self.chat_template = options.chat_template
        self.tool_call_parser = options.tool_call_parser if options.enable_auto_tool_choice else None
        self.exclude_tools_when_tool_choice_none = options.exclude_tools_when_tool_choice_none
        self.enable_prompt_tokens_details = options.enable_prompt_tokens_details
        if self.chat_template is not None and os.path.isfile(self.chat_template):
            with open(self.chat_template) as f:
                self.chat_template = f.read()
        self.created = int(time.time())
        self._template_renders_tools: bool | None = None  # found out with the first request that has tools
        # LoRA adapters served as models of their own (serving/lora.py): name -> LoRARequest.
        self.lora_requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(options.lora_modules)}
        self._next_lora_id = len(self.lora_requests) + 1
        # A text of C characters is at least C / (longest token's characters) tokens: prompts that
        # are surely too long are refused without tokenizing them.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.logprobs = LogprobFormatter(self.tokenizer)  # the choices' `logprobs`
        # Tokenizing and rendering chat templates is CPU work: one thread, off the event loop.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jpaged-tokenize")
        # Images in chat messages (serving/images.py); a VLM checkpoint may keep its template in its processor.
        self.images = ServerImages(engine, self.model_name, self._tokenize_pool)
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            self.chat_template = self.images.chat_template

    def _usage(self, finals: list[RequestOutput]) -> dict:
        usage = protocol.usage(sum(len(o.prompt_token_ids) for o in finals),
                               sum(len(c.token_ids) for o in finals for c in o.outputs))
        if self.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens or 0 for o in finals)}
        return usage

    async def _encode_chat(self, body: dict) -> "list[int] | ProcessedPrompt":
        """The messages' prompt token ids; with images, a ProcessedPrompt (its token_ids hold each
        image's placeholder tokens), the images loaded and processed off the event loop."""
        chat = self.images.find(body.get("messages"))  # image parts out, {"type": "image"} in their place
        messages = protocol.parse_messages({**body, "messages": chat.messages}, max_messages=self.max_model_len)
        add_generation_prompt = field(body, "add_generation_prompt", "boolean", True)
        tools = body.get("tools") or None  # the template tells the model about them (parse_tools checked them)
        if self.exclude_tools_when_tool_choice_none and body.get("tool_choice") == "none":
            tools = None
        self._check_text_length(sum(len(m["content"]) if isinstance(m["content"], str) else
                                    sum(len(p.get("text", "")) for p in m["content"]) for m in messages), "messages")

        def render(tools) -> str:
            try:
                return self.tokenizer.apply_chat_template(messages, tools=tools,
                                                          add_generation_prompt=add_generation_prompt,
                                                          tokenize=False, chat_template=self.chat_template)
            except Exception as e:  # jinja errors, a missing template: the messages cannot be rendered
                raise APIError(f"the chat template could not render the messages: {e}", param="messages") from None

        def render_and_check() -> str:
            text = render(tools)
            if tools and self._template_renders_tools is None:  # once: the template is the server's
                self._template_renders_tools = text != render(None)
                if not self._template_renders_tools:
                    logger.warning("the chat template does not render 'tools': the model is not told which tools "
                                   "it may call (tool_choice 'required' and named functions still constrain the "
                                   "output to them). Pass a template that renders tools: --chat-template hermes, "
                                   "llama3_json or mistral (shipped with jpaged, matching --tool-call-parser), or "
                                   "a FILE")
            return text

        text = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, render_and_check)
        if chat.images:  # the processor tokenizes the text and expands each image's placeholder
            self._check_text_length(len(text), "messages")
            return await self.images.prompt(text, chat)
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

    def _check_model(self, body: dict, request=None) -> LoRARequest | None:
        """The adapter the request's `model` names (None: the base model); 404 if it names neither.
        The name the response carries is kept in `request["model"]` (an adapter's: its own)."""
        model = field(body, "model", "string")
        lora = None
        if model is not None and model != self.model_name:
            lora = self.lora_requests.get(model)
            if lora is None:
                raise APIError(f"The model `{model}` does not exist.", status=404, param="model",
                               code="model_not_found")
        if request is not None:
            request["model"] = self.model_name if lora is None else lora.lora_name
        return lora

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

    async def _add_requests(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                            lora_request: LoRARequest | None = None) -> list[RequestStream]:
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
                streams.append(await self.engine.add_request(f"{request_id}-{i}", ids, params, lora_request))
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
            event = {"id": request_id, "object": kind, "created": created, "model": request["model"],
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
                await send([], usage=self._usage([s.total for s in streams]))
        except ConnectionResetError:  # the client left: the caller aborts its requests
            raise
        except Exception as e:  # the engine failed this request (or died): the stream says so and ends
            if not isinstance(e, (EngineDeadError, StepFailedError)):
                logger.exception("stream %s failed", request_id)
            await response.write(f"data: {json_dumps(APIError(str(e), status=500).to_json())}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _generation_error(params: SamplingParams, c: CompletionOutput) -> APIError:
    """A completion that ended with finish_reason "error": its grammar engine failed mid-way (the
    only cause today), so the request's grammar is named."""
    guide = next((name for name in ("guided_json", "guided_regex", "guided_choice")
                  if getattr(params, name) is not None), None)
    return APIError(f"structured output ({guide}) failed during generation of choice {c.index}: {c.stop_reason}",
                    param=guide, code="generation_error")


def raise_generation_errors(finals: list[RequestOutput], params: SamplingParams):
    """A whole response with a completion that ended in error is a 400, not a 200 with text that
    breaks its grammar."""
    for out in finals:
        for c in out.outputs:
            if c.finish_reason == "error":
                raise _generation_error(params, c)


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



