"""POST /v1/completions (vLLM's OpenAIServingCompletion): prompts (texts or token ids, several
at once), echo (with the prompt's logprobs), whole responses and streams."""

import asyncio
import dataclasses
import time
import uuid

from aiohttp import web

from serving import protocol
from serving.protocol import field
from serving.request_body import json_body
from serving.serving_engine import ChoiceState, OpenAIServing, json_dumps, raise_generation_errors

MAX_PROMPTS = 1024  # prompts in one completions request


class OpenAIServingCompletion(OpenAIServing):
    async def completions(self, request):
        body = await json_body(request, self.body_timeout)
        lora_request = self._check_model(body, request)
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
        streams = await self._add_requests(request_id, token_prompts, params, lora_request)
        try:
            if stream.stream:
                return await self._stream_completions(request, request_id, streams, params, echoes,
                                                      stream.include_usage, prompt_only)
            finals = await asyncio.gather(*(s.final() for s in streams))
        finally:
            for s in streams:
                s.abort()
        raise_generation_errors(finals, params)
        if prompt_only:
            finals = [dataclasses.replace(out, outputs=[dataclasses.replace(c, text="", token_ids=[], logprobs=[])
                                                        for c in out.outputs]) for out in finals]
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choice_logprobs = None
                if logprobs is not None and echo:  # the prompt's tokens first, then the completion's
                    prompt = self.logprobs.prompt(out, logprobs)
                    completion = self.logprobs.completion(c, range(len(c.token_ids)), sum(map(len, prompt["tokens"])))
                    choice_logprobs = {k: prompt[k] + completion[k] for k in prompt}
                elif logprobs is not None:
                    choice_logprobs = self.logprobs.completion(c, range(len(c.token_ids)), len(echoes[i]))
                choices.append({"index": i * params.n + c.index, "text": echoes[i] + c.text,
                                "logprobs": choice_logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return web.json_response({"id": request_id, "object": "text_completion", "created": int(time.time()),
                                  "model": request["model"], "choices": choices, "usage": self._usage(finals)},
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
                prompt = self.logprobs.prompt(out, params.logprobs) if first and params.prompt_logprobs is not None \
                    else None
                if prompt is not None:
                    offsets[i][c.index] = sum(map(len, prompt["tokens"]))
                logprobs = self.logprobs.completion(c, tokens, offsets[i][c.index])
                offsets[i][c.index] += sum(len(t) for t in logprobs["tokens"])
                if prompt is not None:
                    logprobs = {k: prompt[k] + logprobs[k] for k in prompt}
            if first:
                text = echoes[i] + text
            return {"index": i * params.n + c.index, "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

        return await self._stream(request, request_id, "text_completion", streams, params, states, chunk,
                                  include_usage, first_delta=None)
