"""The events, in vLLM's msgpack schema (`vllm/distributed/kv_events.py`), and the three ways a
batch goes on the wire (`KVEventsConfig.encoding`; which consumer decodes which: docs/fleet.md):

  "array"      [ts, [event, ...], data_parallel_rank], each event [tag, field, ...] in declaration
               order: msgspec's `array_like=True` layout, as vLLM sent it before vllm-project/vllm#42892
               and as llm-d's KV-cache manager (Go structs tagged `msgpack:",array"`), Dynamo's
               kv-router and vLLM's own kv_events_subscriber example decode it. Trailing fields still
               at their default are left out (msgspec itself writes every field of an array-like
               struct; llm-d's older Go structs take only as many fields as they declare).
  "map_events" the batch as that array, each event a map {"type": tag, field: value, ...}: vLLM
               after #42892 (KVCacheEvent without array_like; EventBatch still array-like).
  "map"        the batch a map too, {"ts", "events", "data_parallel_rank"}: vLLM's kv_events.py with
               EventBatch declared without array_like (what jpaged sent before the option existed).

In the maps, `omit_defaults` leaves out fields still at their default (the optional trailing fields
appear only when set, as vLLM sends them)."""

import os
from typing import Any

import msgspec

ENCODINGS = ("array", "map_events", "map")

MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change to a replica's prefix cache."""


class BlockStored(KVCacheEvent):
    """Full blocks became findable by their hashes (a chain: each block's parent is the one before)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the prefix cache: their hashes find nothing any more."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (reset_prefix_cache, new weights, sleep)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(block_hash: bytes) -> int | bytes:
    """A block hash as vLLM publishes it: the low 64 bits of the digest read big-endian, an int
    (vLLM's default), or the raw bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (vLLM's switch)."""
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "0":
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def _positional(event: KVCacheEvent) -> list:
    """`event` as msgspec's array-like tagged layout, [tag, field, ...], its trailing fields still at
    their default left out."""
    fields = msgspec.structs.fields(event)
    values = [getattr(event, f.name) for f in fields]
    end = len(values)
    while end and fields[end - 1].default is not msgspec.NODEFAULT and values[end - 1] == fields[end - 1].default:
        end -= 1
    return [type(event).__name__, *values[:end]]


class BatchEncoder:
    """Encodes EventBatches as `encoding` (one of ENCODINGS) lays them out; one per publisher thread."""

    def __init__(self, encoding: str = "array"):
        if encoding not in ENCODINGS:
            raise ValueError(f"kv_events_config.encoding={encoding!r}; expected one of {ENCODINGS}")
        self.encoding = encoding
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: EventBatch) -> bytes:
        if self.encoding == "map":
            return self._encoder.encode(batch)
        events = batch.events if self.encoding == "map_events" else [_positional(e) for e in batch.events]
        # data_parallel_rank is left out only while None (the publisher always sets it), as a map leaves it out.
        head = [batch.ts, events]
        return self._encoder.encode(head if batch.data_parallel_rank is None else head + [batch.data_parallel_rank])
