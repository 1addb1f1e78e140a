"""LLMServer: one Ray Serve replica = one jpaged engine (AsyncLLMEngine) on the replica's devices.

`generate` streams a request's RequestOutputs back to the ingress (Ray Serve's streaming
responses); its first item says whether the engine took the request. `check_health` raises once
the engine has died, so Ray replaces the replica. `record_routing_stats` is what the request router
knows about the replica: its prefix cache's block hashes (kept from the engine's own KV events),
its load and the engine's stats. `call` runs a function on the engine between steps (/metrics'
KV usage, /kv), sent to one replica by `PrefixAwareRequestRouter`'s `target_replica`.
"""

import dataclasses
import logging
import os
import threading

from jpaged.config import EngineConfig
from jpaged.data_parallel.replica import _front_info, _start
from jpaged.data_parallel.router import Router
from jpaged.lora.request import LoRARequest
from jpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerateRequest:
    """What the ingress sends a replica for one request (the router reads its prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None

    @property
    def cache_salt(self) -> bytes | None:
        """As the engine salts an adapter's blocks (as fleet.py salts them)."""
        return None if self.lora_request is None else f"lora:{self.lora_request.lora_int_id}".encode()

    @property
    def prompt(self) -> str:
        """One character per token: Ray's PrefixCacheAffinityRouter matches prefixes of this text,
        which are then prefixes of the token ids (and the adapter's name keeps adapters apart)."""
        salt = "" if self.lora_request is None else f"lora:{self.lora_request.lora_int_id}\x00"
        return salt + "".join(map(chr, (0x10000 + t for t in self.prompt_token_ids)))


class _CacheTracker:
    """Stands in for the engine's KV event publisher (the engine thread calls it after each step):
    the prefix cache's block hashes from the engine's own events, then the user's publisher."""

    def __init__(self, publisher, block_size: int):
        self.publisher, self._lock = publisher, threading.Lock()
        self.router = Router(1, block_size)  # its on_events keeps one replica's set of hashes

    def publish(self, batch):
        with self._lock:
            self.router.on_events(0, batch.events)
        self.publisher.publish(batch)

    def hashes(self) -> list:
        with self._lock:
            return list(self.router.cached[0])

    def shutdown(self):
        self.publisher.shutdown()


class LLMServer:
    def __init__(self, config: EngineConfig, model_name: str, lora_modules=()):
        from ray import serve

        from serving.async_engine import AsyncLLMEngine
        from serving.metrics import Metrics

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id if context is not None else "local"
        engine, _ = _start(config, list(lora_modules))
        self.tracker = _CacheTracker(engine.kv_event_publisher.publisher, config.block_size)
        engine.kv_event_publisher = self.tracker
        self.info = {**_front_info(engine), "replica": self.replica}
        self.engine = AsyncLLMEngine(engine, Metrics(model_name, engine=self.replica))
        self._started = False
        logger.info("jpaged replica %s ready (pid %d)", self.replica, os.getpid())

    def _start(self):
        if not self._started:  # on the loop Ray Serve runs this replica's methods on
            self.engine.start()
            self._started = True

    async def front_info(self) -> dict:
        """The tokenizer, model config and limits the ingress checks requests against."""
        return self.info

    async def generate(self, request: GenerateRequest):
        """("added", replica) or ("refused", message) first; then the RequestOutputs; a failure
        ends the stream with ("failed", error type, message). Cancelled (the client left): the
        request is aborted in the engine."""
        from serving.async_engine import EngineDeadError

        self._start()
        try:
            stream = await self.engine.add_request(request.request_id, request.prompt_token_ids,
                                                   request.sampling_params, request.lora_request)
        except ValueError as e:
            yield ("refused", str(e))
            return
        except EngineDeadError as e:
            yield ("failed", "EngineDeadError", str(e))
            return
        yield ("added", self.replica)
        try:
            async for out in stream:
                yield out
        except Exception as e:  # a step that failed this request, or the engine died
            yield ("failed", type(e).__name__, str(e))
        finally:
            stream.abort()  # no-op once finished; the client left otherwise

    async def call(self, fn, target_replica: str | None = None):
        """fn(engine) between two steps (`target_replica`: read by the router only)."""
        self._start()
        return await self.engine.call(fn)

    async def check_health(self):
        """Ray Serve's health check: raises once the engine has died (Ray then replaces the replica)."""
        if self.engine.dead is not None:
            raise RuntimeError(f"replica {self.replica}: the engine stopped after an error: {self.engine.dead!r}")

    async def record_routing_stats(self) -> dict:
        """What the request router knows about this replica (Ray Serve pulls it every
        request_routing_stats_period_s)."""
        stats = self.engine.stats
        return {"replica": self.replica, "pid": self.info["pid"], "hashes": self.tracker.hashes(),
                "load": stats["num_running"] + stats["num_waiting"] + self.engine.num_pending_adds,
                "stats": stats, "block_size": self.engine.engine.config.block_size,
                "dead": None if self.engine.dead is None else repr(self.engine.dead)}
