"""GET /kv: the device KV pool as a live picture (jpaged.core.kv_map), for a browser.

A plain HTML page with the map inline as SVG that reloads itself every second (a meta refresh,
no script): one cell per block, grouped by the request holding it. The map is taken on the
engine thread between two steps.
"""

import html

from aiohttp import web

from serving.async_engine import AsyncLLMEngine

REFRESH_S = 1


def add_routes(app: web.Application, engine: AsyncLLMEngine, model_name: str):
    async def kv(request):
        kv_map, usage = await engine.call(lambda e: (e.kv_map(), e.kv_usage()))
        allocated = usage.allocated_slots
        numbers = (f"{usage.total_slots} token slots: {usage.token_slots} hold tokens, {usage.reserved_slots} "
                   f"reserved, {usage.fragmented_slots} fragmented, {usage.free_slots} free"
                   + (f" ({usage.token_slots / allocated:.1%} of allocated slots hold tokens)" if allocated else ""))
        page = (f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">'
                f"<title>KV cache · {html.escape(model_name)}</title></head><body style=\"font-family:sans-serif\">"
                f"<h2>KV cache of {html.escape(model_name)}</h2><p>{numbers}</p>{kv_map.to_svg()}</body></html>")
        return web.Response(text=page, content_type="text/html")

    app.router.add_get("/kv", kv)
