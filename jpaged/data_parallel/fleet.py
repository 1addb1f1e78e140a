"""The front end's side of data parallelism: N replica processes (replica.py), which one takes
each request (router.py), and what happens when one dies.

Everything here runs on one "driver": the thread that calls `pump` (offline, jpaged.LLM) or the
server's event loop once `attach`ed. Each replica (replica_process.py) has a reader thread (its pipe's messages) and
a writer thread (commands never block the driver on a busy replica's full pipe); both hand
their work to the driver through `_post`.

Faults: a replica that dies (kill -9, a crash) closes its pipe, so its reader sees EOF at once.
A replica that stops answering (SIGSTOP, a hang) sends no heartbeat (one a second, from its own
thread, even while it compiles or steps): after HEARTBEAT_TIMEOUT_S of silence it is killed, and
handled as one that died. Its requests that have produced nothing yet are routed to another
replica; the others end with an error naming the replica. With `dp_restart` a new process takes
its rank (loading its executables from the cache) whatever state the old one died in, at once
after serving and with a doubling backoff (RESTART_BACKOFF_S up to RESTART_BACKOFF_MAX_S) while
its restarts keep dying before they are ready; once ready it gets the adapters loaded at run time
replayed.
"""

import asyncio
import atexit
import dataclasses
import itertools
import logging
import os
import queue
import subprocess
import threading
import time
import weakref
from typing import Callable

from jpaged.config import EngineConfig
from jpaged.data_parallel.replica_process import ReplicaProcess, replica_config, replica_env  # noqa: F401
from jpaged.data_parallel.router import Router

logger = logging.getLogger(__name__)

# A replica silent this long (no message, no heartbeat) is killed and replaced: $JPAGED_DP_HEARTBEAT_TIMEOUT.
HEARTBEAT_TIMEOUT_S = 30.0
HEARTBEAT_INTERVAL_S = 1.0  # the replica's heartbeat period, and how often the fleet checks
# Restarts of a rank whose previous restart died before it was ready wait 1, 2, 4, ... 30 s.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


def heartbeat_timeout(environ=os.environ) -> float:
    value = environ.get("JPAGED_DP_HEARTBEAT_TIMEOUT", "").strip()
    if not value:
        return HEARTBEAT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"$JPAGED_DP_HEARTBEAT_TIMEOUT={value!r}; expected seconds > 0")
    return seconds


_live_fleets: "weakref.WeakSet[Fleet]" = weakref.WeakSet()


@atexit.register  # before multiprocessing's own exit handler, which would wait for the replicas forever
def _stop_live_fleets():
    for fleet in list(_live_fleets):
        fleet.kill()


class ReplicaDiedError(RuntimeError):
    """The replica serving a request died before finishing it."""


class NoReplicaUpError(ReplicaDiedError):
    """A request that produced nothing lost its replica while no other one was up (one is coming
    back): it may be sent again (the server answers 503 with Retry-After)."""


@dataclasses.dataclass
class _Request:
    rank: int
    prompt_token_ids: list[int]
    params: object
    lora_request: object
    added: bool = False  # the replica took it (its "added" came back)
    started: bool = False  # some output of it came back: it cannot move to another replica


class Fleet:
    """The replicas and the requests each one holds. Callbacks (set by the owner, run on the
    driver): on_added(request_id, error), on_step(rank, outputs, failed), on_lost(request_ids,
    error), on_call_done(call_id, {rank: (error_type, value)}), on_change()."""

    def __init__(self, config: EngineConfig, lora_modules=()):
        self.config, self.lora_modules = config, list(lora_modules)
        self.size = config.data_parallel_size
        self.router = Router(self.size, config.block_size, config.dp_routing, seats=config.max_num_seqs)
        if config.dp_routing == "prefix" and not config.enable_prefix_caching:
            logger.warning("dp_routing='prefix' without enable_prefix_caching: the replicas cache no prefixes, "
                           "so requests go to the least-loaded replica")
        self.replicas: list[ReplicaProcess | None] = [None] * self.size
        # starting, up, restarting (a new process follows, after a backoff), down, failed (a
        # restart did not start and none follows: dp_restart off)
        self.states = ["down"] * self.size
        self.errors: list[str | None] = [None] * self.size
        self.restarts = [0] * self.size
        self.failures = [0] * self.size  # deaths since the rank was last ready (the backoff's exponent)
        self.heartbeat_timeout = heartbeat_timeout()
        self.started = False  # start() returned: from now on a replica that dies is restarted
        self.last_exit: list[str | None] = [None] * self.size  # why the rank's previous process ended
        self.stats: list[dict | None] = [None] * self.size
        self.info: dict | None = None  # the first ready replica's (replica._front_info)
        self.requests: dict[str, _Request] = {}
        self.loads = [0] * self.size  # requests each replica holds (the router's load)
        self.replayed: list = []  # calls every replica must have run (adapters loaded at run time)
        self._calls: dict[int, tuple[set, dict]] = {}  # call id -> (ranks to answer, answers)
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        noop = lambda *args: None  # noqa: E731
        self.on_added, self.on_step, self.on_lost, self.on_call_done, self.on_change = noop, noop, noop, noop, noop
        _live_fleets.add(self)

    # ------------------------------------------------------------------ the driver
    def _post(self, fn):
        with self._lock:
            if self._loop is None:
                self._inbox.put(fn)
            else:
                self._loop.call_soon_threadsafe(fn)

    def attach(self, loop: asyncio.AbstractEventLoop):
        """From now on the callbacks run on `loop` (what was posted before runs there first)."""
        with self._lock:
            self._loop = loop
            while True:
                try:
                    loop.call_soon(self._inbox.get_nowait())
                except queue.Empty:
                    break

    def pump(self, timeout: float | None = None) -> bool:
        """Run what the replicas posted (offline driver): waits up to `timeout` for the first."""
        try:
            fn = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return False
        fn()
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                return True

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        """Start every replica and wait until all are ready; a replica that fails to start fails
        the start-up with its error (the others are stopped)."""
        try:
            # Replica 0 first: the others then load its compiled steps from the executable cache
            # instead of compiling the same ones side by side.
            for ranks in ([0], range(1, self.size)):
                for rank in ranks:
                    self._spawn(rank)
                while any(self.states[rank] == "starting" for rank in ranks):
                    self.pump(timeout=1.0)
                    failed = next((r for r in ranks if self.states[r] in ("down", "failed")), None)
                    if failed is not None:
                        raise RuntimeError(f"data-parallel replica {failed} failed to start: {self.errors[failed]}")
        except BaseException:
            self.kill()
            raise
        self.started = True
        threading.Thread(target=self._watch, name="jpaged-fleet-watchdog", daemon=True).start()

    def _watch(self):
        """Kill replicas that stopped answering (the driver does it: `_unresponsive`)."""
        while not self.stopping:
            time.sleep(HEARTBEAT_INTERVAL_S)
            self.check_heartbeats(time.monotonic())

    def check_heartbeats(self, now: float):
        """Post the replicas silent for longer than the timeout to the driver, which kills them."""
        for rank, replica in enumerate(list(self.replicas)):
            if replica is not None and self.states[rank] in ("starting", "up") \
                    and now - replica.last_seen > self.heartbeat_timeout and replica.exitcode is None:
                self._post(lambda r=replica, s=now - replica.last_seen: self._unresponsive(r, s))

    def _unresponsive(self, replica: "ReplicaProcess", silence: float):
        rank = replica.rank
        if self.replicas[rank] is not replica or self.stopping or replica.exitcode is not None:
            return
        self.errors[rank] = f"no heartbeat for {silence:.1f} s (stopped or hung): killed"
        logger.error("data-parallel replica %d (pid %d): %s", rank, replica.pid, self.errors[rank])
        replica.kill()  # its pipe closes: its reader reports the exit (_on_exit)

    def _spawn(self, rank: int):
        self.states[rank], self.errors[rank] = "starting", None
        self.replicas[rank] = ReplicaProcess(rank, self.config, self.lora_modules, self._post, self._on_message)

    def shutdown(self):
        """Stop every replica (each finishes its current step); blocking."""
        self.stopping = True
        threads = [threading.Thread(target=r.stop) for r in self.replicas if r is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def kill(self):
        self.stopping = True
        for r in self.replicas:
            if r is not None:
                r.kill()

    @property
    def up(self) -> list[int]:
        return [r for r in range(self.size) if self.states[r] == "up"]

    @property
    def coming_back(self) -> bool:
        """Some replica is starting or will be restarted: requests may be served again."""
        return any(state in ("starting", "restarting") for state in self.states)

    def health(self) -> dict:
        replicas = [{"rank": r, "pid": None if p is None else p.pid, "state": self.states[r],
                     "restarts": self.restarts[r], **({"error": self.errors[r]} if self.errors[r] else {}),
                     **({"last_exit": self.last_exit[r]} if self.last_exit[r] else {})}
                    for r, p in enumerate(self.replicas)]
        down = [r for r in range(self.size) if self.states[r] != "up"]
        return {"status": "ok" if not down else "degraded" if len(down) < self.size else "down",
                "degraded": bool(down), "down": down, "replicas": replicas}

    # ------------------------------------------------------------------ requests
    def submit(self, request_id: str, prompt_token_ids: list[int], params, lora_request=None,
               rank: int | None = None) -> int:
        """Send the request to the replica the router picks, or to replica `rank` (an external
        router chose it: --data-parallel-external-lb); its "added" comes back later."""
        if rank is not None:
            if self.states[rank] != "up":
                raise ReplicaDiedError(f"data-parallel replica {rank} is {self.states[rank]}")
        else:
            for r in range(self.size):
                self.router.set_load(r, self.loads[r])
            salt = None if lora_request is None else f"lora:{lora_request.lora_int_id}".encode()
            try:
                rank = self.router.route(prompt_token_ids, salt)
            except RuntimeError as e:
                raise ReplicaDiedError(f"no replica can take the request: {self._why_down()}") from e
        self.requests[request_id] = _Request(rank, prompt_token_ids, params, lora_request)
        self.loads[rank] += 1
        self.replicas[rank].send(("add", request_id, prompt_token_ids, params, lora_request))
        return rank

    def abort(self, request_id: str):
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.loads[request.rank] -= 1
            self.replicas[request.rank].send(("abort", request_id))

    def rank_of(self, request_id: str) -> int | None:
        request = self.requests.get(request_id)
        return None if request is None else request.rank

    def call_all(self, fn) -> int:
        """Run fn(engine) in every replica that is up; on_call_done gets the answers."""
        call_id, ranks = next(self._call_ids), set(self.up)
        self._calls[call_id] = (ranks, {})
        for rank in ranks:
            self.replicas[rank].send(("call", call_id, fn))
        if not ranks:
            self._finish_call(call_id)
        return call_id

    # ------------------------------------------------------------------ messages
    def _on_message(self, replica: ReplicaProcess, message: tuple):
        rank = replica.rank
        if self.replicas[rank] is not replica:  # from a process this rank replaced
            return
        kind = message[0]
        if kind == "step":
            _, outputs, failed, events, stats = message
            self.router.on_events(rank, events)
            self.stats[rank] = stats
            for out in outputs:
                request = self.requests.get(out.request_id)
                if request is not None:
                    request.started = True
                    if out.finished:
                        self._forget(out.request_id)
            for request_id in failed[0] if failed else ():
                self._forget(request_id)
            self.on_step(rank, outputs, failed)
        elif kind == "added":
            _, request_id, error = message
            request = self.requests.get(request_id)
            if request is not None and request.rank == rank:
                request.added = True
                if error is not None:
                    self._forget(request_id)
                self.on_added(request_id, error)
        elif kind == "result":
            _, call_id, error_type, value = message
            if call_id in self._calls:
                waiting, answers = self._calls[call_id]
                waiting.discard(rank)
                answers[rank] = (error_type, value)
                if not waiting:
                    self._finish_call(call_id)
        elif kind == "ready":
            info = message[1]
            self.info = self.info or info
            self.stats[rank] = info["stats"]
            for fn in self.replayed:  # adapters loaded while this rank was down or starting
                replica.send(("call", -1, fn))
            self.states[rank], self.failures[rank] = "up", 0
            self.router.set_up(rank, True)
            logger.info("data-parallel replica %d is up (pid %d)", rank, replica.pid)
            self.on_change()
        elif kind == "fatal":
            self.errors[rank] = message[1]
            if message[2]:
                logger.error("data-parallel replica %d (pid %d) failed:\n%s", rank, replica.pid, message[2])
        elif kind == "exit":
            self._on_exit(replica)

    def _forget(self, request_id: str):
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.loads[request.rank] -= 1

    def _finish_call(self, call_id: int):
        _, answers = self._calls.pop(call_id)
        if call_id >= 0:
            self.on_call_done(call_id, answers)

    def _why_down(self) -> str:
        return "; ".join(f"replica {r} is {self.states[r]}" + (f" ({self.errors[r]})" if self.errors[r] else "")
                         for r in range(self.size) if self.states[r] != "up") or "none is up"

    def _on_exit(self, replica: ReplicaProcess):
        """The replica's pipe closed: it exited or was killed."""
        rank, was = replica.rank, self.states[replica.rank]
        try:
            code = replica.process.wait(5)
        except subprocess.TimeoutExpired:  # its pipe closed but it lives on: it cannot serve
            replica.kill()
            code = replica.exitcode
        if self.errors[rank] is None:
            self.errors[rank] = f"exited with status {code}" if code is None or code >= 0 else \
                f"killed by signal {-code}"
        restart = self.config.dp_restart and self.started and not self.stopping
        self.states[rank] = "restarting" if restart else "failed" if was == "starting" and self.info is not None \
            else "down"
        self.router.set_up(rank, False)
        self.stats[rank] = None
        if self.stopping:
            return
        logger.error("data-parallel replica %d (pid %d) %s", rank, replica.pid, self.errors[rank])
        for call_id, (waiting, answers) in list(self._calls.items()):
            if rank in waiting:
                waiting.discard(rank)
                answers[rank] = ("ReplicaDiedError", f"replica {rank} died: {self.errors[rank]}")
                if not waiting:
                    self._finish_call(call_id)
        lost, unstarted = [], []
        for request_id, request in list(self.requests.items()):
            if request.rank != rank:
                continue
            self.loads[rank] -= 1
            del self.requests[request_id]
            if not request.started and self.up:  # nothing was sent to the client: another replica runs it
                moved = self.submit(request_id, request.prompt_token_ids, request.params, request.lora_request)
                logger.info("request %s moved from replica %d to %d", request_id, rank, moved)
            elif not request.started and (restart or self.coming_back):
                unstarted.append(request_id)
            else:
                lost.append(request_id)
        why = f"data-parallel replica {rank} (pid {replica.pid}) died while serving the request: {self.errors[rank]}"
        if lost:
            self.on_lost(lost, ReplicaDiedError(why))
        if unstarted:
            self.on_lost(unstarted, NoReplicaUpError(f"{why}; no other replica is up yet: retry later"))
        self.last_exit[rank] = self.errors[rank]
        if restart:
            delay = 0.0 if self.failures[rank] == 0 else \
                min(RESTART_BACKOFF_S * 2 ** (self.failures[rank] - 1), RESTART_BACKOFF_MAX_S)
            self.failures[rank] += 1
            logger.info("restarting data-parallel replica %d%s", rank, f" in {delay:g} s" if delay else "")
            if delay:
                timer = threading.Timer(delay, self._post, (lambda: self._restart(rank, replica),))
                timer.daemon = True
                timer.start()
            else:
                self._restart(rank, replica)
        self.on_change()

    def _restart(self, rank: int, dead: "ReplicaProcess"):
        if self.stopping or self.replicas[rank] is not dead:
            return
        self.restarts[rank] += 1
        self._spawn(rank)

    def wait_until(self, condition: Callable[[], bool], timeout: float):
        """Offline driver: pump until `condition()` or `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            self.pump(timeout=0.1)
        return condition()
