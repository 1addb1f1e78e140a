"""POST /tokenize and POST /detokenize (vLLM's OpenAIServingTokenization): a prompt or chat
messages to token ids, token ids to text."""

from aiohttp import web

from serving.protocol import APIError, field
from serving.request_body import json_body
from serving.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request):
        body = await json_body(request, self.body_timeout)
        self._check_model(body)
        if "messages" in body:
            ids = await self._encode_chat(body)
            ids = getattr(ids, "token_ids", ids)  # with images: the placeholders expanded
        else:
            prompt = field(body, "prompt", "string", required=True)
            ids = await self._encode(prompt, "prompt", add_special_tokens=field(body, "add_special_tokens",
                                                                                "boolean", True))
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def detokenize(self, request):
        body = await json_body(request, self.body_timeout)
        self._check_model(body)
        tokens = body.get("tokens")
        if isinstance(tokens, list) and len(tokens) > self.max_model_len:
            raise APIError(f"'tokens' holds {len(tokens)} token ids; at most max_model_len={self.max_model_len}",
                           param="tokens")
        ids = field(body, "tokens", "array of integers", required=True)
        self._check_token_ids(ids, "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(ids)})
