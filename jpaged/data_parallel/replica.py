"""One data-parallel replica: an LLMEngine in its own process, stepped by this module's loop.

The front end (fleet.py) starts it with `multiprocessing`'s spawn and talks to it over two
one-way pipes: commands in (add, abort, call, shutdown), messages out (ready, added, step,
result, fatal). Each step's message carries the step's outputs, the requests it failed, the
prefix cache's KV events (what the router learns the replica's cache from) and the engine's
stats. The module imports nothing heavy at the top: the environment the front end chose for
this replica (its devices) is set before jax is imported.
"""

import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback

HEARTBEAT_INTERVAL_S = 1.0  # (fleet.HEARTBEAT_INTERVAL_S: not imported, this module imports nothing heavy)


class _Messages:
    """The messages pipe, shared by the loop and the heartbeat thread (one send at a time)."""

    def __init__(self, connection):
        self.connection, self.lock = connection, threading.Lock()

    def send(self, message):
        with self.lock:
            self.connection.send(message)


def _heartbeat(messages: _Messages):
    """One message a second while the process runs (starting, compiling, stepping): a replica
    that stops sending them is stopped or hung, and the front end replaces it."""
    while True:
        try:
            messages.send(("heartbeat",))
        except (OSError, ValueError):  # the front end is gone
            return
        time.sleep(HEARTBEAT_INTERVAL_S)


def main(rank: int, commands, messages):
    """The replica process's entry point (`python -m jpaged.data_parallel.replica RANK IN OUT`,
    its environment chosen by the front end): the first message is the pickled (EngineConfig,
    lora_modules)."""
    # Ctrl-C reaches the whole process group: the front end decides when a replica stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    messages = _Messages(messages)
    threading.Thread(target=_heartbeat, args=(messages,), name="jpaged-replica-heartbeat", daemon=True).start()
    try:
        config, lora_modules = pickle.loads(commands.recv_bytes())
        engine, events = _start(config, lora_modules)
    except BaseException as e:  # the front end fails the start-up (or the restart) with this
        messages.send(("fatal", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1)
    messages.send(("ready", _front_info(engine)))
    try:
        _Loop(engine, events, commands, messages).run()
    except BaseException as e:
        messages.send(("fatal", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        engine.shutdown()


def _start(config, lora_modules):
    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.lora.request import LoRARequest

    engine = LLMEngine(config)
    events = _EventTee(engine.kv_event_publisher, config.data_parallel_rank)
    engine.kv_event_publisher = events
    if config.enable_prefix_caching:  # the router's view of this replica's cache
        engine.block_manager.enable_kv_events()
    if lora_modules and engine.lora_manager is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for i, (name, path) in enumerate(lora_modules):  # ids 1.. as the front end's
        lora = LoRARequest(name, i + 1, path)
        engine.lora_manager.register(lora, *engine.lora_manager.read(lora))
    return engine, events


def _front_info(engine) -> dict:
    """What the front end needs to check and tokenize requests without an engine of its own."""
    from jpaged.engine.router_stats import router_stats

    bm = engine.block_manager
    return {"pid": os.getpid(), "platform": engine.devices[0].platform, "tokenizer": engine.tokenizer, "hf_config": engine.hf_config,
            "max_model_len": engine.max_model_len, "num_gpu_blocks": bm.num_gpu_blocks,
            "num_cpu_blocks": bm.num_cpu_blocks, "sliding_window": bm.sliding_window,
            "stats": {**engine.stats(), **router_stats(engine)}}


class _EventTee:
    """Stands in for the engine's KV event publisher: every batch goes to the user's publisher
    (--kv-events-config, or none) and its events are kept for the next message to the front end."""

    def __init__(self, publisher, rank: int):
        self.publisher, self.rank, self.events = publisher, rank, []

    def publish(self, batch):
        batch.data_parallel_rank = self.rank
        self.events.extend(batch.events)
        self.publisher.publish(batch)

    def take(self) -> list:
        events, self.events = self.events, []
        return events

    def shutdown(self):
        self.publisher.shutdown()


class _Loop:
    IDLE_POLL_S = 0.5  # how often an idle replica looks up (commands wake it at once)
    WAITING_POLL_S = 0.05  # ... while an off-thread call's background part runs

    def __init__(self, engine, events: _EventTee, commands, messages):
        self.engine, self.events, self.commands, self.messages = engine, events, commands, messages
        self.running = True
        self.warming_sent = engine.stats_while_warming()  # an idle replica sends it when it changes
        self.pending = []  # (call id, its OffThreadCall, the background part's future), in order
        self._pool = None

    def run(self):
        from jpaged.engine.llm_engine import StepFailedError

        engine = self.engine
        while self.running:
            busy = engine.has_unfinished_requests()
            commanded = self.commands.poll(0 if busy else self.WAITING_POLL_S if self.pending else self.IDLE_POLL_S)
            if commanded:
                self._run_commands()
                if not self.running:
                    break
            commanded = self._finish_calls() or commanded
            if not engine.has_unfinished_requests():
                warming = engine.stats_while_warming()
                if commanded or warming != self.warming_sent:
                    self._send_step([], None)  # the aborts', calls' or warm-up's effect on the stats
                continue
            failed = None
            try:
                outputs = engine.step()
            except StepFailedError as e:  # those requests were aborted; the others go on
                outputs, failed = e.outputs, (e.request_ids, str(e))
            self._send_step(outputs, failed)

    def _send_step(self, outputs, failed):
        self.warming_sent = self.engine.stats_while_warming()
        from jpaged.engine.router_stats import router_stats  # (imports nothing)

        self.messages.send(("step", outputs, failed, self.events.take(),
                            {**self.engine.stats(), **router_stats(self.engine)}))  # + what fleet routers read

    def _run_commands(self):
        """Every command waiting now; a closed pipe (the front end is gone) stops the replica."""
        while self.commands.poll(0):
            try:
                command = self.commands.recv()
            except EOFError:
                self.running = False
                return
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params, lora_request = command
                try:
                    self.engine.add_request(request_id, prompt, params, lora_request=lora_request)
                    error = None
                except ValueError as e:
                    error = str(e)
                self.messages.send(("added", request_id, error))
            elif kind == "abort":
                self.engine.abort_request(command[1])
            elif kind == "call":
                _, call_id, fn = command
                from jpaged.data_parallel.off_thread import OffThreadCall

                if isinstance(fn, OffThreadCall):
                    if self._pool is None:
                        import concurrent.futures

                        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jpaged-replica-call")
                    self.pending.append((call_id, fn, self._pool.submit(fn.background, self.engine)))
                    continue
                self.messages.send(("result", call_id, *_answer(lambda: fn(self.engine))))
            elif kind == "shutdown":
                self.running = False
                return

    def _finish_calls(self) -> bool:
        """Finish the off-thread calls whose background part is done, in the order they came."""
        finished = False
        while self.pending and self.pending[0][2].done():
            call_id, fn, future = self.pending.pop(0)
            self.messages.send(("result", call_id, *_answer(lambda: fn.finish(self.engine, future.result()))))
            finished = True
        return finished


def _answer(run) -> tuple:
    """(None, value), or a refusal as the front end raises it again: a ValueError stays one (a 400)."""
    try:
        return None, run()
    except Exception as e:
        return "ValueError" if isinstance(e, ValueError) else type(e).__name__, str(e)



if __name__ == "__main__":
    _rank, _commands, _messages = map(int, sys.argv[1:4])
    main(_rank, multiprocessing.connection.Connection(_commands, writable=False),
         multiprocessing.connection.Connection(_messages, readable=False))
