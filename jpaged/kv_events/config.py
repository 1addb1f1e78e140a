"""KVEventsConfig: vLLM's `--kv-events-config` (a dict or a JSON object string), checked."""

import dataclasses

from jpaged.json_option import option_fields

PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's fields and defaults. `publisher` None means "zmq" when events are enabled, else "null"."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"  # PUB address: bound when it has a wildcard (or ipc/inproc), else connected
    replay_endpoint: str | None = None  # ROUTER address a subscriber asks for missed batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: messages queued per subscriber before dropping
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

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
            return isinstance(x, int) and not isinstance(x, bool) and x >= low

        def endpoint(x):
            return isinstance(x, str) and x.startswith(ENDPOINT_SCHEMES) and len(x) > len(x.split("//")[0]) + 2

        check("enable_kv_cache_events", isinstance(self.enable_kv_cache_events, bool), "true or false")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        check("publisher", self.publisher in PUBLISHERS, f"one of {PUBLISHERS}")
        check("endpoint", endpoint(self.endpoint), f"an address starting with one of {ENDPOINT_SCHEMES}")
        check("replay_endpoint", self.replay_endpoint is None or endpoint(self.replay_endpoint),
              f"null or an address starting with one of {ENDPOINT_SCHEMES}")
        check("replay_endpoint", self.replay_endpoint is None or self.replay_endpoint != self.endpoint,
              "an address other than endpoint's")
        check("buffer_steps", count(self.buffer_steps, 1), "an integer >= 1")
        check("hwm", count(self.hwm, 0), "an integer >= 0 (0: no limit)")
        check("max_queue_size", count(self.max_queue_size, 1), "an integer >= 1")
        check("topic", isinstance(self.topic, str), "a string")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Replica `rank`'s own address (as vLLM gives each data-parallel rank its own): a tcp port
    moves up by the rank, an ipc/inproc name gets a `_dp<rank>` suffix; rank 0 keeps the address."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_config endpoint {endpoint!r} has no port to offset for data-parallel "
                             f"rank {data_parallel_rank}")
        return f"{host}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"
