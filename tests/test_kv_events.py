"""KV events on the wire: a subscriber written only from vLLM's schema (its own msgspec structs,
pyzmq) reads jpaged's batches, live and by replay; bad configurations are clear errors."""

import json

import msgspec
import numpy as np
import pytest
import zmq

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
                                           "buffer_steps": 50}))
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
    ('[1]', "JSON object"),
    ('{"enable_kv_cache_events": true,', "not valid JSON"),
])
def test_bad_configs_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        KVEventsConfig.of(value)


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
                                       "replay_endpoint": f"tcp://*:{replay_port}", "topic": "jpaged"})
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
