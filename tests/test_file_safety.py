"""jpaged/file_safety.py: checking a file costs a small multiple of its size, whatever it holds
(issue 60: a safetensors header of 10 MB took ~1.2 GB to check, one of 100 MB ~12 GB).

json_scan's depth is the depth a parser reads, at every chunk boundary; its parse_bytes bounds
what json.loads allocates; a header whose parse would cost more than max(64 MiB, 2 x its size) is
refused before it is parsed, and one that is parsed costs at most ~3 x its size (tracemalloc)."""

import json
import random
import tracemalloc

import numpy as np
import pytest

from jpaged import file_safety
from jpaged.file_safety import json_depth, loads_json, safetensors_header

SEED = 20261125
MiB = 1 << 20


def parsed_depth(data: bytes) -> int:
    """The depth a parser reads: a quote after an odd run of backslashes does not end or start a string."""
    depth = deepest = 0
    inside = False
    for i, byte in enumerate(data):
        if byte == ord('"'):
            run = 0
            while run < i and data[i - 1 - run] == ord("\\"):
                run += 1
            inside ^= run % 2 == 0
        elif not inside and byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif not inside and byte in b"]}":
            depth -= 1
    return deepest


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 18])
def test_json_depth_is_the_parsed_depth_at_every_chunk_boundary(monkeypatch, chunk):
    """Strings of brackets, quotes and runs of backslashes cut anywhere by the chunks."""
    monkeypatch.setattr(file_safety, "_CHUNK", chunk)
    rng = random.Random(SEED + chunk)
    for _ in range(1500):
        data = bytes(rng.choice(b'[]{}""\\\\\\ a,:1') for _ in range(rng.randint(0, 40)))
        assert json_depth(data) == parsed_depth(data), data
    for value in ([[[["]]]]\\\\\"[["]]]], {"a": [{"b": "\\\"{{{"}]}, [], {}, "[[[", 7):
        text = json.dumps(value).encode()
        assert json_depth(text) == parsed_depth(text), text


def _random_value(rng, depth=0):
    kind = rng.random()
    if depth > 5 or kind < 0.3:
        return rng.choice([0, 1000, 1.5, -3, True, None, "", "ab", 'q"\\', "\u00e9", "\U0001f600", 10 ** 30,
                           "x" * rng.randint(0, 30)])
    if kind < 0.65:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {f"k{rng.randint(0, 10 ** 6)}": _random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))}


def _allocated(fn, *args):
    """fn(*args)'s result and the peak of what it allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        try:
            result = fn(*args)
        except ValueError as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_parse_bytes_bounds_what_json_loads_allocates():
    rng = random.Random(SEED)
    for i in range(20):
        text = json.dumps([_random_value(rng) for _ in range(rng.randint(1, 1000))], ensure_ascii=i % 2 == 0).encode()
        value, peak = _allocated(json.loads, text)
        assert peak <= file_safety.json_scan(text).parse_bytes, (peak, file_safety.json_scan(text), len(text))
    for unit in (b"{}", b"[]", b"[0]", b'{"k":0}', b"0", b"1000", b"1e5", b'"ab"', b'"\\ud83d\\ude00"'):
        text = b"[" + b",".join([unit] * 20_000) + b"]"
        value, peak = _allocated(json.loads, text)
        assert peak <= file_safety.json_scan(text).parse_bytes, (unit, peak, file_safety.json_scan(text))


def _write_header(path, body: bytes) -> str:
    with open(path, "wb") as f:
        f.write(len(body).to_bytes(8, "little") + body)
    return str(path)


def large_header(kind: str, size: int) -> bytes:
    """A safetensors header of about `size` bytes: one long metadata string, legitimate-looking
    zero-size tensors, or an array of tiny values (objects, arrays, numbers)."""
    if kind == "string":
        return b'{"__metadata__":{"x":"' + b"a" * (size - 26) + b'"}}'
    if kind == "tensors":
        entry = b'"t%d":{"dtype":"F32","shape":[0,8],"data_offsets":[0,0]}'
        count = size // len(entry % 10 ** 6)
        return b"{" + b",".join(entry % i for i in range(count)) + b"}"
    unit = {"objects": b"{}", "arrays": b"[]", "numbers": b"1e5"}[kind]
    return b'{"__metadata__":{"x":[' + b",".join([unit] * (size // (len(unit) + 1))) + b"]}}"


@pytest.mark.parametrize("kind", ["string", "tensors", "objects", "arrays", "numbers"])
def test_a_large_header_costs_a_small_multiple_of_its_size(tmp_path, kind):
    """10 MiB headers (a 100 MiB one behaves the same, ten times over): at most 3 x the header's
    size allocated, parsed (the string) or refused before parsing (what would parse to 10-25 x)."""
    body = large_header(kind, 10 * MiB)
    path = _write_header(tmp_path / "model.safetensors", body)
    del body
    result, peak = _allocated(safetensors_header, path, "model.safetensors")
    size = 10 * MiB
    print(kind, f"peak {peak / MiB:.1f} MiB ({peak / size:.2f} x)", str(result)[:120])
    assert peak <= 3 * size, f"{kind}: {peak / MiB:.0f} MiB allocated to check a {size / MiB:.0f} MiB header"
    if kind == "string":
        assert isinstance(result, dict) and set(result) == {"__metadata__"}
    else:
        assert isinstance(result, ValueError) and "too many values" in str(result), result
        assert str(result).startswith("model.safetensors (header): JSON of")


def test_loads_json_refuses_json_too_costly_to_parse():
    """4 MiB of `{},` (an adapter_config.json at its size limit) would parse to ~100 MiB."""
    text = b"[" + b",".join([b"{}"] * (4 * MiB // 3)) + b"]"
    result, peak = _allocated(loads_json, text, "adapter_config.json")
    assert isinstance(result, ValueError) and str(result).startswith("adapter_config.json: JSON of"), result
    assert peak <= 2 * len(text)
    assert loads_json(b'{"r": 8, "target_modules": ["q_proj"]}', "x") == {"r": 8, "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match=r"^x: not valid JSON \(ValueError: Exceeds the limit"):
        loads_json(b"[" + b"1" * 5000 + b"]", "x")  # an int of 5,000 digits: still a refusal naming the file


def test_real_headers_are_still_read(tmp_path):
    """A header of 30,000 tensors (more than any checkpoint file holds; ~4 MB), its tensors
    checked against the file as before."""
    header, offset = {}, 0
    for i in range(30_000):
        header[f"model.layers.{i}.mlp.experts.{i % 256}.down_proj.weight"] = {
            "dtype": "BF16", "shape": [2, 2], "data_offsets": [offset, offset + 8]}
        offset += 8
    body = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(body).to_bytes(8, "little") + body + bytes(offset))
    assert safetensors_header(str(path), "x") == header
    with open(path, "r+b") as f:  # one byte short: the last tensor is past the end
        f.truncate(8 + len(body) + offset - 1)
    with pytest.raises(ValueError, match="past the file's"):
        safetensors_header(str(path), "x")
    small = tmp_path / "small.safetensors"
    body = b'{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}'
    small.write_bytes(len(body).to_bytes(8, "little") + body + bytes(4))
    small = str(small)
    with pytest.raises(ValueError, match=f"^x: header length {len(body)}, more than the 50 bytes allowed"):
        safetensors_header(small, "x", max_header_bytes=50)
    assert np.prod(safetensors_header(small, "x")["a"]["shape"]) == 1
