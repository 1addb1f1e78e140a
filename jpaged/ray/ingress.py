"""OpenAIIngress: the Ray Serve ingress, serving `jpaged serve`'s OpenAI endpoints by the same
aiohttp app (serving/api_server.py: handlers, errors, streams, /health, /metrics), over
`RayAsyncEngine`, which has AsyncLLMEngine's interface and sends each request to an LLMServer
replica through a deployment handle (streamed back, routed by the deployment's request router).

Ray Serve's proxy hands the ingress a Starlette request; the ingress relays it to its aiohttp
app, listening on a Unix socket of its own, and relays the answer back (a StreamingResponse for
server-sent events), so that no handler is written twice.
"""

import asyncio
import contextvars
import logging
import os
import tempfile

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jpaged.config import EngineConfig
from jpaged.data_parallel.engine import FrontEngine, sum_stats, warmup_health
from jpaged.ray.router import routers
from jpaged.ray.server import GenerateRequest
from jpaged.sampling_params import SamplingParams
from serving.async_engine import EngineDeadError, RequestStream
from serving.metrics import Metrics
from serving.server_options import ServerOptions

logger = logging.getLogger(__name__)

# A request whose replica died before it produced anything goes to another one, this many times.
MAX_TRIES = 3
CALL_TIMEOUT_S = 10.0  # a call to one replica (/metrics, /kv) that is gone meanwhile
# Headers a relay must not copy: the hop's own (aiohttp and Starlette set them for their hop).
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class RayAsyncEngine:
    """AsyncLLMEngine's interface (add_request -> RequestStream, call, call_all, stats, health,
    dead) over the LLMServer replicas behind `handle`."""

    def __init__(self, handle, config: EngineConfig, info: dict, model_name: str):
        self.handle, self.model_name = handle, model_name
        self._streaming = handle.options(stream=True)  # made once: each options() call makes a handle
        self.engine = FrontEngine(config, info)
        self.metrics = Metrics(model_name)  # never served: each replica's below
        self._replica_metrics: dict[str, Metrics] = {}
        self._pumps: dict[str, asyncio.Task] = {}
        self.dead = None  # the ingress outlives its replicas: Ray restarts them
        self.on_dead = lambda: None
        self.num_pending_adds = 0

    def start(self):
        pass

    async def shutdown(self):
        for task in list(self._pumps.values()):
            task.cancel()

    # ------------------------------------------------------------------ the replicas, as the router sees them
    def _replicas(self) -> list:
        """The LLMServer replicas up now, as this process's router knows them."""
        found = routers(self.handle.app_name, self.handle.deployment_name)
        return list(found[-1].curr_replicas.values()) if found else []

    def _report(self, replica) -> dict:
        return replica.routing_stats or {}

    def replica_metrics_of(self, replica: str) -> Metrics:
        if replica not in self._replica_metrics:
            self._replica_metrics[replica] = Metrics(self.model_name, engine=replica)
        return self._replica_metrics[replica]

    @property
    def stats(self) -> dict:
        return sum_stats([self._report(r).get("stats") for r in self._replicas()]) or {
            "num_running": 0, "num_waiting": 0, "num_swapped": 0}

    def health(self) -> dict:
        replicas = [{"replica": r.replica_id.unique_id, "pid": self._report(r).get("pid"),
                     "state": "down" if self._report(r).get("dead") else "up",
                     **({"processes": self._report(r)["processes"]} if len(self._report(r).get("processes", ())) > 1
                        else {})} for r in self._replicas()]
        up = sum(r["state"] == "up" for r in replicas)
        status = "ok" if up and up == len(replicas) else "degraded" if up else "down"
        return {"status": status, "replicas": replicas, **warmup_health(self.replica_stats())}

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                          lora_request=None) -> RequestStream:
        """Sent to a replica (the router's choice); its refusal (bad input) is a ValueError here.
        A replica that dies before it takes the request: another one is tried."""
        request = GenerateRequest(request_id, prompt_token_ids, sampling_params, lora_request)
        self.num_pending_adds += 1
        try:
            for attempt in range(MAX_TRIES):
                responses = self._streaming.generate.remote(request)
                try:
                    first = await responses.__anext__()
                except (asyncio.CancelledError, StopAsyncIteration):
                    responses.cancel()
                    raise
                except Exception as e:  # the replica died (or went away) before taking it
                    if attempt + 1 == MAX_TRIES:
                        raise EngineDeadError(f"no replica took the request: {type(e).__name__}: {e}") from None
                    logger.warning("request %s: its replica failed before taking it (%s); trying another",
                                   request_id, type(e).__name__)
                    await asyncio.sleep(0.1 * (attempt + 1))
                    continue
                break
        finally:
            self.num_pending_adds -= 1
        if first[0] == "refused":
            raise ValueError(first[1])
        if first[0] == "failed":
            raise EngineDeadError(first[2])
        replica = first[1]
        stream = RequestStream(self, request_id, prompt_token_ids, sampling_params, self.replica_metrics_of(replica))
        self._pumps[request_id] = asyncio.create_task(self._pump(request_id, replica, responses, stream))
        return stream

    async def _pump(self, request_id: str, replica: str, responses, stream: RequestStream):
        try:
            async for item in responses:
                if isinstance(item, tuple):  # ("failed", error type, message)
                    stream.put(EngineDeadError(f"replica {replica}: {item[1]}: {item[2]}"))
                    return
                stream.put(item)
        except asyncio.CancelledError:
            responses.cancel()  # the replica aborts the request
            raise
        except Exception as e:  # the replica died mid-request: its output so far stands, the rest is lost
            stream.put(EngineDeadError(f"replica {replica} failed during the request: {type(e).__name__}: {e}"))
        else:
            if not stream.closed:
                stream.put(EngineDeadError(f"replica {replica} ended the request's stream early"))
        finally:
            self._pumps.pop(request_id, None)

    def _abort(self, request_id: str):
        task = self._pumps.pop(request_id, None)
        if task is not None:
            task.cancel()

    # ------------------------------------------------------------------ calls
    async def call(self, fn):
        """fn(engine) on one replica (the router's choice)."""
        return await self.handle.call.remote(fn)

    async def call_all(self, fn) -> dict:
        """{i: fn(engine) or the exception} over the replicas up now (each through the router), i
        their place in `replica_metrics` and `replica_stats` (as a data-parallel rank)."""
        replicas = [r.replica_id.unique_id for r in self._replicas()]

        async def one(replica):
            try:
                return await asyncio.wait_for(self.handle.call.remote(fn, target_replica=replica), CALL_TIMEOUT_S)
            except Exception as e:
                return e

        return dict(enumerate(await asyncio.gather(*map(one, replicas))))

    def replica_stats(self) -> list[dict | None]:
        return [self._report(r).get("stats") for r in self._replicas()]

    @property
    def replica_metrics(self) -> list[Metrics]:
        return [self.replica_metrics_of(r.replica_id.unique_id) for r in self._replicas()]


class OpenAIIngress:
    """Ray Serve's ingress deployment: HTTP in, the jpaged OpenAI app, replicas behind a handle."""

    def __init__(self, llm_server, config: EngineConfig, options: ServerOptions):
        self.llm_server, self.config, self.options = llm_server, config, options
        self._ready: asyncio.Task | None = None
        self.socket = os.path.join(tempfile.mkdtemp(prefix="jpaged-ray-"), "app.sock")

    async def _start(self):
        from serving.api_server import OpenAIServer

        info = await self.llm_server.front_info.remote()
        self.engine = RayAsyncEngine(self.llm_server, self.config, info, self.options.served_model_name)
        app = OpenAIServer(self.engine, self.options).build_app()
        self.runner = aiohttp.web.AppRunner(app, handler_cancellation=True, auto_decompress=False, access_log=None)
        await self.runner.setup()
        await aiohttp.web.UnixSite(self.runner, self.socket).start()
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket), auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None))
        logger.info("jpaged ingress: serving %r through %s", self.options.served_model_name, self.socket)

    async def check_health(self):
        if self._ready is not None and self._ready.done() and self._ready.exception() is not None:
            raise RuntimeError(f"the ingress failed to start: {self._ready.exception()!r}")

    async def __call__(self, request: Request) -> Response:
        if self._ready is None:
            # An empty context: the app's handlers must not carry this first request's Ray Serve
            # request context (its ids) into every call they make to the replicas.
            self._ready = asyncio.get_running_loop().create_task(self._start(), context=contextvars.Context())
        await asyncio.shield(self._ready)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        path, root = request.url.path, request.scope.get("root_path", "")  # the app's route_prefix
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        url = "http://jpaged" + path + (f"?{request.url.query}" if request.url.query else "")
        answer = await self.session.request(request.method, url, headers=headers, data=await request.body())
        out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
            return StreamingResponse(_relay(answer), status_code=answer.status, headers=out_headers)
        try:
            return Response(await answer.read(), status_code=answer.status, headers=out_headers)
        finally:
            answer.release()


async def _relay(answer):
    """A streamed answer's bytes as they come; the client leaving closes the app's stream."""
    try:
        async for chunk in answer.content.iter_any():
            yield chunk
    finally:
        answer.close()
