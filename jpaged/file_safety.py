"""Files a user or a client names (checkpoints, adapters, their JSON), read without trusting them.

Only regular files are read, opened without blocking (a FIFO, a device such as /dev/zero or a
socket is refused before a byte is read), with the size checked before reading, and JSON nesting
and the memory parsing it takes bounded before it is parsed: checking a file costs a small
multiple of its size at most (json_scan), whatever it holds. Every refusal is a ValueError that
starts with `what` (the caller's name for the file, e.g. "lora_path='x': adapter_config.json")
and does not echo the file's contents.
"""

import json
import os
import stat
from typing import NamedTuple

import numpy as np

MAX_JSON_BYTES = 4 << 20  # configs are kilobytes; a sharded checkpoint's index a few hundred KB
MAX_JSON_DEPTH = 64
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20  # safetensors' own limit
# What parsing one JSON text may allocate (decoded text and Python objects): 2 x its size (+ 1 MiB:
# a header that is one long string decodes to its size and parses to its size again), or this
# much if more. A safetensors header takes ~6.5 x its size to parse (about 800 bytes a tensor, which
# json_scan bounds at about 1,700): 64 MiB admits ~40,000 tensors in one file, and refuses the
# headers of tiny objects, arrays or numbers that parse to 10-25 x their size.
MAX_JSON_PARSE_BYTES = 64 << 20
_CHUNK = 1 << 18  # bytes json_scan looks at a time (its temporaries: ~15 x this at most)
_QUOTE, _BACKSLASH, _OPEN, _CLOSE = ord('"'), ord("\\"), ord("{"), ord("}")
# Upper bounds (CPython 3.11, measured with tracemalloc) on what json.loads allocates for each: a
# dict, a list, a member (its entry in the dict and in json's key memo), a value (its slot and,
# for a number, the int or float), a str (besides its characters).
_COST_OBJECT, _COST_ARRAY, _COST_MEMBER, _COST_VALUE, _COST_STRING = 184, 88, 96, 40, 56
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


class JsonShape(NamedTuple):
    depth: int  # the deepest nesting of arrays and objects (strings skipped)
    parse_bytes: int  # at least what json.loads allocates to parse it (decoded text and objects)


def json_scan(data: bytes) -> JsonShape:
    """JSON text's nesting depth and an upper bound on what json.loads would allocate to parse it,
    found without parsing: in linear time and, whatever the text, with at most a few chunks' worth
    of memory besides `data` (numpy over _CHUNK bytes at a time, the GIL free in between), so
    that only text whose depth and cost are known is given to the parser. Strings are read as a
    parser reads them (a quote after an odd run of backslashes is escaped), up to the first error."""
    view = memoryview(data).cast("B")
    depth = max_depth = 0
    in_string = odd_backslashes = False  # at the chunk's start: inside a string; after an odd backslash run
    counts = dict.fromkeys(b"{[:,", 0)
    quotes = string_bytes = 0
    wide = backslashes = False
    for start in range(0, len(view), _CHUNK):
        c = np.frombuffer(view[start:start + _CHUNK], np.uint8)
        quote_at = np.flatnonzero(c == _QUOTE)
        slash_at = np.flatnonzero(c == _BACKSLASH)
        if quote_at.size and (slash_at.size or odd_backslashes):
            quote_at = quote_at[~_escaped(quote_at, slash_at, odd_backslashes)]
        if slash_at.size:
            backslashes = True
            if slash_at[-1] == c.size - 1:  # a run reaching the chunk's end: its parity carries over
                run = c.size - _run_start(slash_at)
                odd_backslashes = bool((run + (odd_backslashes and run == c.size)) % 2)
            else:
                odd_backslashes = False
        elif c.size:
            odd_backslashes = False
        wide = wide or bool((c >= 0x80).any())
        # Outside strings: after an even number of quotes (counting a string's closing quote).
        marks = np.zeros(c.size, np.uint8)
        marks[quote_at] = 1
        outside = (np.cumsum(marks, dtype=np.uint8) & 1) == int(in_string)  # parity survives uint8 wrapping
        del marks
        quotes += quote_at.size
        string_bytes += c.size - int(np.count_nonzero(outside))
        in_string ^= bool(quote_at.size % 2)
        skeleton = np.where(outside, c, 0)
        del outside
        for byte in counts:
            counts[byte] += int(np.count_nonzero(skeleton == byte))
        folded = skeleton | 0x20  # "[" | 0x20 == "{", "]" | 0x20 == "}"
        steps = (folded == _OPEN).view(np.int8) - (folded == _CLOSE).view(np.int8)
        del folded, skeleton
        levels = np.cumsum(steps, dtype=np.int32)
        if levels.size:
            max_depth = max(max_depth, depth + int(levels.max()))
            depth += int(levels[-1])
    width = 4 if wide else 1  # a str is 1, 2 or 4 bytes a character
    objects, arrays, members, commas = counts[_OPEN], counts[ord("[")], counts[ord(":")], counts[ord(",")]
    values = 1 + members + arrays + commas  # each after ":", "[" or "," (or the top one)
    parse_bytes = (width * len(view) + _COST_OBJECT * objects + _COST_ARRAY * arrays + _COST_MEMBER * members
                   + _COST_VALUE * values + _COST_STRING * ((quotes + 1) // 2)
                   + (4 if wide or backslashes else 1) * string_bytes)  # "\ud83d..." widens a str
    return JsonShape(max_depth, parse_bytes)


def _run_start(slash_at: np.ndarray) -> int:
    """Where the run of backslashes ending at slash_at[-1] starts."""
    breaks = np.flatnonzero(np.diff(slash_at) != 1)
    return int(slash_at[breaks[-1] + 1]) if breaks.size else int(slash_at[0])


def _escaped(quote_at: np.ndarray, slash_at: np.ndarray, odd_before: bool) -> np.ndarray:
    """Which quotes follow an odd run of backslashes (`odd_before`: the chunk starts after one)."""
    escaped = np.zeros(quote_at.size, bool)
    if slash_at.size:
        breaks = np.flatnonzero(np.diff(slash_at) != 1)
        ends = slash_at[np.append(breaks, slash_at.size - 1)]
        starts = slash_at[np.insert(breaks + 1, 0, 0)]
        runs = ends - starts + 1
        if odd_before and starts[0] == 0:
            runs[0] += 1
        odd_ends = ends[runs % 2 == 1]
        at = np.minimum(np.searchsorted(odd_ends, quote_at - 1), max(odd_ends.size - 1, 0))
        escaped = (odd_ends[at] == quote_at - 1) if odd_ends.size else escaped
    if odd_before and quote_at[0] == 0:  # right after the previous chunk's odd run
        escaped[0] = True
    return escaped


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (strings skipped)."""
    return json_scan(data).depth


def loads_json(data: bytes | str, what: str, max_depth: int = MAX_JSON_DEPTH):
    """JSON text parsed after json_scan: nested at most `max_depth` deep, and costing json.loads at
    most max(MAX_JSON_PARSE_BYTES, 2 x its size + 1 MiB) (a ValueError naming `what` otherwise)."""
    raw = data.encode() if isinstance(data, str) else data
    _check_shape(raw, what, max_depth)
    return _parse(raw, what)


def _check_shape(raw: bytes, what: str, max_depth: int):
    shape = json_scan(raw)
    if shape.depth > max_depth:
        raise ValueError(f"{what}: JSON nested deeper than {max_depth} levels")
    budget = max(MAX_JSON_PARSE_BYTES, 2 * len(raw) + (1 << 20))
    if shape.parse_bytes > budget:
        raise ValueError(f"{what}: JSON of {len(raw)} bytes with too many values: parsing it could take "
                         f"{shape.parse_bytes >> 20} MiB of memory, more than the {budget >> 20} MiB allowed")


def _parse(text: bytes | str, what: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, an int of > 4300 digits
        raise ValueError(f"{what}: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None


def read_json(path: str, what: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH):
    """A JSON file parsed, after the checks above; ValueError naming `what` otherwise."""
    return loads_json(read_bytes(path, what, max_bytes), what, max_depth)


def safetensors_header(path: str, what: str, max_header_bytes: int = MAX_SAFETENSORS_HEADER_BYTES) -> dict:
    """The header of a .safetensors file, checked against the file before any tensor is read:
    a regular file, a bounded header that is a JSON object, known dtypes, each tensor's byte range
    equal to its dtype and shape, inside the file, the ranges not overlapping. Returns
    {name: {"dtype", "shape", "data_offsets"}} (and "__metadata__" if present). Costs at most the
    header's size and max(MAX_JSON_PARSE_BYTES, 2 x its size + 1 MiB) in memory, ~3 x the size of a
    large header (json_scan refuses a header whose parse would cost more before it is parsed)."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{what}: truncated ({size} bytes; not a safetensors file)")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise ValueError(f"{what}: header length {length} does not fit the file ({size} bytes; truncated or "
                             "not a safetensors file)")
        if length > max_header_bytes:
            raise ValueError(f"{what}: header length {length}, more than the {max_header_bytes} bytes allowed")
        raw = f.read(length)
    # Checked, then decoded and parsed with the bytes let go (what the parse costs includes the text).
    _check_shape(raw, f"{what} (header)", max_depth=8)
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} (header): not valid JSON (UnicodeDecodeError: {str(e)[:120]})") from None
    del raw
    header = _parse(text, f"{what} (header)")
    del text
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
