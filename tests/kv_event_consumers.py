"""KV event consumers, each written out in Python from its own source (the commit read is named), as
the tests' independent references: what each one decodes from a payload, as a list of
`Decoded` batches with the fields that consumer reads. A payload a consumer cannot read raises
`Undecodable` (or, where the consumer itself silently reads nothing, that is raised too: a router
that learns nothing is as broken as one that fails).

  vllm_map            vllm-project/vllm vllm/distributed/kv_events.py @ 0181ea31: EventBatch and
                      events msgspec structs without array_like (maps; events tagged by "type").
  vllm_map_events     vLLM after vllm-project/vllm#42892 (v0.26.0 as volcano-sh/kthena#1535 prints
                      it): EventBatch still array_like, events maps.
  vllm_array          vLLM before #42892 (v0.23): every struct array_like, the full field list.
  vllm_subscriber     vLLM examples/online_serving/kv_events_subscriber.py @ 0ef0f426: array_like,
                      BlockStored of 6 fields, EventBatch of 2 (ts, events).
  llmd_structs        llm-d/llm-d-kv-cache pkg/kvevents/engineadapter/vllm_adapter.go @ f5ae8784:
                      vmihailenco/msgpack structs tagged `msgpack:",array"` (an array must have
                      exactly as many elements as the struct has fields: errArrayStruct otherwise;
                      a map is read by Go field names, "TS", "Events", so vLLM's map reads as nothing).
  llmd_positional     llm-d/llm-d-kv-cache vllm_adapter.go @ 7be76e11: the batch as that struct, each
                      event decoded as []any and read by position with length guards.
  dynamo              ai-dynamo/dynamo lib/kv-router/src/zmq_wire/{types,deserialize,filter}.rs
                      @ 4fb5a208: the batch a 3-tuple, each event a tagged map or sequence (extra
                      elements and unknown keys ignored), hashes i64/u64 only.
"""

import dataclasses
from typing import Annotated, Any

import msgspec

U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
U64 = 1 << 64


class Undecodable(Exception):
    pass


@dataclasses.dataclass
class Decoded:
    ts: float
    events: list  # dicts: "type" and the fields the consumer reads, hashes as it keeps them
    data_parallel_rank: int | None


def _raw(payload: bytes):
    return msgspec.msgpack.decode(payload)


def _fields(event: msgspec.Struct, names) -> dict:
    return {"type": type(event).__struct_config__.tag, **{n: getattr(event, n) for n in names}}


# ---- vLLM's own msgspec classes, in three releases' layouts.
STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
READ = {"BlockStored": STORED, "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def _vllm_classes(array_like: bool, prefix: str):
    """vLLM's event classes (the fields of kv_events.py @ 0181ea31), array-like or maps."""
    base = msgspec.defstruct(f"{prefix}KVCacheEvent", [], array_like=array_like, omit_defaults=True, tag=True)
    stored = msgspec.defstruct(f"{prefix}BlockStored", [
        ("block_hashes", list[int | bytes]), ("parent_block_hash", int | bytes | None), ("token_ids", list[int]),
        ("block_size", int), ("lora_id", int | None), ("medium", str | None), ("lora_name", str | None),
        ("extra_keys", list | None, None), ("group_idx", int | None, None), ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None)], bases=(base,), tag="BlockStored")
    removed = msgspec.defstruct(f"{prefix}BlockRemoved", [
        ("block_hashes", list[int | bytes]), ("medium", str | None), ("group_idx", int | None, None)],
        bases=(base,), tag="BlockRemoved")
    cleared = msgspec.defstruct(f"{prefix}AllBlocksCleared", [], bases=(base,), tag="AllBlocksCleared")
    return stored | removed | cleared


def _vllm_batch(batch_array_like: bool, events_array_like: bool, prefix: str):
    return msgspec.defstruct(f"{prefix}KVEventBatch", [
        ("ts", float), ("events", list[_vllm_classes(events_array_like, prefix)]),
        ("data_parallel_rank", int | None, None)], array_like=batch_array_like, omit_defaults=True)


VLLMMapBatch = _vllm_batch(False, False, "M")
VLLMMapEventsBatch = _vllm_batch(True, False, "V")
VLLMArrayBatch = _vllm_batch(True, True, "A")


def _vllm(batch_type):
    decoder = msgspec.msgpack.Decoder(batch_type)

    def decode(payload: bytes) -> Decoded:
        try:
            batch = decoder.decode(payload)
        except msgspec.DecodeError as e:
            raise Undecodable(str(e)) from None
        return Decoded(batch.ts, [_fields(e, READ[type(e).__struct_config__.tag]) for e in batch.events],
                       batch.data_parallel_rank)
    return decode


vllm_map = _vllm(VLLMMapBatch)
vllm_map_events = _vllm(VLLMMapEventsBatch)
vllm_array = _vllm(VLLMArrayBatch)


# ---- vLLM's subscriber example: its own (older) classes.
class SEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class SKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class SBlockStored(SKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class SBlockRemoved(SKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class SAllBlocksCleared(SKVCacheEvent, tag="AllBlocksCleared"):
    pass


class SKVEventBatch(SEventBatch):
    events: list[SBlockStored | SBlockRemoved | SAllBlocksCleared]


_SUBSCRIBER = msgspec.msgpack.Decoder(SKVEventBatch)


def vllm_subscriber(payload: bytes) -> Decoded:
    try:
        batch = _SUBSCRIBER.decode(payload)
    except msgspec.DecodeError as e:
        raise Undecodable(str(e)) from None
    return Decoded(batch.ts, [_fields(e, STORED[:-1] if isinstance(e, SBlockStored) else ("block_hashes", "medium")
                                      if isinstance(e, SBlockRemoved) else ()) for e in batch.events], None)


# ---- llm-d's KV-cache manager (Go, vmihailenco/msgpack v5).
def _hash_u64(raw) -> int:
    """getHashAsUint64: an integer as it is, bytes as their last 8 read big-endian."""
    if isinstance(raw, bool) or not isinstance(raw, (int, bytes)):
        raise Undecodable(f"unsupported hash type: {type(raw).__name__}")
    if isinstance(raw, int):
        return raw % U64
    if not raw:
        raise Undecodable("hash byte slice is empty")
    return int.from_bytes(raw[-8:], "big")


def _go_array_struct(raw, fields: int, what: str) -> list:
    """vmihailenco's decodeStructValue for a struct tagged `,array`: a map is read by field name (Go's
    names: nothing of vLLM's matches), an array must have exactly `fields` elements."""
    if isinstance(raw, dict):
        raise Undecodable(f"{what}: a map, read by Go field names: every field stays zero")
    if not isinstance(raw, list):
        raise Undecodable(f"{what}: not an array")
    if len(raw) != fields:
        raise Undecodable(f"{what}: msgpack: number of fields in array-encoded struct has changed "
                          f"({len(raw)} elements, {fields} fields)")
    return raw


def _go_int(raw, what, unsigned_bits=None):
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise Undecodable(f"{what}: unsupported numeric type {type(raw).__name__}")
    if unsigned_bits and not 0 <= raw < 1 << unsigned_bits:
        raise Undecodable(f"{what}: {raw} does not fit uint{unsigned_bits}")
    return raw


def _go_opt(raw, kind, what):
    if raw is not None and not isinstance(raw, kind):
        raise Undecodable(f"{what}: {type(raw).__name__}")
    return raw


def _llmd_batch(payload: bytes):
    ts, events, rank = _go_array_struct(_raw(payload), 3, "msgpackVLLMEventBatch")
    if not isinstance(ts, float) or not isinstance(events, list):
        raise Undecodable("msgpackVLLMEventBatch: TS float64, Events an array")
    return ts, events, _go_opt(rank, int, "DataParallelRank")


def _llmd_event(tag, fields, stored_min, removed_min):
    """What both llm-d adapters read from an event's fields (after the tag), by position."""
    at = (lambda i: fields[i] if i < len(fields) else None)
    if tag == "BlockStored":
        if len(fields) < stored_min:
            raise Undecodable(f"BlockStored: need at least {stored_min} fields, got {len(fields)}")
        if not isinstance(fields[0], list) or not isinstance(fields[2], list):
            raise Undecodable("BlockStored: block_hashes and token_ids are arrays")
        return {"type": tag, "block_hashes": [_hash_u64(h) for h in fields[0]],
                "parent_block_hash": None if fields[1] is None else _hash_u64(fields[1]),
                "token_ids": [_go_int(t, "token_ids", 32) for t in fields[2]],
                "block_size": _go_int(fields[3], "block_size"), "lora_id": _go_opt(at(4), int, "lora_id"),
                "medium": _go_opt(at(5), str, "medium"), "lora_name": _go_opt(at(6), str, "lora_name")}
    if tag == "BlockRemoved":
        if len(fields) < removed_min or not isinstance(fields[0], list):
            raise Undecodable("BlockRemoved: block_hashes")
        return {"type": tag, "block_hashes": [_hash_u64(h) for h in fields[0]], "medium": _go_opt(at(1), str, "medium")}
    if tag == "AllBlocksCleared":
        return {"type": tag}
    raise Undecodable(f"unknown vLLM event tag: {tag}")


def llmd_structs(payload: bytes) -> Decoded:
    """@ f5ae8784: msgpackVLLMBlockStoredEvent (Tag + 7 fields) and msgpackVLLMBlockRemovedEvent
    (Tag + 2), each `,array`."""
    ts, events, rank = _llmd_batch(payload)
    out = []
    for raw in events:
        if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
            raise Undecodable("failed to decode tagged union")
        tag = raw[0]
        if tag in ("BlockStored", "BlockRemoved"):
            _go_array_struct(raw, 8 if tag == "BlockStored" else 3, tag)
        out.append(_llmd_event(tag, raw[1:], 4, 1))
    return Decoded(ts, out, rank)


def llmd_positional(payload: bytes) -> Decoded:
    """@ 7be76e11: each event []any, read by position; BlockStored needs 5 elements with the tag,
    BlockRemoved 2; more are read while known, the rest ignored."""
    ts, events, rank = _llmd_batch(payload)
    out = []
    for raw in events:
        if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
            raise Undecodable("failed to decode tagged union")
        out.append(_llmd_event(raw[0], raw[1:], 4, 1))
    return Decoded(ts, out, rank)


# ---- NVIDIA Dynamo's kv-router (Rust, serde over rmp).
MAIN_ATTENTION = ("full_attention", "mla_attention", "sink_full_attention")


def _dynamo_hash(raw) -> int:
    """BlockHashValue: untagged i64 | u64; bytes do not deserialize."""
    if isinstance(raw, bool) or not isinstance(raw, int) or not -(1 << 63) <= raw < U64:
        raise Undecodable(f"block hash: {type(raw).__name__}")
    return raw % U64


def _dynamo_event(raw) -> dict | None:
    """RawKvEvent: a map by keys ("type" required) or a sequence by position; None: Ignored."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        get = raw.get
        kind, group = raw.get("kv_cache_spec_kind"), raw.get("group_idx")
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, names = raw[0], (("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                                "lora_name", "extra_keys") if raw[0] == "BlockStored" else ("block_hashes", "medium"))
        values = dict(zip(names, raw[1:]))
        get = values.get
        trailing = raw[1 + len(names):1 + len(names) + 3]
        kind = next((t for t in trailing if isinstance(t, str)), None)
        group = next((t for t in trailing if isinstance(t, int) and not isinstance(t, bool)), None)
    else:
        raise Undecodable("a kv event encoded as a tagged map or sequence")
    if tag == "AllBlocksCleared":
        return {"type": tag}
    if tag not in ("BlockStored", "BlockRemoved"):
        raise Undecodable(f"unknown variant {tag!r}")
    if get("block_hashes") is None:
        raise Undecodable("missing field block_hashes")
    ignored = (kind not in MAIN_ATTENTION) if kind is not None else (group is not None and group != 0)
    event = {"type": tag, "block_hashes": [_dynamo_hash(h) for h in get("block_hashes")],
             "medium": _go_opt(get("medium"), str, "medium")}
    if tag == "BlockStored":
        if get("token_ids") is None or get("block_size") is None:
            raise Undecodable("missing field token_ids / block_size")
        parent = get("parent_block_hash")
        event.update(parent_block_hash=None if parent is None else _dynamo_hash(parent),
                     token_ids=[_go_int(t, "token_ids", 32) for t in get("token_ids")],
                     block_size=_go_int(get("block_size"), "block_size", 64),
                     lora_name=_go_opt(get("lora_name"), str, "lora_name"))
    return None if ignored else event


def dynamo(payload: bytes) -> Decoded:
    raw = _raw(payload)
    if not isinstance(raw, list) or len(raw) != 3:
        raise Undecodable("KvEventBatch: a sequence [timestamp, [events], data_parallel_rank]")
    ts, events, rank = raw
    if not isinstance(ts, (float, int)) or not isinstance(events, list):
        raise Undecodable("KvEventBatch: (f64, Vec<RawKvEvent>, Option<i32>)")
    decoded = [_dynamo_event(e) for e in events]
    return Decoded(float(ts), [e for e in decoded if e is not None], _go_opt(rank, int, "data_parallel_rank"))


CONSUMERS = {"vllm_map": vllm_map, "vllm_map_events": vllm_map_events, "vllm_array": vllm_array,
             "vllm_subscriber": vllm_subscriber, "llmd_structs": llmd_structs, "llmd_positional": llmd_positional,
             "dynamo": dynamo}
# Which consumer reads which encoding (docs/fleet.md's table); the tests check both the yes and the no.
DECODES = {
    "array": {"vllm_array", "vllm_subscriber", "llmd_structs", "llmd_positional", "dynamo"},
    "map_events": {"vllm_map_events", "dynamo"},
    "map": {"vllm_map"},
}
# The fields each consumer reads.
READS = {"vllm_subscriber": STORED[:-1], "dynamo": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                                    "medium", "lora_name")}


def ts_of(payload: bytes) -> float:
    """A batch's timestamp in any of the three encodings."""
    raw = _raw(payload)
    return raw["ts"] if isinstance(raw, dict) else raw[0]
