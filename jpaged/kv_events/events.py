"""The events, in vLLM's msgpack schema (`vllm/distributed/kv_events.py`): a router written for vLLM
decodes jpaged's batches unchanged. msgspec structs encode as maps with their fields in declaration
order; `tag=True` adds `"type": "<class name>"`; `omit_defaults` leaves out fields still at their
default (so the optional trailing fields appear only when set, exactly as vLLM sends them)."""

import os
from typing import Any

import msgspec

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
