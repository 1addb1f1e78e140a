"""`jpaged serve --runner pooling`: the pooling endpoints (serving/pooling.py) with GET /health,
/version, /v1/models, /metrics and POST /tokenize, behind the same error shape and API key as
the generation server; serve until SIGTERM / SIGINT."""

import asyncio
import logging
import os
import signal
import time

from aiohttp import web

from jpaged import __version__
from jpaged.config import EngineConfig
from jpaged.pooling.engine import PoolingEngine
from serving.access_log import access_log_options
from serving.metrics import PREFIX
from serving.pooling import POOLING_ROUTES, AsyncPoolingEngine, PoolingEndpoints
from serving.protocol import APIError, field
from serving.request_body import MAX_BODY_BYTES, json_body
from serving.server_options import ServerOptions
from serving.serving_engine import json_dumps

logger = logging.getLogger(__name__)


class PoolingServer(PoolingEndpoints):
    def __init__(self, engine: PoolingEngine, options: ServerOptions):
        self.engine, self.batcher = engine, AsyncPoolingEngine(engine)
        self.model_name, self.api_key = options.served_model_name, options.api_key
        self.body_timeout = options.timeout_keep_alive
        self.created = int(time.time())

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        self.add_pooling_routes(app)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except APIError as e:
            error = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            error = APIError(e.reason, status=e.status)
        except Exception as e:  # a bug: say so in the same shape, keep serving
            logger.exception("%s %s failed", request.method, request.path)
            error = APIError(f"internal error: {e!r}", status=500)
        return web.json_response(error.to_json(), status=error.status, dumps=json_dumps)

    @web.middleware
    async def _auth(self, request, handler):
        if self.api_key is not None and (request.path.startswith("/v1/") or request.path in POOLING_ROUTES):
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                raise APIError("Incorrect API key provided.", status=401, code="invalid_api_key")
        return await handler(request)

    async def health(self, request):
        """The generation server's /health body (serving/api_server.py): {"status": "ok", "ready"}.
        A pooling engine plans no warm-up (each forward's shape compiles on first use), so it is
        ready from the start, as a generation engine without a warm-up is; 503 if its thread died."""
        if not self.batcher._thread.is_alive():
            raise APIError("the pooling engine's thread stopped", status=503)
        return web.json_response({"status": "ok", "ready": True})

    async def version(self, request):
        return web.json_response({"version": __version__})

    async def models(self, request):
        model = self.engine.config.model
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "jpaged",
            "root": self.model_name if os.path.exists(model) else model, "max_model_len": self.engine.max_model_len}]})

    async def metrics(self, request):
        labels = f'model_name="{self.model_name}"'
        lines = []
        for name, kind, help, value in (
                ("num_requests_running", "gauge", "Requests waiting for or in a pooling forward.", self.batcher.running),
                ("num_requests_waiting", "gauge", "Inputs the scheduler has not admitted yet.",
                 len(self.engine.scheduler.waiting)),
                ("prompt_tokens_total", "counter", "Prompt tokens pooled.", self.engine.num_prompt_tokens),
                ("pooling_inputs_total", "counter", "Inputs pooled.", self.engine.num_requests)):
            lines += [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name}{{{labels}}} {value}"]
        return web.Response(body=("\n".join(lines) + "\n").encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def tokenize(self, request):
        body = await json_body(request, self.body_timeout)
        prompt = field(body, "prompt", "string", required=True)
        special = field(body, "add_special_tokens", "boolean", True)
        ids = await asyncio.to_thread(lambda: self.engine.tokenizer(prompt, add_special_tokens=special)["input_ids"])
        return web.json_response({"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids})


async def serve_pooling(engine: PoolingEngine, options: ServerOptions) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = PoolingServer(engine, options)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True,
                           keepalive_timeout=options.timeout_keep_alive, auto_decompress=False,
                           **access_log_options(options.log_requests))
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"jpaged: serving {options.served_model_name!r} (runner='pooling') at http://{host}:{port}/v1 "
          "(/v1/embeddings, /pooling, /classify, /score, /rerank; also /health, /metrics, /tokenize)", flush=True)
    await stop.wait()
    print("jpaged: shutting down", flush=True)
    await site.stop()
    server.batcher.shutdown()
    await runner.cleanup()
    return 0


def run_pooling_server(config: EngineConfig, options: ServerOptions) -> int:
    engine = PoolingEngine(config)
    return asyncio.run(serve_pooling(engine, options))
