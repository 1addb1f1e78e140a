"""KV events every consumer decodes: each `KVEventsConfig.encoding` read by the consumers written out
in tests/kv_event_consumers.py (vLLM's classes in three releases, vLLM's subscriber example,
llm-d's KV-cache manager in two versions, Dynamo's kv-router), every field they read checked, live
and replayed from a sequence number, with the publishing replica's data_parallel_rank on every batch."""

import json

import msgspec
import numpy as np
import pytest
import zmq
from kv_event_consumers import (CONSUMERS, DECODES, READS, STORED, Undecodable, VLLMArrayBatch, VLLMMapBatch,
                                VLLMMapEventsBatch, llmd_positional)

from jpaged.kv_events.config import KVEventsConfig, offset_endpoint
from jpaged.kv_events.events import (ENCODINGS, AllBlocksCleared, BatchEncoder, BlockRemoved, BlockStored, KVEventBatch,
                                     external_block_hash)
from jpaged.kv_events.publisher import make_publisher
from test_kv_events import _free_port, _replay  # (the live-stream tests' helpers)

ALL_FIELDS = {"BlockStored": STORED, "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def _seeded(seed=None):
    seed = int(np.random.SeedSequence().entropy % (1 << 32)) if seed is None else seed
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _batches(rng, count, rank=None, block_size=16):
    """Random batches of every event kind: hashes across the whole 64-bit range (past 2**63 too),
    chains with and without a parent, with and without a LoRA adapter."""
    out = []
    for i in range(count):
        events = []
        for _ in range(int(rng.integers(1, 5))):
            kind = int(rng.integers(0, 3))
            hashes = [external_block_hash(rng.bytes(32)) for _ in range(int(rng.integers(1, 4)))]
            if kind == 0:
                lora = rng.random() < 0.5
                events.append(BlockStored(hashes, None if rng.random() < 0.3 else external_block_hash(rng.bytes(32)),
                                          rng.integers(0, 150_000, block_size * len(hashes)).tolist(), block_size,
                                          int(rng.integers(1, 9)) if lora else None, "GPU",
                                          f"adapter-{int(rng.integers(0, 9))}" if lora else None))
            elif kind == 1:
                events.append(BlockRemoved(hashes, "GPU"))
            else:
                events.append(AllBlocksCleared())
        out.append(KVEventBatch(ts=1.7e9 + i + float(rng.random()), events=events, data_parallel_rank=rank))
    return out


def _expected(event, consumer: str) -> dict:
    tag = type(event).__name__
    names = [n for n in ALL_FIELDS[tag] if n in READS.get(consumer, STORED)]
    return {"type": tag, **{n: getattr(event, n) for n in names}}


def _check(consumer: str, payload: bytes, batch: KVEventBatch, rank):
    decoded = CONSUMERS[consumer](payload)
    assert decoded.ts == batch.ts
    assert decoded.events == [_expected(e, consumer) for e in batch.events]
    if consumer != "vllm_subscriber":  # its EventBatch declares ts and events only
        assert decoded.data_parallel_rank == rank


def test_the_option_defaults_to_arrays_and_bad_values_name_the_field():
    assert KVEventsConfig.of({"enable_kv_cache_events": True}).encoding == "array"
    assert KVEventsConfig.of(json.dumps({"enable_kv_cache_events": True, "encoding": "map_events"})).encoding \
        == "map_events"
    for bad in ("msgpack", "ARRAY", 1, None):
        with pytest.raises(ValueError, match=r"kv_events_config\.encoding=.*expected one of"):
            KVEventsConfig.of({"enable_kv_cache_events": True, "encoding": bad})
    with pytest.raises(ValueError, match="encoding"):
        BatchEncoder("json")


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_each_consumer_reads_every_field_of_the_encodings_it_decodes(encoding):
    """Every consumer in DECODES[encoding] reads every field it knows, equal to what was published;
    every other consumer refuses the payload (docs/fleet.md's table, both ways)."""
    rng = _seeded()
    rank = int(rng.integers(0, 8))
    encoder = BatchEncoder(encoding)
    for batch in _batches(rng, 40, rank):
        payload = encoder.encode(batch)
        for consumer in CONSUMERS:
            if consumer in DECODES[encoding]:
                _check(consumer, payload, batch, rank)
            else:
                with pytest.raises(Undecodable):
                    CONSUMERS[consumer](payload)


def test_the_layouts_are_vllms_own():
    """Byte for byte: a map_events or map payload re-encoded through vLLM's classes of that layout
    is unchanged. An array payload is msgspec's array_like encoding of the same classes up to
    trailing fields still at their default (msgspec writes those; llm-d's exact-length Go structs
    would refuse them)."""
    rng = _seeded()
    encoders = {e: BatchEncoder(e) for e in ENCODINGS}
    for batch in _batches(rng, 30, rank=int(rng.integers(0, 4))):
        for encoding, batch_type in (("map", VLLMMapBatch), ("map_events", VLLMMapEventsBatch)):
            payload = encoders[encoding].encode(batch)
            assert msgspec.msgpack.encode(msgspec.msgpack.decode(payload, type=batch_type)) == payload
        payload = encoders["array"].encode(batch)
        ours = msgspec.msgpack.decode(payload)
        theirs = msgspec.msgpack.decode(msgspec.msgpack.encode(msgspec.msgpack.decode(payload, type=VLLMArrayBatch)))
        assert ours[0] == theirs[0] and ours[2] == theirs[2] and len(ours) == len(theirs) == 3
        for mine, full in zip(ours[1], theirs[1], strict=True):
            assert full[:len(mine)] == mine and all(v is None for v in full[len(mine):])
            # [tag, 7 fields] / [tag, 2 fields] / [tag]: what llm-d's msgpackVLLM*Event structs declare
            assert len(mine) == {"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}[mine[0]]


def test_raw_hashes_reach_the_consumers_that_take_bytes(monkeypatch):
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (vLLM's switch): vLLM's classes keep the digests,
    llm-d reads their last 8 bytes (the integer jpaged sends by default), Dynamo refuses bytes."""
    rng = _seeded()
    digests = [rng.bytes(32) for _ in range(3)]
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    batch = KVEventBatch(1.0, [BlockStored([external_block_hash(d) for d in digests], None, list(range(48)), 16,
                                           None, "GPU", None)], 0)
    payload = BatchEncoder("array").encode(batch)
    assert CONSUMERS["vllm_array"](payload).events[0]["block_hashes"] == digests
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    assert CONSUMERS["llmd_positional"](payload).events[0]["block_hashes"] == [external_block_hash(d) for d in digests]
    with pytest.raises(Undecodable, match="block hash"):
        CONSUMERS["dynamo"](payload)


def _replay_all(context, endpoint: str, count: int) -> list[tuple[int, bytes]]:
    """Replay from 0 until all `count` batches are out (the publisher thread sends in the background)."""
    for _ in range(200):
        replayed = _replay(context, endpoint, 0)
        if len(replayed) == count:
            return replayed
    raise AssertionError(f"{len(replayed)} of {count} batches published")


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_live_and_replayed_batches_decode_in_every_consumer(encoding):
    """Replica rank 1 of a data-parallel pair (vLLM's rule: its ports are the configured ones + 1),
    topic in llm-d's "kv@<pod>@<model>" form: live batches arrive in sequence, a replay from a
    sequence number returns exactly those from it on, and each consumer of the encoding reads every
    field and the rank of every batch."""
    rng = _seeded()
    port, replay_port = _free_port(), _free_port()
    config = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port - 1}",
                                "replay_endpoint": f"tcp://*:{replay_port - 1}", "topic": "kv@pod-1@tiny",
                                "encoding": encoding})
    assert offset_endpoint(config.endpoint, 1) == f"tcp://*:{port}"
    publisher = make_publisher(config, data_parallel_rank=1)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{port}")
    batches = _batches(rng, 30)
    try:
        live, sent = [], 0
        while not live:  # the "slow joiner": nothing arrives until the subscription does
            assert sent < len(batches) - 10, "the subscriber never received a batch"
            publisher.publish(batches[sent])
            sent += 1
            if sub.poll(200):
                live.append(sub.recv_multipart())
        for batch in batches[sent:]:
            publisher.publish(batch)
        first = int.from_bytes(live[0][1], "big")
        while len(live) < len(batches) - first:
            assert sub.poll(10_000), "a live batch did not arrive"
            live.append(sub.recv_multipart())
        assert all(b.data_parallel_rank == 1 for b in batches)  # stamped by the publisher
        for k, (topic, seq, payload) in enumerate(live):
            assert topic == b"kv@pod-1@tiny" and int.from_bytes(seq, "big") == first + k
            for consumer in DECODES[encoding]:
                _check(consumer, payload, batches[first + k], 1)
        start = int(rng.integers(1, len(batches)))
        _replay_all(context, f"tcp://127.0.0.1:{replay_port}", len(batches))
        replayed = _replay(context, f"tcp://127.0.0.1:{replay_port}", start)
        assert [seq for seq, _ in replayed] == list(range(start, len(batches)))
        for seq, payload in replayed:
            for consumer in DECODES[encoding]:
                _check(consumer, payload, batches[seq], 1)
    finally:
        sub.close(linger=0)
        publisher.shutdown()


@pytest.mark.parametrize("seed", range(2))
def test_a_routers_view_from_the_default_stream_is_the_pools_prefix_cache(seed):
    """The model-free engine of test_scheduler with events on, published in the default encoding:
    llm-d's KV-cache manager, reading only the replayed stream, holds exactly the pool's cached
    blocks (as the 64-bit hashes jpaged publishes) after every step."""
    from test_scheduler import FakeEngine

    rng = _seeded(seed)
    port, replay_port = _free_port(), _free_port()
    publisher = make_publisher(KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                                  "replay_endpoint": f"tcp://*:{replay_port}"}))
    engine = FakeEngine(block_size=4, num_gpu_blocks=int(rng.integers(12, 24)), num_cpu_blocks=32, max_num_seqs=6,
                        preemption_mode="recompute", enable_caching=True)
    engine.bm.enable_kv_events()
    families = [rng.integers(0, 1000, 24).tolist() for _ in range(3)]
    for i in range(14):
        prefix = families[int(rng.integers(0, 3))][:int(rng.integers(0, 24))]
        engine.add(f"r{i}", int(rng.integers(len(prefix) + 1, 30)), int(rng.integers(1, 12)), 1, tuple(prefix))
    context, view, published, kinds = zmq.Context.instance(), set(), 0, set()
    try:
        while engine.scheduler.has_unfinished_seqs():
            engine.step()
            events = engine.bm.take_events()
            if not events:
                continue
            publisher.publish(KVEventBatch(ts=float(published), events=events))
            published += 1
            _, payload = _replay_all(context, f"tcp://127.0.0.1:{replay_port}", published)[-1]
            batch = llmd_positional(payload)
            assert batch.data_parallel_rank == 0
            for event in batch.events:
                kinds.add(event["type"])
                if event["type"] == "BlockStored":
                    view.update(event["block_hashes"])
                elif event["type"] == "BlockRemoved":
                    view.difference_update(event["block_hashes"])
                else:
                    view.clear()
            assert view == {external_block_hash(h) for h in engine.bm.gpu_pool.cached_blocks}
        print(kinds, published)
        assert "BlockStored" in kinds
    finally:
        publisher.shutdown()
