"""Reading a request's body: its bytes within a time limit, decompressed, decoded and parsed as a
JSON object; a slow, undecodable, malformed or hostile body is a 4xx in OpenAI's shape."""

import asyncio
import codecs
import json
import zlib

from aiohttp import web

from serving import protocol
from serving.protocol import APIError

MAX_BODY_BYTES = 16 * 2**20  # larger bodies get a 413


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def json_body(request, timeout: float) -> dict:
    """The body as a JSON object; anything else (a slow, undecodable, malformed or hostile body) is
    a 4xx in OpenAI's shape."""
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise APIError(f"the request body was not received within {timeout:g} s", status=408,
                       code="request_timeout") from None
    except web.HTTPException:  # 413: too large
        raise
    except Exception as e:  # a corrupt compressed body, a broken transfer encoding
        raise APIError(f"the request body could not be read: {e}", code="invalid_body") from None
    raw = _decompress(raw, request.headers.get("Content-Encoding"))
    charset = _body_charset(request.charset)
    try:
        text = raw.decode(charset)
    except UnicodeError as e:
        raise APIError(f"the request body could not be decoded as {charset}: {e}", code="invalid_body") from None
    # Parsing up to MAX_BODY_BYTES takes a while: in a thread, so the event loop keeps answering.
    body = await asyncio.to_thread(_parse_json, text)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    return body


# Charsets a body may declare (JSON is UTF-8, RFC 8259; the rest are its Unicode siblings and
# ASCII's supersets). Not every Python codec: "undefined" fails on any input, "rot13" or "base64"
# are not text encodings, and "punycode" takes quadratic time (a 16 MiB body: hours).
BODY_CHARSETS = frozenset({"utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le",
                           "utf-32-be", "ascii", "iso8859-1", "cp1252"})  # codecs.lookup(...).name


def _body_charset(declared: str | None) -> str:
    """The codec for a body's `Content-Type: ...; charset=X` (none: UTF-8); a 400 naming X for a
    charset that is unknown or not one of BODY_CHARSETS."""
    if declared is None:
        return "utf-8"
    try:
        name = codecs.lookup(declared).name
    except (LookupError, ValueError):  # ValueError: a name with a NUL in it
        name = None
    if name not in BODY_CHARSETS:
        raise APIError(f"the request body's charset {declared!r:.80} is not supported; send JSON as UTF-8",
                       param="Content-Type", code="unsupported_charset")
    return name


def _decompress(raw: bytes, encoding: str | None) -> bytes:
    """The body without its Content-Encoding. Decoded here, not by aiohttp, so that a corrupt
    body is a 400 in OpenAI's shape and a decompression bomb stops at MAX_BODY_BYTES."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return raw
    wbits = {"gzip": 31, "x-gzip": 31, "deflate": 15}.get(encoding)
    if wbits is None:
        raise APIError(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)", status=415,
                       code="unsupported_encoding")
    for bits in (wbits, -15) if encoding == "deflate" else (wbits,):  # "deflate": zlib-wrapped, or raw
        decoder = zlib.decompressobj(bits)
        try:
            body = decoder.decompress(raw, MAX_BODY_BYTES + 1)
        except zlib.error:
            continue
        if len(body) > MAX_BODY_BYTES:
            raise APIError(f"the decompressed body exceeds {MAX_BODY_BYTES} bytes", status=413)
        if decoder.eof:
            return body
    raise APIError(f"the request body is not valid {encoding} data", code="invalid_body")


def _parse_json(text: str):
    protocol.check_json_depth(text, None, "the request body")  # before json.loads recurses
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError("the request body nests arrays or objects too deeply", code="invalid_json") from None
    except ValueError as e:  # malformed JSON, NaN / Infinity, an integer of more than 4300 digits
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    _check_strings(body)
    return body


def _check_strings(value):
    """A 400 for strings that are not Unicode text: a lone surrogate ("\\ud800") survives JSON but
    not UTF-8, which every tokenizer needs."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(f"the request contains a string that is not valid Unicode ({e.reason} at "
                               f"character {e.start}): {item[max(0, e.start - 20):e.start + 20]!r}",
                               code="invalid_string") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
