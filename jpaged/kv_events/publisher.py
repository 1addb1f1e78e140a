"""Publishing KV event batches over ZMQ, as vLLM's ZmqEventPublisher does on the wire.

Each batch goes out on a PUB socket as three frames: topic, an 8-byte big-endian sequence number
(0, 1, 2, ... per publisher), and the msgpack payload (laid out as `encoding` says: events.py). The last `buffer_steps` payloads are kept:
a subscriber that missed some (PUB drops when a subscriber is slow or not yet connected) sends an
8-byte start sequence number to the ROUTER `replay_endpoint` and gets every kept batch from that
number on, each as (sequence number, payload), then (-1 as a signed 8-byte number, b"").

The engine's thread only queues batches; one publisher thread encodes and sends them, and another
answers replay requests, so neither a slow network nor a replay holds a step or a live batch.
Sockets are made (bound or connected) in the constructor, so a bad or busy address fails the
engine's start-up, not a later step.

Memory is bounded in bytes whatever subscribers do (a subscriber that never reads keeps what was
queued for it until it leaves; ZMQ's high-water marks count messages, per connection):
  - the PUB socket is an XPUB (the same on the wire) whose subscriptions are applied here: only
    while at most MAX_SUBSCRIBERS connections are open (one arriving past that receives nothing:
    a warning says so, and it may reconnect later), and only prefixes of the topic (others can
    never match: not kept);
  - each subscriber's queue holds at most SEND_BUDGET_BYTES / MAX_SUBSCRIBERS bytes: its high-water
    mark is that over the largest payload yet (rounded up to a power of two), lowered as payloads
    grow (then min'd with `hwm`); past it a slow subscriber's batches are dropped, and it sees the
    gap in sequence numbers;
  - replay requests are answered only while at most MAX_REPLAY_PEERS replay connections are open,
    MAX_CONCURRENT_REPLAYS at a time (others are dropped unanswered: a client asks again), without
    blocking, into queues of REPLAY_BUDGET_BYTES / MAX_REPLAY_PEERS bytes each; an answer its client
    does not read for REPLAY_STALL_S is abandoned;
  - the kept batches are at most `buffer_steps` and KEPT_BYTES;
  - TCP send buffers are SOCKET_SNDBUF (the kernel's, outside the process, are bounded too).
"""

import collections
import dataclasses
import logging
import queue
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from jpaged.kv_events.config import KVEventsConfig, binds, check_local_addresses, offset_endpoint
from jpaged.kv_events.events import BatchEncoder, EventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

SEND_BUDGET_BYTES = 64 << 20  # every subscriber's queue together
MAX_SUBSCRIBERS = 32  # open connections under which a subscription is applied
REPLAY_BUDGET_BYTES = 32 << 20  # every replay client's queue together
MAX_REPLAY_PEERS = 16  # open replay connections under which a request is answered
MAX_CONCURRENT_REPLAYS = 4
REPLAY_STALL_S = 2.0  # an answer whose client reads nothing for this long is abandoned
REPLAY_CHUNK = 64  # batches sent to one replay client before the next one's turn
KEPT_BYTES = 64 << 20  # the kept batches' payloads, at most
SOCKET_SNDBUF = 256 << 10  # SO_SNDBUF of every connection
QUEUED_BATCH_OVERHEAD = 256  # bytes a queued batch costs besides its payload (3 zmq_msg_t, pipe slots)
MIN_PAYLOAD_ESTIMATE = 4096
MAX_INBOUND_BYTES = 1024  # a subscription (plus the topic's length) or a replay request: larger ones disconnect
WARNING_INTERVAL_S = 10.0


def queue_hwm(budget: int, payload_estimate: int, cap: int = 0) -> int:
    """How many batches of `payload_estimate` bytes fit in `budget` bytes (at least 1), at most
    `cap` (0: no cap)."""
    fits = max(1, budget // (payload_estimate + QUEUED_BATCH_OVERHEAD))
    return min(fits, cap) if cap > 0 else fits


class NullEventPublisher:
    """Events off: batches go nowhere."""

    def publish(self, batch: EventBatch):
        pass

    def shutdown(self):
        pass


class _Warning:
    """A warning logged at most once per WARNING_INTERVAL_S, with how many were held back."""

    def __init__(self, message: str):
        self.message, self.held, self.next = message, 0, 0.0

    def __call__(self, *args):
        now = time.monotonic()
        if now < self.next:
            self.held += 1
            return
        logger.warning("KV events: " + self.message + (f" ({self.held} more since the last such warning)"
                                                       if self.held else ""), *args)
        self.held, self.next = 0, now + WARNING_INTERVAL_S


class _Connections:
    """The connections a socket has open now, from its monitor's events (one file descriptor each);
    read only by the thread that uses the socket."""

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self.monitor = socket.get_monitor_socket(self.EVENTS)
        self.monitor.set_hwm(100_000)  # events are dropped past it (then the count stays high: refusing, not growing)
        self.fds: set[int] = set()

    def count(self) -> int:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return len(self.fds)
            if event["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self.fds.add(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.fds.discard(event["value"])

    def close(self):
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)


@dataclasses.dataclass
class _Answer:
    """A replay under way: the next sequence number to send, the last one to send before the end."""

    next: int
    last: int
    stalled_since: float | None = None


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank, "replay_endpoint")
        check_local_addresses(config, [data_parallel_rank])
        self._topic = config.topic.encode()
        self.encoding = config.encoding
        self._hwm = config.hwm
        self._buffer_steps = config.buffer_steps
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._kept: collections.deque = collections.deque()  # (seq, payload), seq consecutive
        self._kept_bytes = 0
        self._kept_lock = threading.Lock()
        self._next_seq = 0
        self._payload_estimate = MIN_PAYLOAD_ESTIMATE  # the largest payload yet, rounded up to a power of two
        self.refused_subscriptions = 0
        self.refused_replays = 0
        self._stopping = threading.Event()
        self._context = zmq.Context.instance()
        self._pub = self._replay = self._pub_connections = self._replay_connections = None
        try:
            self._pub = self._context.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
            self._pub.setsockopt(zmq.SNDHWM, self._subscriber_hwm())
            self._pub.setsockopt(zmq.SNDBUF, SOCKET_SNDBUF)
            self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES + len(self._topic))
            self._pub_connections = _Connections(self._pub)
            self._open(self._pub, "endpoint", config.endpoint, self.endpoint, bind=binds(self.endpoint))
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue is EAGAIN, not a silent drop
                self._replay.setsockopt(zmq.SNDHWM, self._replay_hwm())
                self._replay.setsockopt(zmq.SNDBUF, SOCKET_SNDBUF)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
                self._replay_connections = _Connections(self._replay)
                self._open(self._replay, "replay_endpoint", config.replay_endpoint, self.replay_endpoint, bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="jpaged-kv-events", daemon=True)
        self._thread.start()
        self._replay_thread = None
        if self._replay is not None:
            self._replay_thread = threading.Thread(target=self._run_replay, name="jpaged-kv-events-replay",
                                                   daemon=True)
            self._replay_thread.start()

    @staticmethod
    def _open(socket, field: str, configured: str, address: str, bind: bool):
        try:
            socket.bind(address) if bind else socket.connect(address)
        except zmq.ZMQError as e:
            rank = "" if address == configured else f" ({address} for this data-parallel rank)"
            raise ValueError(f"kv_events_config.{field}={configured!r}{rank}: cannot open it ({e})") from None

    def _subscriber_hwm(self) -> int:
        return queue_hwm(SEND_BUDGET_BYTES // MAX_SUBSCRIBERS, self._payload_estimate, self._hwm)

    def _replay_hwm(self) -> int:
        return queue_hwm(REPLAY_BUDGET_BYTES // MAX_REPLAY_PEERS, self._payload_estimate)

    def publish(self, batch: EventBatch):
        """Queue `batch` (stamped with this replica's rank). A full queue drops the batch with a
        warning rather than stalling the engine: subscribers see the gap in sequence numbers."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV events: the publisher queue is full; a batch of %d events is dropped", len(batch.events))

    def shutdown(self, timeout: float = 2.0):
        """Send what is queued (up to `timeout`), then close the sockets. A thread still sending
        then keeps them (a ZMQ socket belongs to one thread; the daemon thread ends with the process)."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            logger.warning("KV events: the publisher queue stayed full; unsent batches are dropped")
        self._thread.join(timeout)
        self._stopping.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout)
        if not self._thread.is_alive() and not (self._replay_thread is not None and self._replay_thread.is_alive()):
            self._close_sockets()

    def _close_sockets(self):
        for connections in (self._pub_connections, self._replay_connections):
            if connections is not None:
                connections.close()
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)

    # ------------------------------------------------------------------ live batches
    def _run(self):
        encoder = BatchEncoder(self.encoding)
        refused = _Warning("a subscription is refused: %d connections are open, over MAX_SUBSCRIBERS=%d (the "
                           "subscriber receives nothing; it may reconnect once others have left)")
        while True:
            self._apply_subscriptions(refused)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encoder.encode(batch)
                if len(payload) > self._payload_estimate:
                    self._payload_estimate = 1 << (len(payload) - 1).bit_length()
                    self._pub.setsockopt(zmq.SNDHWM, self._subscriber_hwm())  # every connection's, queued ones kept
                seq = self._next_seq
                # Never blocks: a subscriber whose queue is full misses this batch.
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                self._keep(seq, payload)
                self._next_seq += 1
            except Exception:  # noqa: BLE001 - the engine goes on; subscribers see the gap
                logger.exception("KV events: publishing a batch failed")

    def _apply_subscriptions(self, refused: _Warning):
        """The XPUB hands up each (un)subscription; a subscription is applied to the connection that
        sent it only while at most MAX_SUBSCRIBERS connections are open, and only if it can match
        the topic (any other is a trie entry for nothing)."""
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not message or message[0] not in (0, 1):
                continue  # not a subscription: a SUB never sends one
            prefix = message[1:]
            if message[0] == 0:
                self._pub.setsockopt(zmq.UNSUBSCRIBE, prefix)
            elif self._topic.startswith(prefix):
                connections = self._pub_connections.count()
                if connections > MAX_SUBSCRIBERS:
                    self.refused_subscriptions += 1
                    refused(connections, MAX_SUBSCRIBERS)
                else:
                    self._pub.setsockopt(zmq.SUBSCRIBE, prefix)

    def _keep(self, seq: int, payload: bytes):
        with self._kept_lock:
            self._kept.append((seq, payload))
            self._kept_bytes += len(payload)
            while len(self._kept) > self._buffer_steps or (self._kept_bytes > KEPT_BYTES and len(self._kept) > 1):
                self._kept_bytes -= len(self._kept.popleft()[1])

    def _kept_from(self, seq: int) -> tuple[int, bytes] | None:
        """The kept batch `seq`, or the oldest kept one after it when it was dropped; None past the newest."""
        with self._kept_lock:
            if not self._kept:
                return None
            index = max(0, seq - self._kept[0][0])
            return self._kept[index] if index < len(self._kept) else None

    # ------------------------------------------------------------------ replay
    def _run_replay(self):
        router, connections = self._replay, self._replay_connections
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(connections.monitor, zmq.POLLIN)
        answers: dict[bytes, _Answer] = {}
        warnings = {"malformed": _Warning("ignored a malformed replay request (%d frames)"),
                    "refused": _Warning("a replay request is dropped unanswered: %d replays under way, %d replay "
                                        "connections open (at most %d and %d)"),
                    "stalled": _Warning("a replay is abandoned: its client read nothing for %.0f s")}
        estimate = self._payload_estimate
        while not self._stopping.is_set():
            if self._payload_estimate != estimate:
                estimate = self._payload_estimate
                router.setsockopt(zmq.SNDHWM, self._replay_hwm())
            busy = any(a.stalled_since is None for a in answers.values())
            poller.poll(0 if busy else 50)
            self._take_requests(router, connections, answers, warnings)
            for client in list(answers):
                self._send_some(router, client, answers, warnings["stalled"])

    def _take_requests(self, router, connections, answers, warnings):
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                warnings["malformed"](len(frames))
                continue
            client, _, start = frames
            open_connections = connections.count()
            if client not in answers and (len(answers) >= MAX_CONCURRENT_REPLAYS
                                          or open_connections > MAX_REPLAY_PEERS):
                self.refused_replays += 1
                warnings["refused"](len(answers), open_connections, MAX_CONCURRENT_REPLAYS, MAX_REPLAY_PEERS)
                continue
            with self._kept_lock:
                last = self._kept[-1][0] if self._kept else -1
            answers[client] = _Answer(int.from_bytes(start, "big"), last)  # a new request restarts its answer

    def _send_some(self, router, client: bytes, answers: dict, stalled: _Warning):
        """Up to REPLAY_CHUNK more batches of `client`'s answer, then its end; never blocks."""
        answer = answers[client]
        for _ in range(REPLAY_CHUNK):
            item = self._kept_from(answer.next) if answer.next <= answer.last else None
            frames = (client, b"", END_OF_REPLAY, b"") if item is None else \
                (client, b"", item[0].to_bytes(8, "big"), item[1])
            try:
                router.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: the client is not reading
                now = time.monotonic()
                if answer.stalled_since is None:
                    answer.stalled_since = now
                elif now - answer.stalled_since > REPLAY_STALL_S:
                    stalled(REPLAY_STALL_S)
                    del answers[client]
                return
            except zmq.ZMQError:  # EHOSTUNREACH: the client left
                del answers[client]
                return
            answer.stalled_since = None
            if item is None:
                del answers[client]
                return
            answer.next = item[0] + 1


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0):
    if config is None or not config.enabled:
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)
