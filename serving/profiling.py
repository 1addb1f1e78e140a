"""jax.profiler traces of a running server, on vLLM's routes: with `jpaged serve --profile DIR`,
POST /start_profile starts a trace (every thread: the engine's steps, the device's executables) and
POST /stop_profile writes it under DIR (TensorBoard's profile plugin or Perfetto read it). Without
--profile the routes answer 404 naming the flag; a second start or a stop with none running is a
400. They sit behind --api-key like /v1/."""

import asyncio

from aiohttp import web

from serving.protocol import APIError
from serving.serving_engine import OpenAIServing

PROFILE_ROUTES = ("/start_profile", "/stop_profile")


class OpenAIServingProfile(OpenAIServing):
    profile_dir: str | None = None
    _profiling = False

    def _check_profiling(self):
        if self.profile_dir is None:
            raise APIError("profiling is off: start the server with --profile DIR", status=404)

    async def start_profile(self, request):
        import jax

        self._check_profiling()
        if self._profiling:
            raise APIError("a profile is already being recorded: POST /stop_profile first")
        self._profiling = True  # (before the await: a second start meanwhile is refused)
        try:
            await asyncio.to_thread(jax.profiler.start_trace, self.profile_dir)
        except BaseException:
            self._profiling = False
            raise
        return web.Response()

    async def stop_profile(self, request):
        import jax

        self._check_profiling()
        if not self._profiling:
            raise APIError("no profile is being recorded: POST /start_profile first")
        self._profiling = False
        await asyncio.to_thread(jax.profiler.stop_trace)  # writes the trace: off the event loop
        return web.json_response({"profile_dir": self.profile_dir})

    def add_profile_routes(self, app: web.Application):
        app.router.add_post("/start_profile", self.start_profile)
        app.router.add_post("/stop_profile", self.stop_profile)
