"""`jpaged serve --data-parallel-size N --data-parallel-external-lb`: besides the built-in front
(--port, its router picking a replica), each replica r serves the same app on a port of its own
(--port + 1 + r; any free port with --port 0), so that an external router (llm-d's inference
scheduler, the Gateway API Inference Extension's endpoint picker) can pick replicas itself:
vLLM's --data-parallel-external-lb, where each rank has its own API server. Each replica's KV
events are already on their own endpoint (vLLM's rule: the configured port + the rank).

A replica's app sees a ReplicaEngine: requests go to that replica only (503 while it is down:
the router should pick another), /health, /metrics and /kv are that replica's; LoRA loads and
sleep / wake reach every replica (one model, one set of adapters, whichever port asked)."""

from aiohttp import web

from jpaged.kv_events.config import offset_endpoint


def replica_port(port: int, rank: int) -> int:
    """Replica `rank`'s HTTP port for the front's `port` (0: any free one)."""
    return 0 if port == 0 else port + 1 + rank


class ReplicaEngine:
    """AsyncLLMEngine's interface over one replica of a DPAsyncEngine (which it leaves to start and
    stop); everything not replica-specific is the DPAsyncEngine's."""

    def __init__(self, dp, rank: int):
        self.dp, self.rank = dp, rank

    def __getattr__(self, name):  # engine (tokenizer, limits), dead, call, num_pending_adds, ...
        return getattr(self.dp, name)

    async def add_request(self, request_id, prompt_token_ids, sampling_params, lora_request=None):
        return await self.dp.add_request(request_id, prompt_token_ids, sampling_params, lora_request, rank=self.rank)

    @property
    def stats(self) -> dict:
        return self.dp.fleet.stats[self.rank] or {key: 0 for key in ("num_running", "num_waiting", "num_swapped")}

    def replica_stats(self) -> list:
        return [self.dp.fleet.stats[self.rank]]

    @property
    def replica_metrics(self) -> list:
        return [self.dp.replica_metrics[self.rank]]

    @property
    def metrics(self):
        return self.dp.replica_metrics[self.rank]

    def health(self) -> dict:
        """The front's /health narrowed to this replica: "down" (a 503) unless it is up."""
        replica = self.dp.fleet.health()["replicas"][self.rank]
        up = replica["state"] == "up"
        warmup = self.dp.health()
        return {"status": "ok" if up else "down", "degraded": not up, "down": [] if up else [self.rank],
                "replicas": [replica], **{k: v for k, v in warmup.items() if k in ("ready", "compiled", "total")}}

    async def call_all(self, fn) -> dict:
        """fn(engine) in this replica only (/metrics, /kv), answered as replica 0's, the app's only one."""
        answers = await self.dp.call_all(fn)
        return {0: answers[self.rank]} if self.rank in answers else {}


async def start_replica_sites(dp, options, build_app, make_runner, ssl_context=None) -> list:
    """Each replica's app on its own port; returns their runners (cleaned up by the caller). A port
    that cannot be bound is a ValueError naming it (the sites started before it are cleaned up)."""
    runners = []
    for rank in range(dp.fleet.size):
        runner = make_runner(build_app(ReplicaEngine(dp, rank)))
        await runner.setup()
        runners.append(runner)
        port = replica_port(options.port, rank)
        try:
            await web.TCPSite(runner, options.host, port, ssl_context=ssl_context).start()
        except OSError as e:
            for started in runners:
                await started.cleanup()
            raise ValueError(f"--data-parallel-external-lb: cannot listen on {options.host}:{port} for data-parallel "
                             f"replica {rank}: {e.strerror or e} (each replica takes --port + 1 + its rank)") from None
        host, bound = runner.addresses[0][:2]
        events, kv_events_config = "", dp.engine.config.kv_events_config
        if kv_events_config is not None and kv_events_config.enabled:
            events = f"; KV events on {offset_endpoint(kv_events_config.endpoint, rank)}"
        scheme = "https" if ssl_context else "http"
        print(f"jpaged: data-parallel replica {rank} at {scheme}://{host}:{bound}/v1{events}", flush=True)
    return runners
