"""The pooling endpoints (`jpaged serve --runner pooling`), as vLLM serves them: POST
/v1/embeddings (OpenAI), /pooling, /classify, /score, /rerank, /v1/rerank and /v2/rerank (Jina's
and Cohere's formats). Each input is a request of the engine's scheduler; the engine's thread
steps it while requests are in (AsyncPoolingEngine), never on the event loop, so inputs that
arrive while a forward runs are packed into the next.

The app, its lifecycle and GET /v1/models, /metrics, /health and POST /tokenize are in
serving/pooling_server.py; a generation endpoint there, or a pooling one on a generation server,
is a 400 naming the runner (`refuse`).
"""

import asyncio
import base64
import dataclasses
import itertools
import logging
import threading
import time
import uuid

import numpy as np
from aiohttp import web

from jpaged.pooling.engine import PoolingEngine, PoolingInput
from jpaged.pooling.llm_methods import activation, check_dimensions, finish_embedding
from serving.protocol import APIError, field
from serving.request_body import json_body

logger = logging.getLogger(__name__)

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit for /v1/embeddings)
POOLING_ROUTES = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                  "/v2/rerank")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def refuse(runner: str, other: str):
    async def handler(request):
        raise APIError(f"{request.path} is not served by this server: it runs runner='{runner}' (start it with "
                       f"--runner {other})", status=400, code="wrong_runner")
    return handler


@dataclasses.dataclass(eq=False)
class _Call:
    """One HTTP request's inputs, each a scheduler request; settled when the last finishes."""

    inputs: list[PoolingInput]
    pooling: str
    head: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    request_ids: list[str] = dataclasses.field(default_factory=list)
    results: list = dataclasses.field(init=False)
    left: int = dataclasses.field(init=False)  # inputs without a result yet

    def __post_init__(self):
        self.results, self.left = [None] * len(self.inputs), len(self.inputs)


class AsyncPoolingEngine:
    """The engine's own thread steps the PoolingEngine (its scheduler) while requests are in it:
    inputs that arrive join the queue at once and the next step takes them (FCFS, within
    max_num_batched_tokens), as the generation server's engine loop does. A client that leaves
    aborts its inputs still waiting."""

    def __init__(self, engine: PoolingEngine):
        self.engine = engine
        self._cond = threading.Condition()
        self._new: list[_Call] = []
        self._aborted: list[_Call] = []
        self._stop = False
        self._owner: dict[str, tuple[_Call, int]] = {}
        self._ids = itertools.count()
        self.running = 0  # HTTP requests waiting for their inputs' results
        self._thread = threading.Thread(target=self._loop, name="jpaged-pooling", daemon=True)
        self._thread.start()

    async def run(self, inputs: list[PoolingInput], pooling: str, head: bool = False) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        call = _Call(inputs, pooling, head, loop.create_future(), loop)
        with self._cond:
            if self._stop:
                raise APIError("the server is shutting down", status=503, code="shutting_down")
            self._new.append(call)
            self._cond.notify()
        self.running += 1
        try:
            return await call.future
        except asyncio.CancelledError:
            with self._cond:
                self._aborted.append(call)
                self._cond.notify()
            raise
        finally:
            self.running -= 1

    def _loop(self):
        engine = self.engine
        while True:
            with self._cond:
                while not (self._new or self._aborted or self._stop or engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stop:
                    return
                new, self._new = self._new, []
                aborted, self._aborted = self._aborted, []
            for call in new:
                for k, inp in enumerate(call.inputs):
                    request_id = f"pool-{next(self._ids)}"
                    call.request_ids.append(request_id)
                    self._owner[request_id] = (call, k)
                    engine.add_request(request_id, inp, call.pooling, call.head)
            for call in aborted:
                self._drop(call)
            if not engine.has_unfinished_requests():
                continue
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 (a bug in the step: every request in it gets the error)
                logger.exception("a pooling step failed")
                finished = []
                for call in {c for c, _ in self._owner.values()}:
                    self._drop(call)
                    call.loop.call_soon_threadsafe(_settle, call.future, None, e)
            for request_id, result in finished:
                if request_id not in self._owner:
                    continue
                call, k = self._owner.pop(request_id)
                if isinstance(result, Exception):
                    self._drop(call)
                    call.loop.call_soon_threadsafe(_settle, call.future, None, result)
                    continue
                call.results[k] = result
                call.left -= 1
                if not call.left:
                    call.loop.call_soon_threadsafe(_settle, call.future, call.results, None)

    def _drop(self, call: _Call):
        """The call's inputs still in the engine are aborted (its client left, or one of them failed)."""
        for request_id in call.request_ids:
            if self._owner.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)

    def shutdown(self):
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)


def _settle(future, result, error):
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)


def _as_400(e: ValueError, param: str) -> APIError:
    return APIError(str(e), param=param)


class PoolingEndpoints:
    """Handlers; `self.engine` a PoolingEngine, `self.batcher` its AsyncPoolingEngine."""

    engine: PoolingEngine
    batcher: AsyncPoolingEngine
    model_name: str
    body_timeout: float

    def add_pooling_routes(self, app: web.Application):
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/pooling", self.pooling)
        app.router.add_post("/classify", self.classify)
        app.router.add_post("/score", self.score)
        app.router.add_post("/v1/score", self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self.rerank)
        for path in GENERATION_ROUTES:
            app.router.add_post(path, refuse("pooling", "generate"))

    async def _body(self, request) -> dict:
        body = await json_body(request, self.body_timeout)
        model = field(body, "model", "string")
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
        return body

    def _inputs(self, body: dict, name: str = "input") -> list[PoolingInput]:
        """`input`: a text, a list of texts, a list of token ids or a list of such lists."""
        value = body.get(name)
        trunc = field(body, "truncate_prompt_tokens", "integer")
        if isinstance(value, str) or (isinstance(value, list) and value and _is_int(value[0])):
            value = [value]
        if not isinstance(value, list) or not value:
            raise APIError(f"'{name}' must be a non-empty string, list of strings, list of token ids or list of "
                           "lists of token ids", param=name, code="invalid_type" if value else "empty_input")
        if len(value) > MAX_INPUTS:
            raise APIError(f"'{name}' holds {len(value)} inputs; at most {MAX_INPUTS}", param=name)
        texts = all(isinstance(v, str) for v in value)
        ids = all(isinstance(v, list) and all(_is_int(t) for t in v) for v in value)
        if not (texts or ids):
            raise APIError(f"'{name}' mixes texts and token ids, or holds something else (only strings, or only "
                           "lists of integer token ids)", param=name)
        if texts and any(not v for v in value):
            raise APIError(f"'{name}' holds an empty string", param=name, code="empty_input")
        try:
            return [self.engine.check(self.engine.tokenize(v) if texts else PoolingInput(list(v)), trunc, name)
                    for v in value]
        except ValueError as e:
            raise _as_400(e, "truncate_prompt_tokens" if str(e).startswith("truncate") else name) from None

    def _response(self, kind: str, data: list, inputs: list[PoolingInput], **extra) -> web.Response:
        tokens = sum(len(i.token_ids) for i in inputs)
        return web.json_response({"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                                  "model": self.model_name, "data": data, **extra,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                            "completion_tokens": 0, "prompt_tokens_details": None}})

    async def embeddings(self, request):
        body = await self._body(request)
        fmt = field(body, "encoding_format", "string", "float")
        if fmt not in ("float", "base64"):
            raise APIError(f"encoding_format={fmt!r}; expected 'float' or 'base64'", param="encoding_format")
        field(body, "user", "string")
        dims = body.get("dimensions")
        normalize = field(body, "normalize", "boolean")
        try:
            check_dimensions(self.engine, dims)
        except ValueError as e:
            raise _as_400(e, "dimensions") from None
        inputs = self._inputs(body)
        pooled = await self.batcher.run(inputs, self.engine.pooler_config.pooling_type)
        data = []
        for i, p in enumerate(pooled):
            e = finish_embedding(self.engine, p, dims, normalize).astype(np.float32)
            data.append({"index": i, "object": "embedding",
                         "embedding": base64.b64encode(e.astype("<f4").tobytes()).decode() if fmt == "base64"
                         else e.tolist()})
        return self._response("embd", data, inputs)

    async def pooling(self, request):
        """vLLM's /pooling: the model's pooled output (an embedder's embedding, a classifier's
        probabilities) as `data`."""
        body = await self._body(request)
        inputs = self._inputs(body)
        if self.engine.is_classifier:
            out = [activation(x) for x in await self.batcher.run(inputs, self.engine.classify_pooling, True)]
        else:
            out = [finish_embedding(self.engine, p, None, None)
                   for p in await self.batcher.run(inputs, self.engine.pooler_config.pooling_type)]
        return self._response("pool", [{"index": i, "object": "pooling", "data": np.asarray(x, np.float32).tolist()}
                                       for i, x in enumerate(out)], inputs)

    def _classifier(self, path: str):
        if not self.engine.is_classifier:
            raise APIError(f"{path} needs a classification model (a *ForSequenceClassification checkpoint); this "
                           "one is an embedding model", status=400, param="model")

    async def classify(self, request):
        body = await self._body(request)
        self._classifier("/classify")
        inputs = self._inputs(body)
        labels = getattr(self.engine.hf_config, "id2label", None) or {}
        data = []
        for i, logits in enumerate(await self.batcher.run(inputs, self.engine.classify_pooling, True)):
            probs = activation(logits)
            best = int(np.argmax(probs))
            data.append({"index": i, "label": labels.get(best, str(best)), "probs": probs.tolist(),
                         "num_classes": len(probs)})
        return self._response("classify", data, inputs)

    async def _scores(self, queries: list[str], docs: list[str], body: dict, names: tuple[str, str]):
        """Scores of the (query, doc) pairs, and their token counts."""
        trunc = field(body, "truncate_prompt_tokens", "integer")
        try:
            if self.engine.is_classifier:
                inputs = [self.engine.check(self.engine.tokenize(q, d), trunc, names[1]) for q, d in zip(queries, docs)]
                logits = await self.batcher.run(inputs, self.engine.classify_pooling, True)
                return [float(activation(x)[0]) for x in logits], inputs
            texts = list(dict.fromkeys(queries + docs))
            inputs = [self.engine.check(self.engine.tokenize(t), trunc, names[1]) for t in texts]
        except ValueError as e:
            raise _as_400(e, names[1]) from None
        pooled = await self.batcher.run(inputs, self.engine.pooler_config.pooling_type)
        emb = {t: finish_embedding(self.engine, p, None, True) for t, p in zip(texts, pooled)}
        return [float(emb[q] @ emb[d]) for q, d in zip(queries, docs)], inputs

    async def score(self, request):
        """vLLM's /score: text_1 (or queries) against text_2 (or documents); one text_1 scores every text_2."""
        body = await self._body(request)
        n1 = "text_1" if "text_1" in body else "queries"
        n2 = next((n for n in ("text_2", "documents", "items") if n in body), "text_2" if n1 == "text_1" else "documents")
        one, two = _texts(body, n1), _texts(body, n2)
        if len(one) == 1:
            one = one * len(two)
        if len(one) != len(two):
            raise APIError(f"'{n1}' has {len(one)} texts and '{n2}' {len(two)}; expected one or as many", param=n1)
        scores, inputs = await self._scores(one, two, body, (n1, n2))
        return self._response("score", [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                              inputs)

    async def rerank(self, request):
        """Jina's and Cohere's rerank: `query`, `documents` (texts, or objects with `text`), `top_n`,
        `return_documents`; results by relevance, highest first."""
        body = await self._body(request)
        query = field(body, "query", "string", required=True)
        docs = body.get("documents")
        if isinstance(docs, list) and all(isinstance(d, dict) and isinstance(d.get("text"), str) for d in docs):
            docs = [d["text"] for d in docs]
        docs = _texts({"documents": docs}, "documents")
        top_n = field(body, "top_n", "integer", len(docs))
        if top_n < 1:
            raise APIError(f"top_n={top_n}; expected >= 1", param="top_n")
        return_documents = field(body, "return_documents", "boolean", True)
        if not query:
            raise APIError("'query' is an empty string", param="query", code="empty_input")
        scores, inputs = await self._scores([query] * len(docs), docs, body, ("query", "documents"))
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if return_documents else {})} for i in order]
        tokens = sum(len(i.token_ids) for i in inputs)
        return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name,
                                  "usage": {"total_tokens": tokens}, "results": results})


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _texts(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise APIError(f"'{name}' must be a non-empty string or list of strings", param=name,
                       code="missing_required_parameter" if value is None else "invalid_type")
    if len(value) > MAX_INPUTS:
        raise APIError(f"'{name}' holds {len(value)} texts; at most {MAX_INPUTS}", param=name)
    if any(not v for v in value):
        raise APIError(f"'{name}' holds an empty string", param=name, code="empty_input")
    return value
