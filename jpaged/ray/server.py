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


class ProcessFollower:
    """Process i > 0 of a replica that spans hosts (num_processes > 1): one Ray actor in bundle i
    of the replica's placement group, running the driver's device operations (jax.distributed)."""

    def where(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def run(self, config: EngineConfig) -> None:
        """Joins the driver's jax.distributed job, builds the same engine and follows its steps
        until the driver ends (returns) or fails (raises)."""
        from jpaged.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        try:
            engine.runner.follow()
        finally:
            engine.shutdown()


def _start_followers(config: EngineConfig) -> tuple[EngineConfig, list, list, list]:
    """For a replica over config.num_processes processes: the coordinator on this node, one
    ProcessFollower per further process in the replica's placement group bundles 1.. (bundle 0
    holds this actor), each started on its engine; returns process 0's config, the actors, their
    `run` calls (which end only when the replica does) and where they run."""
    import socket

    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()
    bundles = group.bundle_specs if group is not None else []
    if len(bundles) != config.num_processes:
        raise ValueError(f"num_processes={config.num_processes}: the replica needs one placement group bundle per "
                         f"process, it has {len(bundles)}")
    with socket.socket() as s:  # a free port on this node for jax.distributed's coordinator
        s.bind(("", 0))
        port = s.getsockname()[1]
    address = f"{ray.util.get_node_ip_address()}:{port}"
    followers, runs, places = [], [], []
    for i in range(1, config.num_processes):
        bundle = bundles[i]
        follower = ray.remote(ProcessFollower).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)).remote()
        places.append(follower.where.remote())  # before `run`: an actor runs its calls in order
        runs.append(follower.run.remote(dataclasses.replace(config, coordinator_address=address, process_id=i)))
        followers.append(follower)
    places = [{"process_id": i + 1, **where} for i, where in enumerate(ray.get(places))]
    return dataclasses.replace(config, coordinator_address=address, process_id=0), followers, runs, places


class LLMServer:
    def __init__(self, config: EngineConfig, model_name: str, lora_modules=()):
        import ray
        from ray import serve

        from serving.async_engine import AsyncLLMEngine
        from serving.metrics import Metrics

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id if context is not None else "local"
        self.followers, self._runs = [], []
        processes = [{"process_id": 0, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}]
        if config.num_processes and config.num_processes > 1:  # jax.distributed over the placement group
            config, self.followers, self._runs, places = _start_followers(config)
            processes += places
        self.processes = processes
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
        """Ray Serve's health check: raises once the engine has died, or one of the replica's
        other processes has ended (Ray then replaces the replica, its followers with it)."""
        if self.engine.dead is not None:
            raise RuntimeError(f"replica {self.replica}: the engine stopped after an error: {self.engine.dead!r}")
        if self._runs:
            import ray

            ended, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
            if ended:
                i = self._runs.index(ended[0]) + 1
                try:
                    ray.get(ended[0])
                    why = "returned"
                except Exception as e:  # noqa: BLE001 (reported as the health check's failure)
                    why = f"failed: {type(e).__name__}: {e}"
                raise RuntimeError(f"replica {self.replica}: its process {i} (jax.distributed follower) {why}")

    def __del__(self):
        import ray

        for follower in getattr(self, "followers", ()):  # Ray kills them with this actor too; sooner is better
            try:
                ray.kill(follower)
            except Exception:  # noqa: BLE001 (Ray is shutting down)
                pass

    async def record_routing_stats(self) -> dict:
        """What the request router knows about this replica (Ray Serve pulls it every
        request_routing_stats_period_s)."""
        stats = dict(self.engine.stats, **self.engine.engine.stats_while_warming())  # fresh while idle
        return {"replica": self.replica, "pid": self.info["pid"], "processes": self.processes,
                "hashes": self.tracker.hashes(),
                "load": stats["num_running"] + stats["num_waiting"] + self.engine.num_pending_adds,
                "stats": stats, "block_size": self.engine.engine.config.block_size,
                "dead": None if self.engine.dead is None else repr(self.engine.dead)}
