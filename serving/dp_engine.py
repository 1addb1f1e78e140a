"""DPAsyncEngine: the server's engine when `--data-parallel-size N > 1`, with AsyncLLMEngine's
interface (add_request -> RequestStream, call, stats, dead) over N replica processes
(jpaged/data_parallel/fleet.py), so every endpoint works unchanged.

`call(fn)` runs fn in every replica (LoRA loads, sleep and wake) and answers with the first
one's result; `call_all(fn)` answers with each replica's (/metrics, /kv). Requests are routed by
the fleet's router; a replica's death ends its started requests with an error (a stream gets
an error event), moves those not started, and /health names it.
"""

import asyncio
import logging

from jpaged.config import EngineConfig
from jpaged.data_parallel.engine import FrontEngine, sum_stats, warmup_health
from jpaged.data_parallel.fleet import Fleet, NoReplicaUpError, ReplicaDiedError
from jpaged.engine.llm_engine import StepFailedError
from jpaged.sampling_params import SamplingParams
from serving.async_engine import EngineDeadError, RequestStream
from serving.metrics import Metrics
from serving.protocol import APIError

logger = logging.getLogger(__name__)


class DPAsyncEngine:
    def __init__(self, config: EngineConfig, model_name: str, lora_modules=()):
        self.fleet = Fleet(config, lora_modules)
        self.fleet.start()  # blocking: before the event loop, as a single engine's warm-up
        self.engine = FrontEngine(config, self.fleet.info)
        self.replica_metrics = [Metrics(model_name, engine=str(rank)) for rank in range(self.fleet.size)]
        self.metrics = _MetricsTotal(self.replica_metrics)
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self.dead: BaseException | None = None
        self.on_dead = lambda: None
        self.num_pending_adds = 0

    @property
    def stats(self) -> dict:
        return sum_stats(self.fleet.stats) or {key: 0 for key in ("num_running", "num_waiting", "num_swapped")}

    def replica_stats(self) -> list[dict | None]:
        return list(self.fleet.stats)

    def health(self) -> dict:
        """The replicas' states, and their warm-up's progress ("ready": every live replica warm)."""
        return {**self.fleet.health(), **warmup_health(self.fleet.stats)}

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        fleet = self.fleet
        fleet.on_added, fleet.on_step, fleet.on_lost = self._added, self._step, self._lost
        fleet.on_call_done, fleet.on_change = self._call_done, self._changed
        fleet.attach(asyncio.get_running_loop())

    async def shutdown(self):
        """Abort what is still running, then stop every replica (each ends its current step)."""
        for stream in list(self._streams.values()):
            stream.abort()
        await asyncio.to_thread(self.fleet.shutdown)

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                          lora_request=None, rank: int | None = None) -> RequestStream:
        """`rank`: that replica serves it (its own port, serving/dp_external_lb.py), else the router picks."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead!r}")
        try:
            rank = self.fleet.submit(request_id, prompt_token_ids, sampling_params, lora_request, rank)
        except ReplicaDiedError as e:  # none is up now; some is coming back (else the server is dead)
            raise APIError(f"{e}; retry later", status=503, code="no_replica_up") from None
        stream = RequestStream(self, request_id, prompt_token_ids, sampling_params, self.replica_metrics[rank])
        self._streams[request_id] = stream
        added = self._adds[request_id] = asyncio.get_running_loop().create_future()
        self.num_pending_adds += 1
        try:
            error = await added
        except asyncio.CancelledError:  # the client left while it was queued
            stream.abort()
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._adds.pop(request_id, None)
            self.num_pending_adds -= 1
        if error is not None:
            self._streams.pop(request_id, None)
            raise ValueError(error)
        return stream

    def _abort(self, request_id: str):
        self._streams.pop(request_id, None)
        self.fleet.abort(request_id)

    async def call(self, fn):
        """fn(engine) in every replica that is up; the first one's result (a refusal: its ValueError)."""
        answers = await self.call_all(fn)
        if not answers:
            raise APIError(f"no data-parallel replica is up: {self.fleet.health()['replicas']}; retry later",
                           status=503, code="no_replica_up")
        for error in answers.values():
            if isinstance(error, Exception):
                raise error
        return answers[min(answers)]

    async def call_all(self, fn) -> dict:
        """{rank: fn(engine) or the exception it raised} over the replicas up now."""
        future = asyncio.get_running_loop().create_future()
        self._calls[self.fleet.call_all(fn)] = future
        return await future

    # ------------------------------------------------------------------ from the fleet (on the loop)
    def _added(self, request_id: str, error: str | None):
        future = self._adds.get(request_id)
        if future is not None and not future.done():
            future.set_result(error)

    def _step(self, rank: int, outputs, failed):
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]
        if failed:
            error = StepFailedError(failed[0], RuntimeError(failed[1]), [])
            for request_id in failed[0]:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(error)

    def _lost(self, request_ids: list[str], error: BaseException):
        for request_id in request_ids:
            # Nothing produced and a replica is coming back: the client may send it again.
            failure = (lambda: APIError(str(error), status=503, code="no_replica_up")) \
                if isinstance(error, NoReplicaUpError) else (lambda: EngineDeadError(str(error)))
            future = self._adds.get(request_id)
            if future is not None and not future.done():
                future.set_exception(failure())
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(failure())

    def _call_done(self, call_id: int, answers: dict):
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        future.set_result({rank: value if error_type is None else
                           ValueError(value) if error_type == "ValueError" else
                           EngineDeadError(f"replica {rank}: {error_type}: {value}")
                           for rank, (error_type, value) in answers.items()})

    def _changed(self):
        """A replica went down or came up: the server is dead only when none can ever serve again."""
        if self.fleet.up or self.dead is not None:
            return
        if self.fleet.coming_back:
            return
        self.dead = ReplicaDiedError(f"every data-parallel replica is down: {self.fleet.health()['replicas']}")
        for request_id in list(self._streams):
            self._lost([request_id], self.dead)
        self.on_dead()


class _MetricsTotal:
    """The replicas' token counters added up (the periodic stats line)."""

    def __init__(self, metrics: list[Metrics]):
        self.replicas = metrics

    @property
    def prompt_tokens(self) -> int:
        return sum(m.prompt_tokens for m in self.replicas)

    @property
    def generation_tokens(self) -> int:
        return sum(m.generation_tokens for m in self.replicas)

