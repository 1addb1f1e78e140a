"""Files a user or a client names (checkpoints, adapters, their JSON), read without trusting them.

Only regular files are read, opened without blocking (a FIFO, a device such as /dev/zero or a
socket is refused before a byte is read), with the size checked before reading and JSON nesting
bounded. Every refusal is a ValueError that starts with `what` (the caller's name for the file,
e.g. "lora_path='x': adapter_config.json") and does not echo the file's contents.
"""

import json
import os
import re
import stat

import numpy as np

MAX_JSON_BYTES = 4 << 20  # configs are kilobytes; a sharded checkpoint's index a few hundred KB
MAX_JSON_DEPTH = 64
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20  # safetensors' own limit
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
                "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                "I64": 8, "U64": 8, "F64": 8}


def open_regular(path: str, what: str, max_bytes: int | None = None):
    """`path` opened for binary reading, if it is a regular file (symlinks to one are fine) of at
    most `max_bytes`; a ValueError naming `what` otherwise. Never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"{what}: cannot be opened ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what}: not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise ValueError(f"{what}: {info.st_size} bytes, more than the {max_bytes} allowed")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str, what: str, max_bytes: int) -> bytes:
    with open_regular(path, what, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while we read it
        raise ValueError(f"{what}: more than the {max_bytes} bytes allowed")
    return data


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (strings skipped)."""
    skeleton = np.frombuffer(_STRING.sub(b'""', data), np.uint8)
    steps = (np.isin(skeleton, (ord("["), ord("{"))).astype(np.int64)
             - np.isin(skeleton, (ord("]"), ord("}"))).astype(np.int64))
    return int(np.cumsum(steps).max(initial=0))


def loads_json(data: bytes | str, what: str, max_depth: int = MAX_JSON_DEPTH):
    raw = data.encode() if isinstance(data, str) else data
    if json_depth(raw) > max_depth:
        raise ValueError(f"{what}: JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{what}: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None


def read_json(path: str, what: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """A JSON file parsed, after the checks above; ValueError naming `what` otherwise."""
    return loads_json(read_bytes(path, what, max_bytes), what, max_depth)


def safetensors_header(path: str, what: str, max_header_bytes: int = MAX_SAFETENSORS_HEADER_BYTES) -> dict:
    """The header of a .safetensors file, checked against the file before any tensor is read:
    a regular file, a bounded header that is a JSON object, known dtypes, each tensor's byte range
    equal to its dtype and shape, inside the file, the ranges not overlapping. Returns
    {name: {"dtype", "shape", "data_offsets"}} (and "__metadata__" if present)."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{what}: truncated ({size} bytes; not a safetensors file)")
        length = int.from_bytes(prefix, "little")
        if length > max_header_bytes or length > size - 8:
            raise ValueError(f"{what}: header length {length} does not fit the file ({size} bytes; truncated or "
                             "not a safetensors file)")
        header = loads_json(f.read(length), f"{what} (header)", max_depth=8)
    if not isinstance(header, dict):
        raise ValueError(f"{what}: the header is not a JSON object")
    data_bytes, ranges = size - 8 - length, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"{what}: tensor {name!r} has no dtype, shape and data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"{what}: tensor {name!r} has unknown dtype {str(dtype)[:20]!r}")
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int and o >= 0 for o in offsets)):
            raise ValueError(f"{what}: tensor {name!r} has a malformed shape or data_offsets")
        begin, end = offsets
        expected = _DTYPE_BYTES[dtype] * int(np.prod(shape, dtype=object))
        if dtype == "F4":
            expected = (int(np.prod(shape, dtype=object)) + 1) // 2
        if end < begin or end - begin != expected:
            raise ValueError(f"{what}: tensor {name!r} spans {end - begin} bytes; dtype {dtype} and shape "
                             f"{shape} need {expected}")
        if end > data_bytes:
            raise ValueError(f"{what}: tensor {name!r} ends at byte {end}, past the file's {data_bytes} data "
                             "bytes (truncated)")
        ranges.append((begin, end, name))
    ranges.sort()
    for (_, end, name), (begin, _, other) in zip(ranges, ranges[1:]):
        if begin < end:
            raise ValueError(f"{what}: tensors {name!r} and {other!r} overlap")
    return header
