"""Images a request names, loaded without trusting them: a `data:` URL, a local file (only under
--allowed-local-media-path), an http(s) URL, raw bytes or a PIL image, each bounded before it
costs anything.

- Bytes: a data: URL's size is known from its base64 length before it is decoded; a local file's
  from fstat before it is read (regular files only, opened without blocking: file_safety.py); an
  http(s) body is streamed and reading stops past the limit (a Content-Length over it is refused
  before a byte of the body is read). Fetches have a total time limit (vLLM's
  VLLM_IMAGE_FETCH_TIMEOUT, 5 s; JPAGED_IMAGE_FETCH_TIMEOUT first), a redirect limit, no
  Content-Encoding (a gzip bomb is not inflated) and no scheme but http and https.
- Pixels: the declared width x height is read from the header and checked before the pixels are
  decoded, so a few-KB PNG that declares a billion pixels costs nothing; the limit is passed per
  call (Pillow's global Image.MAX_IMAGE_PIXELS is left alone and stays a second, outer bound).
  Only common raster formats are opened (IMAGE_FORMATS): no EPS (Ghostscript) or other exotics.
- Decoding: verify() first (PNG's CRCs), then load(): a corrupt, truncated or non-image input is
  a MediaError (a ValueError) naming `what`, never another exception. Images come back RGB, alpha
  composited on white (as transformers' convert_to_rgb and vLLM do).

The async loaders never block the event loop: files, base64 and decoding run in a thread; http
uses aiohttp. Nothing here imports jax or transformers; PIL and aiohttp load on first use.
"""

import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import io
import os
import re

from jpaged.file_safety import read_bytes

DEFAULT_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # one encoded image
DEFAULT_MAX_REDIRECTS = 5
DEFAULT_MAX_PIXELS = 1024 * 1024 * 1024 // 4 // 3  # Pillow's MAX_IMAGE_PIXELS (89,478,485): ~256 MiB as RGB
DEFAULT_MAX_REQUEST_BYTES = 64 << 20  # all encoded images of one prompt
# Formats Image.open may pick (Pillow's names; JPEG includes the MPO JPEGs of many phones).
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "AVIF")
FETCH_CONCURRENCY = 8  # a prompt's http(s) images fetched at once
_CHUNK = 1 << 16
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")


class MediaError(ValueError):
    """An image that cannot be used; the message starts with the caller's name for it."""


def _env_number(names: tuple[str, ...], default, kind):
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                number = kind(value)
            except ValueError:
                raise ValueError(f"${name}={value!r}: expected a number") from None
            if number < 0:
                raise ValueError(f"${name}={value!r}: expected a number >= 0")
            return number
    return default


@dataclasses.dataclass(frozen=True)
class MediaOptions:
    """What loading an image may cost, and where it may come from."""

    allowed_local_media_path: str | None = None  # local files only under this directory (None: none)
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S  # seconds for a whole http(s) fetch, redirects included
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one encoded image
    max_redirects: int = DEFAULT_MAX_REDIRECTS  # redirects one fetch follows (0: none)
    max_pixels: int = DEFAULT_MAX_PIXELS  # one image's declared width x height
    max_request_pixels: int = DEFAULT_MAX_PIXELS  # all images of one prompt together
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # all encoded images of one prompt together
    allowed_media_domains: tuple[str, ...] | None = None  # http(s) only from these hosts (None: any)

    def __post_init__(self):
        for name in ("fetch_timeout", "max_image_bytes", "max_pixels", "max_request_pixels", "max_request_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}; expected a number > 0")
        if isinstance(self.max_redirects, bool) or not isinstance(self.max_redirects, int) or self.max_redirects < 0:
            raise ValueError(f"max_redirects={self.max_redirects!r}; expected an integer >= 0")
        if self.allowed_local_media_path is not None:
            object.__setattr__(self, "allowed_local_media_path", allowed_directory(self.allowed_local_media_path))
        if self.allowed_media_domains is not None:
            object.__setattr__(self, "allowed_media_domains", media_domains(self.allowed_media_domains))

    @classmethod
    def from_env(cls, allowed_local_media_path: str | None = None, allowed_media_domains=None,
                 **overrides) -> "MediaOptions":
        """Options with the environment's limits: $JPAGED_IMAGE_FETCH_TIMEOUT (else vLLM's
        $VLLM_IMAGE_FETCH_TIMEOUT), $JPAGED_MAX_IMAGE_BYTES, and vLLM's
        $VLLM_MEDIA_URL_ALLOW_REDIRECTS=0 (no redirects)."""
        env = {"fetch_timeout": _env_number(("JPAGED_IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT"),
                                            DEFAULT_FETCH_TIMEOUT_S, float),
               "max_image_bytes": _env_number(("JPAGED_MAX_IMAGE_BYTES",), DEFAULT_MAX_IMAGE_BYTES, int)}
        if os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1").strip().lower() in ("0", "false"):
            env["max_redirects"] = 0
        return cls(allowed_local_media_path=allowed_local_media_path, allowed_media_domains=allowed_media_domains,
                   **{**env, **overrides})


def media_domains(domains, name: str = "allowed_media_domains") -> tuple[str, ...]:
    """Host names, lower-cased, from a list or "a.com,b.org" (the command line's form)."""
    if isinstance(domains, str):
        domains = domains.split(",")
    if not isinstance(domains, (list, tuple)) or not all(isinstance(d, str) for d in domains):
        raise ValueError(f"{name}={domains!r}; expected host names, e.g. ['upload.wikimedia.org']")
    hosts = tuple(d.strip().lower().rstrip(".") for d in domains if d.strip())
    if not hosts:
        raise ValueError(f"{name}={domains!r}; expected at least one host name (None: any host)")
    return hosts


def allowed_directory(path: str, name: str = "allowed_local_media_path") -> str:
    """`path` as the real path (symlinks and '..' resolved) of an existing directory; a ValueError
    naming the option otherwise."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{name}={path!r}; expected a directory")
    real = os.path.realpath(os.fspath(path))
    if not os.path.isdir(real):
        raise ValueError(f"{name}={os.fspath(path)!r}: not an existing directory")
    return real


def source_kind(source: str, what: str) -> str:
    """'data', 'http', 'file' (a file: URL or an absolute path); a MediaError for any other scheme.
    Looks at the first characters only (a data: URL may be megabytes)."""
    head = source[:16].lower()
    if head.startswith("data:"):
        return "data"
    if head.startswith(("http://", "https://")):
        return "http"
    if head.startswith("file:") or source.startswith("/"):
        return "file"
    scheme = _SCHEME.match(source[:64])
    if scheme:
        raise MediaError(f"{what}: the URL scheme {scheme.group(1)[:20]!r} is not supported; expected http, https, "
                         "data or file (file only under --allowed-local-media-path)")
    raise MediaError(f"{what}: not a URL (expected http(s)://, data:image/...;base64, or file:// under "
                     "--allowed-local-media-path)")


# -- bytes ---------------------------------------------------------------------------------------

def data_url_bytes(url: str, what: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URL, its size checked from the text's length before decoding."""
    comma = url.find(",", 0, 512)
    if comma < 0:
        raise MediaError(f"{what}: a data: URL needs a ',' after its media type (data:image/png;base64,...)")
    params = url[5:comma].split(";")
    if params[-1].strip().lower() != "base64":
        raise MediaError(f"{what}: only base64 data: URLs are supported (data:image/png;base64,...)")
    payload_chars = len(url) - comma - 1
    if payload_chars // 4 * 3 - 2 > max_bytes:  # the least it decodes to (2 padding characters at most)
        raise MediaError(f"{what}: about {payload_chars // 4 * 3} bytes is over the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(url[comma + 1:])
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{what}: the data: URL is not valid base64 ({e})") from None
    if len(data) > max_bytes:
        raise MediaError(f"{what}: {len(data)} bytes is over the limit of {max_bytes} bytes")
    return data


def local_file_bytes(source: str, what: str, options: MediaOptions) -> bytes:
    """A file: URL's or an absolute path's bytes, only if its real path (symlinks and '..'
    resolved) is under options.allowed_local_media_path, and it is a regular file within the
    byte limit. Blocking: call it in a thread from async code."""
    root = options.allowed_local_media_path
    if root is None:
        raise MediaError(f"{what}: local files are not allowed (the server allows files under a directory "
                         "given with --allowed-local-media-path)")
    path = source
    if source[:5].lower() == "file:":
        import urllib.parse

        parts = urllib.parse.urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"{what}: a file: URL names no host (file:///path), got {parts.netloc[:64]!r}")
        path = urllib.parse.unquote(parts.path)
    if "\0" in path or not os.path.isabs(path):
        raise MediaError(f"{what}: a local file is named by an absolute path (file:///dir/image.png)")
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise MediaError(f"{what}: {path[:200]!r} is outside --allowed-local-media-path")
    try:
        return read_bytes(real, what, options.max_image_bytes)
    except ValueError as e:
        raise MediaError(str(e).replace(f"more than the {options.max_image_bytes} allowed",
                                        f"over the limit of {options.max_image_bytes} bytes")) from None


_REDIRECTS = (301, 302, 303, 307, 308)


def _check_url(url, what: str, options: MediaOptions, redirected: bool = False):
    """A yarl URL's scheme (http(s) only) and, with allowed_media_domains, its host."""
    if url.scheme not in ("http", "https"):
        raise MediaError(f"{what}: redirected to a URL that is not http(s)" if redirected else
                         f"{what}: the URL scheme {url.scheme[:20]!r} is not supported")
    if not url.host:
        raise MediaError(f"{what}: {'redirected to ' if redirected else ''}a URL without a host")
    domains = options.allowed_media_domains
    if domains is not None and url.host.lower().rstrip(".") not in domains:
        raise MediaError(f"{what}: {'redirected to ' if redirected else ''}the host {url.host[:64]!r}, which is not "
                         "in --allowed-media-domains")


async def http_bytes(url: str, what: str, options: MediaOptions, session=None) -> bytes:
    """An http(s) URL's body: within options.fetch_timeout in all (redirects included), at most
    options.max_redirects redirects (followed here, each hop's scheme and host checked), and
    reading stops once the body passes max_image_bytes."""
    import aiohttp
    import yarl

    limit = options.max_image_bytes
    own = session is None
    if own:
        session = aiohttp.ClientSession(auto_decompress=False)
    try:
        async with asyncio.timeout(options.fetch_timeout):
            target = yarl.URL(url)
            for hop in range(options.max_redirects + 1):
                _check_url(target, what, options, redirected=hop > 0)
                async with session.get(target, allow_redirects=False,
                                       headers={"Accept": "image/*", "Accept-Encoding": "identity"}) as response:
                    if response.status in _REDIRECTS and "Location" in response.headers:
                        if options.max_redirects == 0:
                            raise MediaError(f"{what}: the server redirected (HTTP {response.status}) and redirects "
                                             "are not allowed")
                        target = target.join(yarl.URL(response.headers["Location"]))
                        continue
                    if response.status != 200:
                        raise MediaError(f"{what}: HTTP {response.status} {str(response.reason or '')[:60]} "
                                         "fetching the image")
                    if response.content_length is not None and response.content_length > limit:
                        raise MediaError(f"{what}: {response.content_length} bytes is over the limit of {limit} "
                                         "bytes")
                    chunks, total = [], 0
                    async for chunk in response.content.iter_chunked(_CHUNK):
                        total += len(chunk)
                        if total > limit:  # leaving the block closes the connection: nothing more is read
                            raise MediaError(f"{what}: more than the limit of {limit} bytes (stopped reading at "
                                             f"{total})")
                        chunks.append(chunk)
                    return b"".join(chunks)
            raise MediaError(f"{what}: more than {options.max_redirects} redirects")
    except MediaError:
        raise
    except TimeoutError:
        raise MediaError(f"{what}: not fetched within {options.fetch_timeout:g} s (the fetch timeout, "
                         "$JPAGED_IMAGE_FETCH_TIMEOUT)") from None
    except aiohttp.InvalidURL as e:
        raise MediaError(f"{what}: not a valid URL ({str(e)[:120]})") from None
    except (aiohttp.ClientError, OSError, ValueError, TypeError) as e:
        raise MediaError(f"{what}: could not be fetched ({type(e).__name__}: {str(e)[:160]})") from None
    finally:
        if own:
            await session.close()


def http_bytes_sync(url: str, what: str, options: MediaOptions) -> bytes:
    """http_bytes for offline use, run on an event loop of its own (in a thread when the caller
    is already inside one, e.g. a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(http_bytes(url, what, options))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(http_bytes(url, what, options))).result()


def source_bytes(source: str, what: str, options: MediaOptions) -> bytes:
    """A URL's or path's bytes, synchronously (offline)."""
    kind = source_kind(source, what)
    if kind == "data":
        return data_url_bytes(source, what, options.max_image_bytes)
    if kind == "file":
        return local_file_bytes(source, what, options)
    return http_bytes_sync(source, what, options)


async def source_bytes_async(source: str, what: str, options: MediaOptions, session=None) -> bytes:
    """source_bytes without blocking the event loop (base64 and files in a thread)."""
    kind = source_kind(source, what)
    if kind == "data":
        return await asyncio.to_thread(data_url_bytes, source, what, options.max_image_bytes)
    if kind == "file":
        return await asyncio.to_thread(local_file_bytes, source, what, options)
    return await http_bytes(source, what, options, session)


# -- pixels --------------------------------------------------------------------------------------

def _check_pixels(size: tuple[int, int], what: str, max_pixels: int, request_pixels: int | None = None):
    width, height = size
    pixels = width * height
    if pixels > max_pixels:
        raise MediaError(f"{what}: {width}x{height} = {pixels} pixels is over the limit of {max_pixels} pixels")
    if request_pixels is not None and pixels > request_pixels:
        raise MediaError(f"{what}: {width}x{height} = {pixels} pixels; the prompt's images together are over the "
                         "limit of pixels per prompt")
    if pixels == 0:
        raise MediaError(f"{what}: an empty image ({width}x{height})")


def _to_rgb(image):
    """RGB, alpha (if any) composited on white, as transformers' convert_to_rgb."""
    from PIL import Image

    if image.mode == "RGB":
        return image.copy()
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, what: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS,
                 request_pixels: int | None = None):
    """`data` decoded to an RGB PIL image: the declared size checked first, then verify(), then
    the pixels; a MediaError naming `what` for anything that is not a whole, supported image."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise MediaError(f"{what}: empty (0 bytes; not an image)")
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as probe:
            _check_pixels(probe.size, what, max_pixels, request_pixels)
            probe.verify()
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            _check_pixels(image.size, what, max_pixels, request_pixels)
            image.load()
            return _to_rgb(image)
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(f"{what}: not an image (or truncated, or not one of {', '.join(IMAGE_FORMATS)}): its "
                         f"{len(data)} bytes start with {bytes(data[:8])!r}") from None
    except Image.DecompressionBombError as e:  # Pillow's own (global) limit, the outer bound
        pixels = re.search(r"\((\d+) pixels\)", str(e))
        raise MediaError(f"{what}: {pixels.group(1) if pixels else 'more'} pixels is over the limit of "
                         f"{max_pixels} pixels (a decompression bomb?)") from None
    except Exception as e:  # noqa: BLE001 - Pillow's decoders raise OSError, SyntaxError, struct.error, ...
        raise MediaError(f"{what}: a corrupt or truncated image ({type(e).__name__}: {str(e)[:160]})") from None


def check_image(image, what: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS, request_pixels: int | None = None):
    """A caller's PIL image (offline), its size checked, as RGB."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise MediaError(f"{what}: expected a PIL image, a URL or bytes, got {type(image).__name__}")
    _check_pixels(image.size, what, max_pixels, request_pixels)
    try:
        image.load()
        return _to_rgb(image)
    except Exception as e:  # noqa: BLE001 - a lazily opened image whose file is corrupt
        raise MediaError(f"{what}: a corrupt or truncated image ({type(e).__name__}: {str(e)[:160]})") from None


def decode_images(items: list, whats: list[str], options: MediaOptions) -> list:
    """A prompt's fetched images (bytes or PIL images) as RGB, within its pixel budget."""
    images, budget = [], options.max_request_pixels
    for item, what in zip(items, whats):
        if isinstance(item, (bytes, bytearray, memoryview)):
            image = decode_image(bytes(item), what, options.max_pixels, budget)
        else:
            image = check_image(item, what, options.max_pixels, budget)
        budget -= image.width * image.height
        images.append(image)
    return images


# -- loading -------------------------------------------------------------------------------------

def load_image(source, options: MediaOptions | None = None, what: str = "image"):
    """One image from a URL or path (str), bytes or a PIL image, as RGB; synchronous (offline)."""
    return load_images([source], options, [what])[0]


def load_images(sources: list, options: MediaOptions | None = None, whats: list[str] | None = None) -> list:
    """A prompt's images (see load_image), within the prompt's byte and pixel budgets."""
    options = options or MediaOptions()
    whats = whats or [f"image {i}" for i in range(len(sources))]
    items, total = [], 0
    for source, what in zip(sources, whats):
        item = source_bytes(source, what, options) if isinstance(source, str) else source
        total += len(item) if isinstance(item, (bytes, bytearray, memoryview)) else 0
        _check_request_bytes(total, what, options)
        items.append(item)
    return decode_images(items, whats, options)


def _check_request_bytes(total: int, what: str, options: MediaOptions):
    if total > options.max_request_bytes:
        raise MediaError(f"{what}: the prompt's images come to more than the limit of {options.max_request_bytes} "
                         "bytes per prompt")


async def load_image_async(source, options: MediaOptions, what: str = "image"):
    return (await load_images_async([source], options, [what]))[0]


async def load_images_async(sources: list, options: MediaOptions, whats: list[str] | None = None,
                            decode_gate: asyncio.Semaphore | None = None) -> list:
    """load_images for the server: nothing blocks the event loop. The sources are fetched
    concurrently (FETCH_CONCURRENCY at a time, one aiohttp session); the first failure cancels the
    rest; decoding runs in a thread, one image after another, within the prompt's pixel budget
    (holding `decode_gate`, if given, so that a server decodes only so many prompts at once)."""
    whats = whats or [f"image {i}" for i in range(len(sources))]
    items = await fetch_images_async(sources, options, whats)
    if decode_gate is None:
        return await asyncio.to_thread(decode_images, items, whats, options)
    async with decode_gate:
        return await asyncio.to_thread(decode_images, items, whats, options)


async def fetch_images_async(sources: list, options: MediaOptions, whats: list[str]) -> list:
    """A prompt's sources as bytes (PIL images passed through), within its byte budget."""
    if not sources:
        return []
    kinds = [source_kind(s, w) if isinstance(s, str) else None for s, w in zip(sources, whats)]
    session = None
    if "http" in kinds:
        import aiohttp

        session = aiohttp.ClientSession(auto_decompress=False)
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)
    total = 0

    async def fetch(source, what):
        nonlocal total
        if not isinstance(source, str):
            return source
        async with gate:
            data = await source_bytes_async(source, what, options, session)
        total += len(data)
        _check_request_bytes(total, what, options)
        return data

    tasks = [asyncio.ensure_future(fetch(s, w)) for s, w in zip(sources, whats)]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if session is not None:
            await session.close()
