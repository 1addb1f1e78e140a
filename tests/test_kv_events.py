"""KV events on the wire: a subscriber written only from vLLM's schema (its own msgspec structs,
pyzmq) reads jpaged's batches, live and by replay; bad configurations are clear errors."""

import json

import msgspec
import numpy as np
import pytest
import zmq
from kv_event_consumers import ts_of

from jpaged.kv_events.config import KVEventsConfig, offset_endpoint
from jpaged.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, external_block_hash
from jpaged.kv_events.publisher import END_OF_REPLAY, NullEventPublisher, make_publisher


# ---- vLLM's schema, restated (vllm/distributed/kv_events.py): what a router written for vLLM decodes.
class VEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VKVEventBatch)


def random_batches(rng, count: int, block_size: int = 16):
    batches, mine = [], []
    for i in range(count):
        events, theirs = [], []
        for _ in range(int(rng.integers(1, 4))):
            kind = int(rng.integers(0, 3))
            hashes = [external_block_hash(rng.bytes(32)) for _ in range(int(rng.integers(1, 4)))]
            if kind == 0:
                tokens = rng.integers(0, 50_000, block_size * len(hashes)).tolist()
                parent = None if rng.random() < 0.3 else external_block_hash(rng.bytes(32))
                lora = None if rng.random() < 0.5 else (int(rng.integers(1, 9)), "adapter")
                events.append(BlockStored(hashes, parent, tokens, block_size, lora and lora[0], "GPU", lora and lora[1]))
                theirs.append(VBlockStored(hashes, parent, tokens, block_size, lora and lora[0], "GPU", lora and lora[1]))
            elif kind == 1:
                events.append(BlockRemoved(hashes, "GPU"))
                theirs.append(VBlockRemoved(hashes, "GPU"))
            else:
                events.append(AllBlocksCleared())
                theirs.append(VAllBlocksCleared())
        batches.append(KVEventBatch(ts=1.7e9 + i, events=events))
        mine.append(VKVEventBatch(ts=1.7e9 + i, events=theirs, data_parallel_rank=3))
    return batches, mine


def test_the_payload_is_byte_for_byte_vllms():
    rng = np.random.default_rng()
    ours, theirs = random_batches(rng, 20)
    encoder = msgspec.msgpack.Encoder()
    for a, b in zip(ours, theirs):
        a.data_parallel_rank = 3
        assert encoder.encode(a) == encoder.encode(b)
        assert DECODER.decode(encoder.encode(a)) == b
    # The optional trailing fields are left out when unset, as vLLM leaves them out.
    stored = msgspec.msgpack.decode(encoder.encode(ours[0].events[0] if isinstance(ours[0].events[0], BlockStored)
                                                   else BlockStored([1], None, [1], 1, None, "GPU", None)))
    assert stored["type"] == "BlockStored" and "extra_keys" not in stored and "lora_name" in stored


def test_block_hashes_as_vllm_publishes_them(monkeypatch):
    digest = bytes(range(32))
    assert external_block_hash(digest) == int.from_bytes(digest[-8:], "big")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert external_block_hash(digest) == digest


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replay(context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    try:
        while True:
            assert dealer.poll(10_000), "no replay answer in 10 s"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_live_batches_and_replay_of_the_missed_ones():
    rng = np.random.default_rng()
    port, replay_port = _free_port(), _free_port()
    config = KVEventsConfig.of(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                           "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv",
                                           "buffer_steps": 50, "encoding": "map"}))
    publisher = make_publisher(config, data_parallel_rank=0)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    ours, theirs = random_batches(rng, 60)
    for t in theirs:
        t.data_parallel_rank = 0
    try:
        live, sent = [], 0
        # A SUB socket sees nothing until its subscription reaches the PUB ("slow joiner"): batches
        # go out one at a time until one arrives; those before it are what replay is for.
        while not live:
            assert sent < len(ours) - 10, "the subscriber never received a batch"
            publisher.publish(ours[sent])
            sent += 1
            if sub.poll(200):
                live.append(sub.recv_multipart())
        for batch in ours[sent:]:
            publisher.publish(batch)
        while len(live) < len(ours) - int.from_bytes(live[0][1], "big"):
            assert sub.poll(10_000), "a live batch did not arrive"
            live.append(sub.recv_multipart())
        first = int.from_bytes(live[0][1], "big")
        for k, (topic, seq, payload) in enumerate(live):
            assert topic == b"kv" and int.from_bytes(seq, "big") == first + k
            assert DECODER.decode(payload) == theirs[first + k]
        # Replay from 0: only the last buffer_steps batches are kept.
        replayed = _replay(context, f"tcp://127.0.0.1:{replay_port}", 0)
        assert [s for s, _ in replayed] == list(range(len(ours) - 50, len(ours)))
        assert [DECODER.decode(p) for _, p in replayed] == theirs[-50:]
        assert [s for s, _ in _replay(context, f"tcp://127.0.0.1:{replay_port}", 55)] == list(range(55, 60))
    finally:
        sub.close(linger=0)
        publisher.shutdown()


@pytest.mark.parametrize("value, field", [
    ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "endpoint"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5557"}', "replay_endpoint"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"hwm": -1}', "hwm"),
    ('{"max_queue_size": true}', "max_queue_size"),
    ('{"topic": 3}', "topic"),
    ('{"endpoints": "tcp://*:1"}', "unknown fields"),
    # Ports ZMQ would take otherwise: 99999 listened on 34463, * on a port no subscriber knows.
    ('{"endpoint": "tcp://*:99999"}', "endpoint"),
    ('{"endpoint": "tcp://*:0"}', "endpoint"),
    ('{"endpoint": "tcp://*:*"}', "endpoint"),
    ('{"endpoint": "tcp://*:-1"}', "endpoint"),
    ('{"endpoint": "tcp://127.0.0.1"}', "endpoint"),
    ('{"endpoint": "tcp://:5557"}', "endpoint"),
    ('{"endpoint": "tcp://*:\u0665"}', "endpoint"),
    ('{"replay_endpoint": "tcp://*:65536"}', "replay_endpoint"),
    ('{"endpoint": "ipc:///tmp/' + "x" * 120 + '"}', "endpoint"),
    ('{"buffer_steps": 1000000000000000}', "buffer_steps"),
    ('{"max_queue_size": 1000000000000000}', "max_queue_size"),
    ('{"hwm": 1000000000000000}', "hwm"),
    ('{"buffer_steps": 1e15}', "buffer_steps"),
    ('[1]', "JSON object"),
    ('{"enable_kv_cache_events": true,', "not valid JSON"),
])
def test_bad_configs_name_the_field(value, field):
    with pytest.raises(ValueError, match=field) as error:
        KVEventsConfig.of(value)
    assert "\n" not in str(error.value)


def test_defaults_and_the_null_publisher():
    assert KVEventsConfig.of({}).publisher == "null" and not KVEventsConfig.of({}).enabled
    config = KVEventsConfig.of({"enable_kv_cache_events": True})
    assert config.publisher == "zmq" and config.endpoint == "tcp://*:5557" and config.enabled
    assert isinstance(make_publisher(None), NullEventPublisher)
    assert isinstance(make_publisher(KVEventsConfig.of({"enable_kv_cache_events": False})), NullEventPublisher)


def test_each_data_parallel_rank_gets_its_own_address():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert offset_endpoint(None, 2) is None
    with pytest.raises(ValueError, match="no port"):
        offset_endpoint("tcp://host", 1)


def test_a_busy_address_fails_at_start_up():
    port = _free_port()
    config = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    first = make_publisher(config)
    try:
        with pytest.raises(ValueError, match="cannot open"):
            make_publisher(config)
    finally:
        first.shutdown()


# ---- The block pool's own stores and evictions, as events (the model-free engine of test_scheduler).
@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
@pytest.mark.parametrize("seed", range(4))
def test_events_replay_into_the_block_pools_prefix_cache(monkeypatch, preemption_mode, seed):
    """After every step, a subscriber's view built only from the events (stored hashes added,
    removed ones dropped, a clear empties it) equals the pool's prefix cache; each stored chain's
    hashes recompute from its token ids and parent (raw hashes: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    from test_scheduler import FakeEngine

    from jpaged.core.block_manager import hash_block_tokens

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    engine = FakeEngine(block_size=4, num_gpu_blocks=int(rng.integers(12, 24)), num_cpu_blocks=32, max_num_seqs=6,
                        preemption_mode=preemption_mode, enable_caching=True)
    engine.bm.enable_kv_events()
    families = [tuple(rng.integers(0, 1000, 24).tolist()) for _ in range(3)]
    arrivals = {}
    for i in range(16):
        prefix = families[int(rng.integers(0, 3))][:int(rng.integers(0, 24))]
        arrivals.setdefault(int(rng.integers(0, 20)), []).append(
            (f"r{i}", int(rng.integers(len(prefix) + 1, 30)), int(rng.integers(1, 12)), int(rng.integers(1, 3)), prefix))
    view: set = set()
    counts = {"BlockStored": 0, "BlockRemoved": 0}
    encoder = msgspec.msgpack.Encoder()

    def check():
        for event in DECODER.decode(encoder.encode(KVEventBatch(0.0, engine.bm.take_events()))).events:
            if isinstance(event, VBlockStored):
                counts["BlockStored"] += 1
                assert event.block_size == 4 and len(event.token_ids) == 4 * len(event.block_hashes)
                assert event.parent_block_hash is None or event.parent_block_hash in view
                parent = event.parent_block_hash
                for k, block_hash in enumerate(event.block_hashes):
                    assert block_hash == hash_block_tokens(parent, event.token_ids[4 * k:4 * k + 4])
                    assert block_hash not in view
                    view.add(block_hash)
                    parent = block_hash
            elif isinstance(event, VBlockRemoved):
                counts["BlockRemoved"] += 1
                assert set(event.block_hashes) <= view
                view.difference_update(event.block_hashes)
            else:
                view.clear()
        assert view == set(engine.bm.gpu_pool.cached_blocks)

    while engine.scheduler.has_unfinished_seqs() or arrivals:
        for args in arrivals.pop(engine.num_steps, []):
            engine.add(*args)
        engine.step()
        check()
    print(counts)
    assert counts["BlockStored"] > 0 and counts["BlockRemoved"] > 0
    engine.bm.reset_prefix_cache()
    check()
    assert not view


def test_an_engine_publishes_its_prefix_cache():
    """The tiny model with prefix caching and events on: the batches, read back by replay, rebuild
    exactly the pool's prefix cache, with stores and evictions; a reset publishes AllBlocksCleared."""
    import time

    import jpaged
    from jpaged.engine import sleep_mode

    rng = np.random.default_rng()
    port, replay_port = _free_port(), _free_port()
    llm = jpaged.LLM("tiny", enforce_eager=True, enable_prefix_caching=True, block_size=8, max_model_len=256,
                     num_gpu_blocks_override=16, max_num_seqs=4,
                     kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                       "replay_endpoint": f"tcp://*:{replay_port}", "topic": "jpaged",
                                       "encoding": "map"})
    engine = llm.llm_engine
    publisher = engine.kv_event_publisher
    published = []
    send = publisher.publish
    publisher.publish = lambda batch: (published.append(batch), send(batch))
    try:
        system = rng.integers(1, 200, 40).tolist()
        prompts = [system[:int(rng.integers(8, 41))] + rng.integers(1, 200, int(rng.integers(1, 30))).tolist()
                   for _ in range(8)]
        params = jpaged.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        before_reset = {external_block_hash(h) for h in engine.block_manager.gpu_pool.cached_blocks}
        sleep_mode.reset_prefix_cache(engine)
        llm.generate(prompts[:3], params, use_tqdm=False)
        cached = {external_block_hash(h) for h in engine.block_manager.gpu_pool.cached_blocks}
        context = zmq.Context.instance()
        deadline = time.monotonic() + 30
        while True:  # the publisher thread sends in the background: ask until every batch is out
            replayed = _replay(context, f"tcp://127.0.0.1:{replay_port}", 0)
            if len(replayed) == len(published) or time.monotonic() > deadline:
                break
        assert [seq for seq, _ in replayed] == list(range(len(published)))
        view, kinds, cleared_at = set(), [], None
        for _, payload in replayed:
            batch = DECODER.decode(payload)
            assert batch.data_parallel_rank == 0
            for event in batch.events:
                kinds.append(type(event).__name__)
                if isinstance(event, VBlockStored):
                    assert event.block_size == 8 and event.medium == "GPU" and event.lora_id is None
                    view.update(event.block_hashes)
                elif isinstance(event, VBlockRemoved):
                    view.difference_update(event.block_hashes)
                else:
                    assert view == before_reset
                    view.clear()
                    cleared_at = len(kinds)
        print({k: kinds.count(k) for k in set(kinds)})
        assert view == cached and cached
        assert cleared_at is not None and "VBlockRemoved" in kinds and "VBlockStored" in kinds[cleared_at:]
    finally:
        engine.shutdown()


def test_events_need_prefix_caching():
    from jpaged.config import EngineConfig

    with pytest.raises(ValueError, match="kv_events_config"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true}')
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": false}').kv_events_config.publisher == "null"


# ---- Start-up: every bad address a one-line error naming the field, before anything is bound.
def test_data_parallel_ranks_ports_are_checked():
    from jpaged.config import EngineConfig

    def config(dp, **fields):
        return EngineConfig(model="tiny", enable_prefix_caching=True, data_parallel_size=dp,
                            kv_events_config={"enable_kv_cache_events": True, **fields})

    with pytest.raises(ValueError, match=r"kv_events_config.endpoint='tcp://\*:65535'.*rank 1"):
        config(2, endpoint="tcp://*:65535")
    config(1, endpoint="tcp://*:65535")
    with pytest.raises(ValueError, match=r"kv_events_config.replay_endpoint=.*another rank's endpoint"):
        config(2, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")
    config(2, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5559")
    with pytest.raises(ValueError, match="no port"):
        offset_endpoint("tcp://host", 1)


def test_an_ipc_path_naming_a_file_is_refused_and_the_file_kept(tmp_path):
    import socket

    from jpaged.kv_events.config import check_local_addresses

    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    for field in ("endpoint", "replay_endpoint"):
        config = KVEventsConfig.of({"enable_kv_cache_events": True, field: f"ipc://{precious}",
                                    **({"endpoint": f"ipc://{tmp_path}/pub"} if field == "replay_endpoint" else {})})
        with pytest.raises(ValueError, match=f"kv_events_config.{field}=.*exists and is not a socket"):
            make_publisher(config)
        assert precious.read_text() == "keep me"
    # A data-parallel rank's path too: rank 1 binds PATH_dp1.
    (tmp_path / "kv_dp1").write_text("keep me too")
    config = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv"})
    with pytest.raises(ValueError, match="kv_dp1 exists and is not a socket"):
        check_local_addresses(config, range(2))
    assert (tmp_path / "kv_dp1").read_text() == "keep me too"
    # A socket another process listens on is refused; a stale one (nobody listening) is replaced.
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "live"))
    live.listen()
    try:
        with pytest.raises(ValueError, match="another process listens on"):
            make_publisher(KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/live"}))
    finally:
        live.close()
    publisher = make_publisher(KVEventsConfig.of({"enable_kv_cache_events": True,
                                                  "endpoint": f"ipc://{tmp_path}/live"}))
    publisher.shutdown()


def _serve(*args, code=None, timeout=300):
    import os
    import subprocess
    import sys

    code = code or "import sys, serving.cli as c; sys.exit(c.main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "serve", "--model", "tiny", "--max-model-len", "64", *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_events_on_the_servers_own_port_are_a_one_line_error():
    """Used to abort the server at start (SIGABRT, exit 134, "FATAL: exception not rethrown"):
    now exit 2 before anything loads, one line naming the field; a data-parallel rank's port and
    the replay endpoint's too."""
    from jpaged.kv_events.config import check_local_addresses

    port = _free_port()
    run = _serve("--port", str(port), "--enable-prefix-caching", "--kv-events-config",
                 json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}))
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stderr[-3000:])
    assert lines[0] == (f"error: kv_events_config.endpoint='tcp://*:{port}': port {port} is the server's own HTTP "
                        "port (--port); expected another port")
    assert "Loading" not in run.stdout + run.stderr
    for ranks, fields, field in ((range(2), {"endpoint": f"tcp://*:{port - 1}"}, "endpoint"),
                                 ([0], {"replay_endpoint": f"tcp://127.0.0.1:{port}"}, "replay_endpoint")):
        config = KVEventsConfig.of({"enable_kv_cache_events": True, **fields})
        with pytest.raises(ValueError, match=rf"kv_events_config.{field}=.*port {port}.*HTTP port"):
            check_local_addresses(config, ranks, port)
    # Connected to (no wildcard), the port is a subscriber's, elsewhere: no conflict.
    check_local_addresses(KVEventsConfig.of({"enable_kv_cache_events": True,
                                             "endpoint": f"tcp://10.0.0.1:{port}"}), [0], port)


def test_a_port_taken_after_the_check_is_a_clear_error_not_an_abort():
    """The HTTP port taken between `jpaged serve`'s check and the bind (here: the check skipped):
    the engine (its background warm-up, its event sockets) is stopped, one error line, exit 2,
    never the abort at exit of threads still compiling."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        run = _serve("--port", str(port), "--enable-prefix-caching", "--kv-events-config",
                     json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{_free_port()}"}),
                     code="import sys, serving.cli as c; c.check_port = lambda *a: None; "
                          "sys.exit(c.main(sys.argv[1:]))")
    finally:
        holder.close()
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert f"error: cannot listen on 127.0.0.1:{port}" in run.stderr and "Traceback" not in run.stderr


# ---- Bounded in bytes: subscribers and replay clients that never read (issue 60).
def _config(**fields):
    return KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{_free_port()}",
                              "replay_endpoint": f"tcp://*:{_free_port()}", **fields})


def _address(endpoint: str) -> str:
    return endpoint.replace("*", "127.0.0.1")


def _sized_batches(rng, count, low=1, high=8):
    """Batches of one BlockStored of `low` to `high` 16-token blocks (about 70 bytes of payload a block)."""
    batches = []
    for i in range(count):
        n = int(rng.integers(low, high + 1))
        hashes = [external_block_hash(rng.bytes(32)) for _ in range(n)]
        batches.append(KVEventBatch(ts=0.0, events=[BlockStored(hashes, None, rng.integers(0, 50_000, 16 * n).tolist(),
                                                                16, None, "GPU", None)]))
    return batches


def _sent(publisher, count, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while publisher._next_seq < count:
        assert time.monotonic() < deadline, f"{publisher._next_seq} of {count} batches sent"
        time.sleep(0.01)


def _subscribe(context, endpoint, reading=True):
    sub = context.socket(zmq.SUB)
    if not reading:  # as a hostile client: nothing buffered on its side either
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(_address(endpoint))
    return sub


def _until_received(publisher, sub, batch, limit=100):
    """Publish `batch` until `sub` (just connected: its subscription travels) receives one."""
    for _ in range(limit):
        publisher.publish(batch)
        if sub.poll(100):
            return sub.recv_multipart()
    raise AssertionError("the subscriber never received a batch")


def test_subscribers_past_the_limit_receive_nothing(monkeypatch):
    """A subscription is applied only while at most MAX_SUBSCRIBERS connections are open: with
    the limit at 3, the first subscriber and the next two are served, every one after them gets
    nothing (no queue grows for it); once they have left, a new subscriber is served again.
    Subscribers connect one at a time, each handled before the next, so the count the publisher
    sees at each subscription is known."""
    import time

    from jpaged.kv_events import publisher as module

    monkeypatch.setattr(module, "MAX_SUBSCRIBERS", 3)
    seed = 20261128
    print("seed", seed)
    rng = np.random.default_rng(seed)
    publisher = make_publisher(_config())
    context = zmq.Context.instance()
    first = _subscribe(context, publisher.endpoint)
    extra, published = [], 0

    def publish(batch):
        nonlocal published
        publisher.publish(batch)
        published += 1

    try:
        batch, = _sized_batches(rng, 1)
        served, refused = [first], []
        for _ in range(100):  # until its subscription has travelled
            publish(batch)
            if first.poll(100):
                break
        for i in range(5):
            sub = _subscribe(context, publisher.endpoint)
            extra.append(sub)
            before = publisher.refused_subscriptions
            deadline = time.monotonic() + 30
            while True:  # until its subscription has reached the publisher thread: served or refused
                publish(batch)
                if sub.poll(50):
                    served.append(sub)
                    break
                if publisher.refused_subscriptions > before:
                    refused.append(sub)
                    break
                assert time.monotonic() < deadline, f"subscriber {i} neither served nor refused"
        assert len(served) == 3 and served[1:] == extra[:2], (len(served), len(refused))
        assert refused == extra[2:] and publisher.refused_subscriptions == 3
        _sent(publisher, published)
        for s in served:  # what is queued now
            while s.poll(300):
                s.recv_multipart()
        sent = published
        for b in _sized_batches(rng, 50):
            publish(b)
        _sent(publisher, published)
        assert all(not s.poll(300) for s in refused)
        for s in served:
            received = []
            while s.poll(1000) and len(received) < 50:
                received.append(int.from_bytes(s.recv_multipart()[1], "big"))
            assert received == list(range(sent, sent + 50))
        for s in extra:
            s.close(linger=0)
        extra = []
        deadline = time.monotonic() + 30
        while True:  # once their disconnections have reached the publisher, a new subscriber is served
            time.sleep(0.3)
            late = _subscribe(context, publisher.endpoint)
            extra = [late]
            for _ in range(20):
                publish(batch)
                if late.poll(100):
                    break
            if late.poll(0) or time.monotonic() > deadline:
                break
            late.close(linger=0)
        assert late.poll(0), "a subscriber after the others left was not served"
    finally:
        for s in [first, *extra]:
            s.close(linger=0)
        publisher.shutdown()


def test_a_subscriber_that_never_reads_holds_a_bounded_number_of_bytes(monkeypatch):
    """A subscriber that stops reading has at most its share of SEND_BUDGET_BYTES queued for it
    (its high-water mark: that share over the largest payload yet, lowered as payloads grow), then
    its batches are dropped; when it reads again it finds that much, and the sequence gap."""
    from jpaged.kv_events import publisher as module

    budget = 256 << 10
    monkeypatch.setattr(module, "SEND_BUDGET_BYTES", budget)
    monkeypatch.setattr(module, "MAX_SUBSCRIBERS", 1)
    monkeypatch.setattr(module, "SOCKET_SNDBUF", 4096)  # the kernel's buffers aside
    rng = np.random.default_rng()
    publisher = make_publisher(_config())
    context = zmq.Context.instance()
    sub = _subscribe(context, publisher.endpoint, reading=False)
    try:
        small, = _sized_batches(rng, 1, 2, 2)
        _until_received(publisher, sub, small)
        batches = _sized_batches(rng, 1500, 1, 8) + _sized_batches(rng, 1500, 8, 64)  # payloads grow past the estimate
        start = publisher._next_seq
        for b in batches:
            publisher.publish(b)
        _sent(publisher, start + len(batches))
        got, size = [], 0
        while sub.poll(1000):
            frames = sub.recv_multipart()
            got.append(int.from_bytes(frames[1], "big"))
            size += len(frames[2])
        print(f"{len(got)} of {len(batches)} batches, {size} bytes queued for a subscriber that did not read")
        assert 0 < len(got) < len(batches) and got[-1] < start + len(batches) - 1
        assert size <= 2 * budget  # its share, and what the two ends' socket buffers held
    finally:
        sub.close(linger=0)
        publisher.shutdown()


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_replay_clients_that_never_read_hold_neither_memory_nor_live_batches(monkeypatch):
    """Replay requests whose answers nobody reads (a flood, each client asking again): live
    batches still arrive at once (they queued behind the answers, a third of a second here and
    seconds in a server), the process does not grow by the answers (it grew by a full queue of
    them per client), and a replay client that reads gets its whole answer once the flood has gone."""
    import threading
    import time

    from jpaged.kv_events import publisher as module

    monkeypatch.setattr(module, "REPLAY_STALL_S", 0.3)
    rng = np.random.default_rng()
    kept = 1500
    publisher = make_publisher(_config(buffer_steps=kept))
    context = zmq.Context.instance()
    sub = _subscribe(context, publisher.endpoint)
    flood = []
    try:
        batches = _sized_batches(rng, kept, 32, 96)  # about 6 MB kept: each answer that much
        _until_received(publisher, sub, batches[0])
        for b in batches:
            publisher.publish(b)
        _sent(publisher, kept)
        while sub.poll(200):
            sub.recv_multipart()
        rss = _rss_mib()
        for _ in range(60):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.setsockopt(zmq.RCVBUF, 4096)
            dealer.connect(_address(publisher.replay_endpoint))
            flood.append(dealer)
        # 3 s of live batches, one every 10 ms (an engine's steps), while the flood asks again every 0.25 s.
        lives = _sized_batches(rng, 300)
        delays = []

        def read():  # its own thread: each batch timed as it arrives
            while len(delays) < len(lives) and sub.poll(30_000):
                delays.append(time.time() - ts_of(sub.recv_multipart()[2]))

        reader = threading.Thread(target=read)
        reader.start()
        start = time.monotonic()
        for k, live in enumerate(lives):
            if k % 25 == 0:
                for dealer in flood:
                    dealer.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
            live.ts = time.time()
            publisher.publish(live)
            time.sleep(max(0.0, start + (k + 1) * 0.01 - time.monotonic()))
        reader.join()
        assert len(delays) == len(lives)
        growth = _rss_mib() - rss
        print(f"live batches during the replay flood: median {np.median(delays) * 1e3:.1f} ms, largest "
              f"{max(delays) * 1e3:.1f} ms; the process grew by {growth:.0f} MiB; "
              f"{getattr(publisher, 'refused_replays', '?')} replay requests refused")
        assert np.median(delays) < 0.1 and max(delays) < 1.0
        assert growth < 64
        for dealer in flood:
            dealer.close(linger=0)
        flood = []
        deadline = time.monotonic() + 20
        while True:  # once the flood's connections are gone, a reader is answered whole
            time.sleep(0.3)
            replayed = _replay(context, _address(publisher.replay_endpoint), 0)
            if replayed or time.monotonic() > deadline:
                break
        assert [s for s, _ in replayed] == list(range(publisher._next_seq - kept, publisher._next_seq))
    finally:
        for s in [sub, *flood]:
            s.close(linger=0)
        publisher.shutdown()


def test_kept_batches_are_bounded_in_bytes(monkeypatch):
    from jpaged.kv_events import publisher as module

    monkeypatch.setattr(module, "KEPT_BYTES", 64 << 10)
    rng = np.random.default_rng()
    publisher = make_publisher(_config(buffer_steps=10_000))
    try:
        batches = _sized_batches(rng, 300, 8, 16)
        for b in batches:
            publisher.publish(b)
        _sent(publisher, 300)
        replayed = _replay(zmq.Context.instance(), _address(publisher.replay_endpoint), 0)
        size = sum(len(p) for _, p in replayed)
        assert 0 < len(replayed) < 300 and size <= 64 << 10
        assert [s for s, _ in replayed] == list(range(300 - len(replayed), 300))
    finally:
        publisher.shutdown()


def test_the_stress_scripts_flood_keeps_live_batches_on_time():
    """scripts/stress_fleet.py's kv_events_flood, scaled down (60 + 60 clients that never read,
    2 s) against a publisher fed every 10 ms: live batches arrive at once before, during and after."""
    import os
    import sys
    import threading
    import time

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import stress_fleet

    rng = np.random.default_rng()
    publisher = make_publisher(_config(buffer_steps=2000))
    stop = threading.Event()

    def feed():
        batches = _sized_batches(rng, 64, 16, 64)
        k = 0
        while not stop.is_set():
            batch = batches[k % len(batches)]
            batch.ts = time.time()
            publisher.publish(batch)
            k += 1
            time.sleep(0.01)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        result = stress_fleet.kv_events_flood(_address(publisher.endpoint), _address(publisher.replay_endpoint),
                                                subscribers=60, replayers=60, seconds=2.0, pid=os.getpid(),
                                                calm=1.0, settle=1.0)
    finally:
        stop.set()
        feeder.join()
        publisher.shutdown()
    print(result)
    for phase in ("alone", "flood", "after"):
        assert result[phase]["count"] > 0 and result[phase]["median"] < 0.1, (phase, result)
    assert result["rss_peak"] >= result["rss_before"] > 0
