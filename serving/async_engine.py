"""AsyncLLMEngine: the engine stepped in a background thread, one stream of outputs per request.

The LLMEngine is not thread-safe, so only its thread touches it: the event loop sends commands
(add, abort) through a queue and gets answers back through futures; the engine thread drains the
commands between steps and hands each step's outputs to a third thread, which makes the text of
those the engine left undetokenized (jpaged/core/pending_output.py: vLLM v1's split between the
engine core and the output processor) and passes the RequestOutputs to the loop with
call_soon_threadsafe, in step order. The loop therefore never waits on a device step, and the
engine thread does not detokenize a streamed request whose text decides nothing there.
"""

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time

from jpaged.core.pending_output import PendingOutput, complete
from jpaged.engine.llm_engine import LLMEngine, StepFailedError
from jpaged.engine.router_stats import router_stats
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from serving.metrics import Metrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread hit an unexpected error and stopped; the server cannot serve any more."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        engine.detokenize_later = True  # (its PendingOutputs are completed by the output thread)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handed: queue.SimpleQueue = queue.SimpleQueue()  # engine thread -> output thread
        self._output_thread: threading.Thread | None = None
        self.output_seconds = 0.0  # the output thread's time completing outputs (detokenizing)
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        self.on_dead = lambda: None  # called on the event loop once the engine thread has died
        # Refreshed by the engine thread after every step; read by /metrics and the queue limit.
        self.stats = {**engine.stats(), **router_stats(engine)}
        self.num_pending_adds = 0  # submitted, not yet taken by the engine thread

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jpaged-engine", daemon=True)
        self._output_thread = threading.Thread(target=self._run_outputs, name="jpaged-outputs", daemon=True)
        self._output_thread.start()
        self._thread.start()

    async def shutdown(self):
        """Abort whatever is still running and stop the engine thread."""
        for stream in list(self._streams.values()):
            stream.abort()
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._output_thread is not None:
            self._handed.put(None)
            await asyncio.to_thread(self._output_thread.join)
        await asyncio.to_thread(self.engine.shutdown)

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                          lora_request=None) -> "RequestStream":
        """Queue the request with the engine; its ValueError for bad input is raised here, before
        any output (callers check LLMEngine.check_request first, before building anything for a
        request). Iterate the returned stream for the outputs; abort it when giving up early."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead!r}")
        # (A prompt with images comes as a ProcessedPrompt: its token ids hold the images' placeholders.)
        stream = RequestStream(self, request_id, getattr(prompt_token_ids, "token_ids", prompt_token_ids),
                               sampling_params)
        self._streams[request_id] = stream
        added: concurrent.futures.Future = concurrent.futures.Future()
        self.num_pending_adds += 1
        self._send(("add", request_id, prompt_token_ids, sampling_params, lora_request, added))
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # the client left while it was queued: it may still be added
            stream.abort()
            raise
        except BaseException:  # rejected (bad input): nothing was added
            self._streams.pop(request_id, None)
            raise
        return stream

    async def call_all(self, fn) -> dict:
        """{0: fn(engine)} (or the exception it raised): DPAsyncEngine's answer per replica."""
        try:
            return {0: await self.call(fn)}
        except Exception as e:
            return {0: e}

    def replica_stats(self) -> list[dict]:
        # The warm-up goes on while the engine idles (its stats are refreshed by steps): read it now.
        return [dict(self.stats, **self.engine.stats_while_warming())]

    @property
    def replica_metrics(self) -> list[Metrics]:
        return [self.metrics]

    def health(self) -> dict:
        """/health's body: the background warm-up's progress (executables compiled of all) and
        "ready" once all are in (requests are served before, on the shapes compiled so far)."""
        return {"status": "ok", **self.engine.warmup_progress()}

    async def call(self, fn):
        """fn(engine) on the engine thread, between two steps (the engine is not thread-safe)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead!r}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, done))
        return await asyncio.wrap_future(done)

    def _abort(self, request_id: str):
        self._streams.pop(request_id, None)
        self._send(("abort", request_id))

    def _send(self, command):
        self._commands.put(command)
        self._wakeup.set()

    # ------------------------------------------------------------------ the engine thread
    def _run(self):
        """Everything the thread does runs under this one guard: a request that makes a step fail
        is failed alone (StepFailedError); anything else means the engine cannot go on, so every
        request gets the error, /health turns 503 and the server exits non-zero."""
        try:
            while not self._stopping:
                self._wakeup.wait()
                self._wakeup.clear()
                self._run_commands()
                while self.engine.has_unfinished_requests() and not self._stopping:
                    try:
                        outputs = self.engine.step()
                    except StepFailedError as e:  # those requests were aborted; the others go on
                        self._handed.put((self._fail, e.request_ids, e))
                        outputs = e.outputs
                    # Stats first: a client that saw its request finish then finds it gone from them.
                    self._run_commands()  # which also refreshes the stats
                    self._handed.put((self._deliver, outputs))
        except BaseException as e:
            logger.exception("the engine thread failed")
            self.dead = e
            self._handed.put(None)
            self._loop.call_soon_threadsafe(self._die, EngineDeadError(f"the engine failed: {e!r}"))

    def _run_outputs(self):
        """The output thread: completes the PendingOutputs of each step the engine thread hands
        over (their text), then passes the step's outputs (or failures) to the loop, in order. A
        request whose output cannot be completed fails alone (and is aborted in the engine)."""
        clock = time.thread_time
        while (item := self._handed.get()) is not None:
            call, *args = item
            if call == self._deliver:
                start, outputs, failed = clock(), [], []
                for out in args[0]:
                    if type(out) is PendingOutput:
                        try:
                            out = complete(out, self.engine.detokenizer)
                        except Exception as e:
                            logger.exception("request %s: its output could not be made", out.request_id)
                            failed.append((out.request_id, e))
                            continue
                    outputs.append(out)
                self.output_seconds += clock() - start
                for request_id, e in failed:
                    self._send(("abort", request_id))
                    self._loop.call_soon_threadsafe(self._fail, [request_id], e)
                args = (outputs,)
            self._loop.call_soon_threadsafe(call, *args)

    def _run_commands(self):
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _, request_id, prompt, params, lora_request, added = command
                self._loop.call_soon_threadsafe(self._taken)
                # Running from now on: the handler can no longer cancel it. If it already did (the
                # client left while the request was queued), there is nothing to add.
                if not added.set_running_or_notify_cancel():
                    continue
                try:
                    self.engine.add_request(request_id, prompt, params, lora_request=lora_request)
                except Exception as e:  # ValueError for bad input; anything else still answers
                    added.set_exception(e)
                else:
                    added.set_result(None)
            elif command[0] == "call":
                _, fn, done = command
                if not done.set_running_or_notify_cancel():  # the client left
                    continue
                try:
                    done.set_result(fn(self.engine))
                except Exception as e:
                    done.set_exception(e)
            else:
                self.engine.abort_request(command[1])
        self.stats = {**self.engine.stats(), **router_stats(self.engine),  # + what fleet routers read
                      "output_thread_seconds": self.output_seconds}

    # ------------------------------------------------------------------ on the event loop
    def _taken(self):
        self.num_pending_adds -= 1

    def _deliver(self, outputs: list[RequestOutput]):
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]

    def _fail(self, request_ids: list[str], error: BaseException):
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)

    def _die(self, error: BaseException):
        """On the loop, after the engine thread ended: nothing waits forever on it. Adds still
        queued get the error (an add_request after this point sees `dead` and raises at once)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] in ("add", "call") and command[-1].set_running_or_notify_cancel():
                command[-1].set_exception(error)
        self._fail(list(self._streams), error)
        self.on_dead()


class RequestStream:
    """One request's outputs in order, ending with a finished one; records latency metrics as they
    are consumed. With RequestOutputKind.DELTA (what the server asks for whenever the engine
    allows it) each output holds only what is new, and `total` adds them up. abort() ends it early
    with finish_reason "abort" on the unfinished completions."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, metrics: Metrics | None = None):
        self.engine, self.request_id, self.params = engine, request_id, params
        self.delta = params.output_kind is RequestOutputKind.DELTA
        self.total = RequestOutput(request_id, None, prompt_token_ids, [
            CompletionOutput(i, "", [], 0.0, [] if params.logprobs is not None else None) for i in range(params.n)],
            finished=False)  # everything so far, whatever the kind
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False  # nothing more will be put
        self._done = False  # the finished output was consumed
        self._metrics = metrics or engine.metrics  # a replica's own, with data parallelism
        self._arrival = self._last = time.monotonic()
        self._num_tokens = 0

    def put(self, item: RequestOutput | BaseException):
        if isinstance(item, RequestOutput):
            if self.delta:
                self.total.add(item)
            else:
                self.total = item
        self.closed = isinstance(item, BaseException) or item.finished
        self.queue.put_nowait(item)

    def abort(self):
        """Stop the request (no-op once finished); the engine frees its blocks before its next step."""
        if not self.closed:
            self._metrics.request_finished("abort")
            self.engine._abort(self.request_id)
            last = self.total
            if self.delta:  # nothing new, only the reasons
                last = dataclasses.replace(last, prompt_logprobs=None, outputs=[
                    dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])
                    for c in last.outputs])
            self.put(dataclasses.replace(last, finished=True, outputs=[
                dataclasses.replace(c, finish_reason=c.finish_reason or "abort") for c in last.outputs]))

    async def final(self) -> RequestOutput:
        """Consume the stream; the finished request's whole output."""
        async for _ in self:
            pass
        return self.total

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._record(item)
        self._done = item.finished
        return item

    def _record(self, out: RequestOutput):
        now, metrics = time.monotonic(), self._metrics
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new = num_tokens if self.delta else num_tokens - self._num_tokens
        if new > 0:
            if self._num_tokens == 0:
                metrics.prompt_tokens += len(out.prompt_token_ids)
                metrics.ttft.observe(now - self._arrival)
            else:
                metrics.tpot.observe((now - self._last) / new)
            metrics.generation_tokens += new
            self._num_tokens, self._last = self._num_tokens + new, now
        if out.finished and all(c.finish_reason != "abort" for c in out.outputs):  # aborts count in abort()
            metrics.e2e.observe(now - self._arrival)
            for c in out.outputs:
                metrics.request_finished(c.finish_reason)
