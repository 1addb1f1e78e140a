"""Publishing KV event batches over ZMQ, as vLLM's ZmqEventPublisher does on the wire.

Each batch goes out on a PUB socket as three frames: topic, an 8-byte big-endian sequence number
(0, 1, 2, ... per publisher), and the msgpack payload. The last `buffer_steps` payloads are kept:
a subscriber that missed some (PUB drops when a subscriber is slow or not yet connected) sends an
8-byte start sequence number to the ROUTER `replay_endpoint` and gets every kept batch from that
number on, each as (sequence number, payload), then (-1 as a signed 8-byte number, b"").

The engine's thread only queues batches; one publisher thread encodes and sends them and answers
replay requests, so a slow network never holds a step. Sockets are made (bound or connected) in
the constructor, so a bad or busy address fails the engine's start-up, not a later step.
"""

import collections
import logging
import queue
import threading

import msgspec
import zmq

from jpaged.kv_events.config import KVEventsConfig, offset_endpoint
from jpaged.kv_events.events import EventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class NullEventPublisher:
    """Events off: batches go nowhere."""

    def publish(self, batch: EventBatch):
        pass

    def shutdown(self):
        pass


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._sent: collections.deque = collections.deque(maxlen=config.buffer_steps)  # (seq, payload)
        self._next_seq = 0
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            # vLLM's rule: an address with a wildcard (or a local one) is ours to bind; else we connect
            # to a subscriber that bound it.
            if "*" in self.endpoint or "::" in self.endpoint or not self.endpoint.startswith("tcp://"):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {self.endpoint!r} / {self.replay_endpoint!r}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="jpaged-kv-events", daemon=True)
        self._thread.start()

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
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self):
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)

    def _run(self):
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encoder.encode(batch)
                seq = self._next_seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._sent.append((seq, payload))
                self._next_seq += 1
            except Exception:  # noqa: BLE001 - the engine goes on; subscribers see the gap
                logger.exception("KV events: publishing a batch failed")

    def _answer_replay(self):
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0):
    if config is None or not config.enabled:
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)
