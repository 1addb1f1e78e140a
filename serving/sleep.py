"""Sleep mode over HTTP (vLLM's routes, for RL trainers that drive a server): POST /sleep?level=1|2,
POST /wake_up, GET /is_sleeping, POST /reset_prefix_cache. They exist only with
--enable-sleep-mode (otherwise a 404 naming the flag) and sit behind --api-key like /v1/.
Each runs on the engine thread between two steps (jpaged/engine/sleep_mode.py); one that cannot
run now (requests unfinished, already asleep) is a 400 naming why.
"""

import functools

from aiohttp import web

from jpaged.engine import sleep_mode
from serving.protocol import APIError
from serving.serving_engine import OpenAIServing

SLEEP_ROUTES = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache")


class OpenAIServingSleep(OpenAIServing):
    def _check_sleep_mode(self):
        if not self.engine.engine.config.enable_sleep_mode:
            raise APIError("sleep mode is off: start the server with --enable-sleep-mode", status=404)

    async def _on_engine(self, fn):
        try:
            return await self.engine.call(fn)
        except ValueError as e:
            raise APIError(str(e)) from None

    async def sleep(self, request):
        self._check_sleep_mode()
        levels = request.query.getall("level", ["1"])
        if len(levels) != 1:
            raise APIError(f"level is given {len(levels)} times; expected once (1 or 2)", param="level")
        level = levels[0]
        if level not in ("1", "2"):  # exactly: "1 " (1%20), "01", "+1" are refused
            raise APIError(f"level={level[:20]!r}; expected 1 or 2", param="level")
        await self._on_engine(functools.partial(sleep_mode.sleep, level=int(level)))
        return web.Response()

    async def wake_up(self, request):
        self._check_sleep_mode()
        await self._on_engine(sleep_mode.wake_up)
        return web.Response()

    async def is_sleeping(self, request):
        self._check_sleep_mode()
        return web.json_response({"is_sleeping": await self._on_engine(sleep_mode.is_sleeping)})

    async def reset_prefix_cache(self, request):
        self._check_sleep_mode()
        await self._on_engine(sleep_mode.reset_prefix_cache)
        return web.Response()

    def add_sleep_routes(self, app: web.Application):
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
