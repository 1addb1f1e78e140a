"""The OpenAI-compatible HTTP server (aiohttp) in front of the AsyncLLMEngine: the app (routes,
middlewares: errors, auth, CORS), GET /health, /v1/models and /metrics, and its lifecycle (serve,
run_server, signals).

Endpoints: GET /health, GET /v1/models, POST /v1/completions (serving/completions.py), POST
/v1/chat/completions (serving/chat.py), POST /tokenize, POST /detokenize (serving/tokenization.py),
POST /v1/responses and GET / DELETE /v1/responses/{id} (serving/responses.py), GET /version,
GET /metrics, GET /kv (serving/kv_page.py), POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(serving/lora.py). What the endpoints share is in serving/serving_engine.py,
reading request bodies in serving/request_body.py; the server's options in serving/server_options.py.
"""

import asyncio
import contextlib
import functools
import logging
import operator
import os
import signal
import ssl
import sys
import threading
import time
from http import HTTPStatus

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from jpaged import __version__
from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine, StepFailedError
from serving import kv_page
from serving.access_log import access_log_options
from serving.async_engine import AsyncLLMEngine, EngineDeadError
from serving.completions import OpenAIServingCompletion
from serving.lora import OpenAIServingLoRA, register_lora_modules
from serving.dp_engine import DPAsyncEngine
from serving.dp_external_lb import start_replica_sites
from serving.metrics import Metrics, render_engines
from serving.pooling import POOLING_ROUTES, refuse
from serving.protocol import APIError
from serving.request_body import MAX_BODY_BYTES
from serving.responses import OpenAIServingResponses
from serving.server_options import ServerOptions
from serving.serving_engine import RETRY_AFTER_S, json_dumps
from serving.profiling import PROFILE_ROUTES, OpenAIServingProfile
from serving.sleep import SLEEP_ROUTES, OpenAIServingSleep
from serving.tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)



class OpenAIServer(OpenAIServingCompletion, OpenAIServingResponses, OpenAIServingTokenization, OpenAIServingLoRA,
                   OpenAIServingSleep, OpenAIServingProfile):
    """The app: every endpoint behind the error and auth middlewares."""

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.add_responses_routes(app)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/metrics", self.metrics)
        self.add_lora_routes(app)  # only with --enable-lora-runtime-updates (serving/lora.py)
        self.add_sleep_routes(app)
        self.add_profile_routes(app)  # only with --profile DIR (serving/profiling.py)
        kv_page.add_routes(app, self.engine, self.model_name, self.api_key)
        for path in POOLING_ROUTES:  # served by `jpaged serve --runner pooling` (serving/pooling.py)
            app.router.add_post(path, refuse("generate", "pooling"))
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
        guarded = request.path.startswith("/v1/") or request.path in SLEEP_ROUTES + PROFILE_ROUTES
        if self.api_key is not None and guarded:
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                raise APIError("Incorrect API key provided.", status=401, code="invalid_api_key")
        return await handler(request)

    # ------------------------------------------------------------------ simple endpoints
    async def health(self, request):
        if self.engine.dead is not None:
            raise APIError(f"the engine stopped after an error: {self.engine.dead!r}", status=503)
        # The warm-up's progress ("ready": every step shape compiled); data parallelism: each
        # replica's rank, pid and state.
        health = self.engine.health()
        return web.json_response(health, status=503 if health["status"] == "down" else 200)

    async def version(self, request):
        return web.json_response({"version": __version__})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card(), *self._lora_cards()]})

    async def model(self, request):
        lora = self._check_model({"model": request.match_info["model"]})
        return web.json_response(self._model_card() if lora is None else
                                 next(c for c in self._lora_cards() if c["id"] == lora.lora_name))

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "jpaged",
                "root": self._model_root, "max_model_len": self.max_model_len}

    @functools.cached_property
    def _model_root(self) -> str:
        """The checkpoint's hub id; a local directory is not shown (its name, not its path)."""
        model = self.engine.engine.config.model
        return self.model_name if os.path.exists(model) else model

    async def metrics(self, request):
        kv_usage = await self.engine.call_all(operator.methodcaller("kv_usage")) if self.engine.dead is None else {}
        engines = [(m, stats, None if isinstance(kv_usage.get(rank), BaseException) else kv_usage.get(rank))
                   for rank, (m, stats) in enumerate(zip(self.engine.replica_metrics, self.engine.replica_stats()))]
        return web.Response(body=render_engines(engines).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


# ---------------------------------------------------------------------- running it
STATS_INTERVAL_S = 10


class _RequestHandler(web_protocol.RequestHandler):
    """aiohttp answers requests it cannot parse (a bad request line, oversized headers, a broken
    chunked body) before any middleware runs, in plain text: answer in OpenAI's shape instead.
    aiohttp logs each at ERROR with a traceback, though it is the client's doing and gets a 4xx:
    one WARNING line instead, so that no client can fill the log with tracebacks."""

    def handle_error(self, request, status=500, exc=None, message=None):
        if 400 <= status < 500 and isinstance(exc, HttpProcessingError):
            self.logger.warning("bad HTTP request from %s (%d): %s: %.200s", request.remote, status,
                                type(exc).__name__, " ".join(str(exc.message).split()))
            if request.writer.output_size > 0:  # as aiohttp: the connection is broken
                raise ConnectionError("Response is sent already, cannot send another response with the error "
                                      "message")
        else:
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


def spec_decode_line(stats: dict, last: dict) -> str | None:
    """vLLM's SpecDecoding metrics line for the drafts verified since `last` (an earlier stats()):
    acceptance rate and mean acceptance length (tokens per verified run, the bonus counted)."""
    if "spec_decode_num_drafts" not in stats:
        return None
    drafts = stats["spec_decode_num_drafts"] - last.get("spec_decode_num_drafts", 0)
    proposed = stats["spec_decode_num_draft_tokens"] - last.get("spec_decode_num_draft_tokens", 0)
    accepted = stats["spec_decode_num_accepted_tokens"] - last.get("spec_decode_num_accepted_tokens", 0)
    if not drafts:
        return None
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted: {accepted} tokens, "
            f"Drafted: {proposed} tokens, Draft acceptance rate: {100 * accepted / max(proposed, 1):.1f}%")


def stats_line(stats: dict, prompt_throughput: float, generation_throughput: float, platform: str) -> str:
    """vLLM's periodic line. On a GPU, the pool is "GPU KV cache" and swap space "CPU KV cache" (as
    vLLM says); elsewhere both are host memory: "KV cache" and "swap space" (vLLM's CPU backend
    says "KV cache usage" too)."""
    pool, swap = ("GPU KV cache", "CPU KV cache") if platform == "gpu" else ("KV cache", "swap space")
    swapped = 1 - stats["num_free_cpu_blocks"] / stats["num_cpu_blocks"] if stats["num_cpu_blocks"] else 0
    return (f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, Avg generation throughput: "
            f"{generation_throughput:.1f} tokens/s, Running: {stats['num_running']} reqs, Swapped: "
            f"{stats['num_swapped']} reqs, Pending: {stats['num_waiting']} reqs, {pool} usage: "
            f"{100 * (1 - stats['num_free_gpu_blocks'] / stats['num_gpu_blocks']):.1f}%, {swap} usage: "
            f"{100 * swapped:.1f}%")


async def _log_stats(async_engine: AsyncLLMEngine):
    """vLLM's periodic line: throughput since the last line, queues and KV cache usage (and with
    speculative decoding, its acceptance since the last line)."""
    import jax

    # The engine's devices (a data-parallel front end has none: its replicas' platform, so that
    # it never starts a backend of its own on their GPUs).
    platform = getattr(async_engine.engine, "platform", None) or jax.devices()[0].platform
    metrics = async_engine.metrics
    last = (time.monotonic(), metrics.prompt_tokens, metrics.generation_tokens)
    last_stats = dict(async_engine.stats)
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        now, prompt, generation = time.monotonic(), metrics.prompt_tokens, metrics.generation_tokens
        stats = async_engine.stats
        busy = stats["num_running"] or stats["num_waiting"] or stats["num_swapped"]
        if busy or (prompt, generation) != last[1:]:
            elapsed = now - last[0]
            logger.info("%s", stats_line(stats, (prompt - last[1]) / elapsed, (generation - last[2]) / elapsed,
                                         platform))
            spec_line = spec_decode_line(stats, last_stats)
            if spec_line:
                logger.info("%s", spec_line)
        last, last_stats = (now, prompt, generation), dict(stats)


def _cors(allowed_origins: str):
    origins = {o.strip() for o in allowed_origins.split(",") if o.strip()}

    @web.middleware
    async def cors(request, handler):
        origin = request.headers.get("Origin")
        allowed = origin is not None and ("*" in origins or origin in origins)
        if request.method == "OPTIONS" and allowed:  # preflight
            response = web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
                "Access-Control-Max-Age": "600"})
        else:
            response = await handler(request)
        if allowed:
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in origins else origin
            response.headers["Vary"] = "Origin"
        return response

    return cors


async def serve(engine: LLMEngine | DPAsyncEngine, options: ServerOptions) -> int:
    """Serve until SIGTERM or SIGINT (then stop accepting, abort in-flight requests and return 0)
    or until the engine dies (then return 1, so that a supervisor restarts the server). `engine`:
    one LLMEngine, or the data-parallel replicas (their adapters registered at their start)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # first thing: they replace run_server's start-up handler
        loop.add_signal_handler(sig, stop.set)
    if isinstance(engine, DPAsyncEngine):
        async_engine = engine
    else:
        register_lora_modules(engine, options.lora_modules)  # read and checked before serving (ids as the app's)
        async_engine = AsyncLLMEngine(engine, Metrics(options.served_model_name))
    async_engine.on_dead = stop.set
    async_engine.start()

    def build_app(engine):
        app = OpenAIServer(engine, options).build_app()
        if options.allowed_origins:
            app.middlewares.insert(0, _cors(options.allowed_origins))
        return app

    def make_runner(app):
        # keepalive_timeout also closes connections that never finish sending their headers (slowloris).
        return _AppRunner(app, handler_cancellation=True, keepalive_timeout=options.timeout_keep_alive,
                          auto_decompress=False,  # json_body decompresses, with limits and JSON errors
                          access_log_format='%a "%r" %s %b %Tfs', **access_log_options(options.log_requests))

    runner = make_runner(build_app(async_engine))
    await runner.setup()
    ssl_context = None
    if options.ssl_certfile:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(options.ssl_certfile, options.ssl_keyfile)
    site = web.TCPSite(runner, options.host, options.port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as e:  # taken since `jpaged serve` checked it: stop what runs (its threads), then one line
        await async_engine.shutdown()
        await runner.cleanup()
        raise ValueError(f"cannot listen on {options.host}:{options.port}: {e.strerror or e} (is another server "
                         "using it? choose another --port)") from None
    bound_host, bound_port = runner.addresses[0][:2]
    scheme = "https" if ssl_context else "http"
    print(f"jpaged: serving {options.served_model_name!r} at {scheme}://{bound_host}:{bound_port}/v1 "
          "(OpenAI API; also /health, /metrics, /kv, /tokenize, /detokenize)", flush=True)
    replica_runners = []  # --data-parallel-external-lb: each replica's own port (serving/dp_external_lb.py)
    if options.data_parallel_external_lb and isinstance(async_engine, DPAsyncEngine):
        try:
            replica_runners = await start_replica_sites(async_engine, options, build_app, make_runner, ssl_context)
        except ValueError:
            await site.stop()
            await async_engine.shutdown()
            await runner.cleanup()
            raise
    stats_task = asyncio.create_task(_log_stats(async_engine)) if options.log_stats else None
    await stop.wait()  # already set by a signal during the set-up: shut down at once
    if async_engine.dead is not None:
        print(f"jpaged: the engine failed ({async_engine.dead!r}); exiting", flush=True)
    else:
        print("jpaged: shutting down", flush=True)
    if stats_task is not None:
        stats_task.cancel()
    await site.stop()  # no new connections
    for replica_runner in replica_runners:
        await replica_runner.shutdown()
    await async_engine.shutdown()  # in-flight requests end with finish_reason "abort"
    for replica_runner in replica_runners:
        await replica_runner.cleanup()
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


_start_up_stopped = threading.Event()


def _exit_during_start_up(signum, frame):
    """SIGTERM or SIGINT while the engine loads and compiles (before the server listens): exit 0,
    as after serving, not killed by the signal (-15) or with a KeyboardInterrupt traceback.
    SystemExit unwinds the start-up in the main thread (the executable cache removes its loading
    marker, so the next start still loads from it). Where the signal lands in a callback whose
    exceptions Python drops (the garbage collector's, a __del__), the warm-up sees
    `_start_up_stopped` at its next shape instead. A second signal, or START_UP_EXIT_GRACE_S
    later, exits at once."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_now)
    _start_up_stopped.set()
    timer = threading.Timer(START_UP_EXIT_GRACE_S, _exit_now)
    timer.daemon = True
    timer.start()
    print(f"jpaged: {signal.Signals(signum).name} during start-up; exiting", flush=True)
    raise SystemExit(0)


def _drop_lost_start_up_exit(unraisable):
    """The SystemExit a start-up signal raised inside a garbage-collector callback is dropped by
    Python with a traceback on stderr; it is not an error (the warm-up exits at its next shape)."""
    if not (isinstance(unraisable.exc_value, SystemExit) and _start_up_stopped.is_set()):
        sys.__unraisablehook__(unraisable)


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    """Serve; returns the process exit status (0 after SIGTERM / SIGINT, also during start-up; 1
    if the engine died)."""
    if threading.current_thread() is threading.main_thread():  # serve() installs its own once it runs
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_during_start_up)
        sys.unraisablehook = _drop_lost_start_up_exit
    if config.data_parallel_size > 1:  # replica processes, each loading and compiling, then we listen
        engine = DPAsyncEngine(config, options.served_model_name, options.lora_modules)
        return asyncio.run(serve(engine, options))
    # Loads the weights; the step shapes compile in the background while we listen (runner/warmup.py).
    engine = LLMEngine(config, stop_start_up=_start_up_stopped)
    if _start_up_stopped.is_set():  # the signal came after the last shape, its SystemExit lost
        return 0
    # Multi-host: process 0 serves HTTP; the other processes run its device steps until it stops.
    return engine.runner.lead(lambda: asyncio.run(serve(engine, options)))
