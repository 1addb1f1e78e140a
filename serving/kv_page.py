"""GET /kv: the device KV pool as a live picture (jpaged.core.kv_map), for a browser.

A plain HTML page with the map inline as SVG that reloads itself every second (a meta refresh,
no script): one cell per block, grouped by the request holding it. The map is taken on the
engine thread between two steps.

With --api-key the page asks for the key, as the API does (`Authorization: Bearer KEY`), or as a
browser can send it on every reload: HTTP Basic with the key as the password (any user name; a
401 says so in `WWW-Authenticate`). It is cheap to poll: one snapshot (the map and the page made
from it) serves every request for SNAPSHOT_S, and requests that arrive while one is taken wait
for it, so any number of pollers cost the engine at most one map per SNAPSHOT_S.
"""

import asyncio
import base64
import binascii
import gzip
import hmac
import html
import time

from aiohttp import web

from serving.async_engine import AsyncLLMEngine
from serving.protocol import APIError

REFRESH_S = 1
SNAPSHOT_S = 0.5  # how long one snapshot answers every poller


def authorized(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries the key: as a bearer token, or as HTTP Basic's password."""
    if header is None:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(value.encode(), api_key.encode())
    if scheme.lower() == "basic":
        try:
            password = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
        return hmac.compare_digest(password.encode(), api_key.encode())
    return False


def kv_snapshot(engine):
    """On the engine thread (each replica's, with data parallelism): the map and the slot counts."""
    return engine.kv_map(), engine.kv_usage()


class KVPage:
    """The page, made at most once per SNAPSHOT_S however many clients poll it."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, api_key: str | None,
                 clock=time.monotonic):
        self.engine, self.model_name, self.api_key, self.clock = engine, model_name, api_key, clock
        self._page: tuple[bytes, bytes] | None = None  # the page in UTF-8, and gzipped
        self._taken = float("-inf")
        self._pending: asyncio.Future | None = None
        self.snapshots = 0  # maps taken (for tests and curiosity)

    async def page(self) -> tuple[bytes, bytes]:
        if self._page is not None and self.clock() - self._taken < SNAPSHOT_S:
            return self._page
        if self._pending is None:  # the first poller takes the snapshot; the others wait for it
            self._pending = asyncio.ensure_future(self._snapshot())
            self._pending.add_done_callback(self._forget)
        return await asyncio.shield(self._pending)

    def _forget(self, future: asyncio.Future):
        self._pending = None
        if not future.cancelled():
            future.exception()  # retrieved: a failed snapshot is raised to its waiters, not logged again

    async def _snapshot(self) -> tuple[bytes, bytes]:
        answers = await self.engine.call_all(kv_snapshot)  # data parallelism: one map per replica
        self.snapshots += 1
        name = html.escape(self.model_name)
        sections = []
        for rank, answer in sorted(answers.items()):
            if isinstance(answer, BaseException):
                if len(answers) == 1:
                    raise answer
                sections.append((f"<h3>replica {rank}</h3><p>{html.escape(str(answer))}</p>", None))
                continue
            kv_map, usage = answer
            allocated = usage.allocated_slots
            numbers = (f"{usage.total_slots} token slots: {usage.token_slots} hold tokens, {usage.reserved_slots} "
                       f"reserved, {usage.fragmented_slots} fragmented, {usage.free_slots} free"
                       + (f" ({usage.token_slots / allocated:.1%} of allocated slots hold tokens)" if allocated else ""))
            title = f"<h3>replica {rank}</h3>" if len(answers) > 1 else ""
            sections.append((f"{title}<p>{numbers}</p>", kv_map))

        def render() -> tuple[bytes, bytes]:  # a large pool's SVG is long: made off the event loop
            body = "".join(text + (kv_map.to_svg() if kv_map is not None else "") for text, kv_map in sections)
            page = (f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" '
                    f'content="{REFRESH_S}"><title>KV cache · {name}</title></head><body style="font-family:'
                    f'sans-serif"><h2>KV cache of {name}</h2>{body}</body></html>').encode()
            return page, gzip.compress(page, compresslevel=1)  # sent to the many pollers that accept gzip

        self._page = await asyncio.get_running_loop().run_in_executor(None, render)
        self._taken = self.clock()
        return self._page

    async def handle(self, request):
        if self.api_key is not None and not authorized(request.headers.get("Authorization"), self.api_key):
            error = APIError("Incorrect API key provided.", status=401, code="invalid_api_key")
            return web.json_response(error.to_json(), status=401,
                                     headers={"WWW-Authenticate": 'Basic realm="jpaged /kv: the API key as password"'})
        page, gzipped = await self.page()
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(body=gzipped, content_type="text/html", charset="utf-8",
                                headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        return web.Response(body=page, content_type="text/html", charset="utf-8")


def add_routes(app: web.Application, engine: AsyncLLMEngine, model_name: str, api_key: str | None = None) -> KVPage:
    kv = KVPage(engine, model_name, api_key)
    app.router.add_get("/kv", kv.handle)
    return kv
