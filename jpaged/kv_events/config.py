"""KVEventsConfig: vLLM's `--kv-events-config` (a dict or a JSON object string), checked."""

import dataclasses
import os
import socket
import stat

from jpaged.json_option import option_fields
from jpaged.kv_events.events import ENCODINGS

PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
# buffer_steps, hwm and max_queue_size count batches; each is also bounded in bytes by the publisher
# (jpaged/kv_events/publisher.py). Past a million the count only says "unbounded".
MAX_COUNT = 1_000_000
MAX_PORT = 65535
MAX_IPC_PATH = 107  # bytes of a Unix socket's path (sun_path), its terminating NUL aside


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's fields and defaults. `publisher` None means "zmq" when events are enabled, else "null"."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    # PUB address: bound when it has a wildcard (or ipc/inproc), else connected (vLLM's rule).
    # tcp://*:5557 listens on every interface.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # ROUTER address (always bound) a subscriber asks for missed batches
    buffer_steps: int = 10_000  # batches kept for replay (and at most publisher.KEPT_BYTES of them)
    hwm: int = 100_000  # batches queued per subscriber before dropping, at most what the byte budget allows (0: that)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    # jpaged's own field (vLLM has one layout per release): how batches go on the wire, one of
    # events.ENCODINGS. "array" (msgspec's array_like layout) is what llm-d's KV-cache manager,
    # Dynamo's kv-router and vLLM's subscriber example decode; "map_events" is vLLM's layout since
    # vllm-project/vllm#42892; "map" is vLLM's kv_events.py with a map batch too (docs/fleet.md).
    encoding: str = "array"

    @classmethod
    def of(cls, value) -> "KVEventsConfig | None":
        """None, a KVEventsConfig, a dict or a JSON object string (the CLI's); ValueError naming the
        field otherwise."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**option_fields(value, "kv_events_config", cls))

    def __post_init__(self):
        def check(field, ok, expected):
            if not ok:
                raise ValueError(f"kv_events_config.{field}={getattr(self, field)!r}; expected {expected}")

        def count(x, low):
            return isinstance(x, int) and not isinstance(x, bool) and low <= x <= MAX_COUNT

        check("enable_kv_cache_events", isinstance(self.enable_kv_cache_events, bool), "true or false")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        check("publisher", self.publisher in PUBLISHERS, f"one of {PUBLISHERS}")
        check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("replay_endpoint", self.replay_endpoint)
        check("replay_endpoint", self.replay_endpoint is None or self.replay_endpoint != self.endpoint,
              "an address other than endpoint's")
        check("buffer_steps", count(self.buffer_steps, 1), f"an integer from 1 to {MAX_COUNT:,}")
        check("hwm", count(self.hwm, 0), f"an integer from 0 to {MAX_COUNT:,} (0: as many as the byte budget allows)")
        check("max_queue_size", count(self.max_queue_size, 1), f"an integer from 1 to {MAX_COUNT:,}")
        check("topic", isinstance(self.topic, str), "a string")
        check("encoding", isinstance(self.encoding, str) and self.encoding in ENCODINGS, f"one of {ENCODINGS}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def check_ranks(self, data_parallel_size: int):
        """Every data-parallel replica's addresses exist (ports stay <= 65535, ipc paths fit) and no
        replica's endpoint is another's replay endpoint; ValueError naming the field otherwise."""
        for field in ("endpoint", "replay_endpoint"):
            if getattr(self, field) is not None:
                for rank in range(data_parallel_size):
                    check_endpoint(field, offset_endpoint(getattr(self, field), rank, field))
        if self.replay_endpoint is None or data_parallel_size == 1:
            return
        ours = {offset_endpoint(self.endpoint, rank) for rank in range(data_parallel_size)}
        for rank in range(data_parallel_size):
            replay = offset_endpoint(self.replay_endpoint, rank)
            if replay in ours:
                raise ValueError(f"kv_events_config.replay_endpoint={self.replay_endpoint!r}: data-parallel rank "
                                 f"{rank}'s {replay!r} is another rank's endpoint (each rank adds its rank to the "
                                 f"port); expected ports at least data_parallel_size={data_parallel_size} apart")


def check_endpoint(field: str, address):
    """A ValueError naming `field` unless `address` is one ZMQ can bind or connect as written: a
    tcp host and a port from 1 to 65535 (ZMQ takes 99999 as 34463, and * as a port of its choosing
    no subscriber knows), an ipc path that fits a Unix socket, an inproc name."""
    def bad(why):
        raise ValueError(f"kv_events_config.{field}={address!r}; expected {why}")

    if not isinstance(address, str) or not address.startswith(ENDPOINT_SCHEMES):
        bad(f"an address starting with one of {ENDPOINT_SCHEMES}")
    scheme, rest = address.split("//", 1)
    if not rest or "\0" in rest:
        bad(f"an address after {scheme}//")
    if scheme == "tcp:":
        host, colon, port = rest.rpartition(":")
        if not colon or not host:
            bad("tcp://HOST:PORT (HOST * for every interface)")
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= MAX_PORT):
            bad(f"tcp://HOST:PORT with a PORT from 1 to {MAX_PORT}")
    elif scheme == "ipc:" and len(rest.encode()) > MAX_IPC_PATH:
        bad(f"an ipc path of at most {MAX_IPC_PATH} bytes (a Unix socket's limit)")


def binds(address: str) -> bool:
    """vLLM's rule: an address with a wildcard, or an ipc / inproc one, is bound; any other tcp
    address is connected to (a subscriber bound it)."""
    return "*" in address or "::" in address or not address.startswith("tcp://")


def tcp_port(address: str) -> int | None:
    return int(address.rpartition(":")[2]) if address.startswith("tcp://") else None


def offset_endpoint(endpoint: str | None, data_parallel_rank: int, field: str = "endpoint") -> str | None:
    """Replica `rank`'s own address (as vLLM gives each data-parallel rank its own): a tcp port
    moves up by the rank, an ipc/inproc name gets a `_dp<rank>` suffix; rank 0 keeps the address."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_config.{field}={endpoint!r} has no port to offset for data-parallel "
                             f"rank {data_parallel_rank}")
        if int(port) + data_parallel_rank > MAX_PORT:
            raise ValueError(f"kv_events_config.{field}={endpoint!r}: data-parallel rank {data_parallel_rank} would "
                             f"use port {int(port) + data_parallel_rank}; expected a port <= "
                             f"{MAX_PORT - data_parallel_rank} (each rank adds its rank to the port)")
        return f"{host}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def check_local_addresses(config: KVEventsConfig, ranks, http_port: int | None = None):
    """What only this host can say, before anything is bound: an ipc path naming a file that is
    not a socket (binding would delete it: ZMQ unlinks the path first) or a socket another process
    listens on (binding would take it over), and a bound tcp port that is the HTTP server's own
    `http_port`. ValueError naming the field; `ranks`: the data-parallel ranks started here."""
    for field in ("endpoint", "replay_endpoint"):
        base = getattr(config, field)
        if base is None:
            continue
        for rank in ranks:
            address = offset_endpoint(base, rank, field)
            bound = field == "replay_endpoint" or binds(address)
            if http_port and bound and tcp_port(address) == http_port:
                raise ValueError(f"kv_events_config.{field}={base!r}: port {http_port}"
                                 f"{f' (data-parallel rank {rank})' if rank else ''} is the server's own HTTP port "
                                 "(--port); expected another port")
            if address.startswith("ipc://"):
                _check_ipc_path(field, base, address[len("ipc://"):])


def _check_ipc_path(field: str, base: str, path: str):
    if path.startswith("@") or path == "*":  # Linux's abstract namespace, or a name ZMQ chooses: no file
        return
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ValueError(f"kv_events_config.{field}={base!r}: cannot check {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise ValueError(f"kv_events_config.{field}={base!r}: {path} exists and is not a socket (binding would "
                         "delete it); expected a path that does not exist, or a stale socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:  # refused: a socket left by a process that is gone, ours to replace
            return
    raise ValueError(f"kv_events_config.{field}={base!r}: another process listens on {path}; expected a path no "
                     "process is using")
