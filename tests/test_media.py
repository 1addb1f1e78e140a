"""jpaged/multimodal/media.py: images a request names, loaded without trusting them (issue 65).

Good inputs decode to the pixels Pillow itself decodes (alpha: composited on white, checked
against a float64 numpy reference). Every bad input is a MediaError (a ValueError) naming it:
corrupt, truncated and non-image bytes, a decompression bomb (a PNG header declaring a huge size,
refused before its pixels are decoded), a data: URL over the byte limit (refused before base64
decoding), local files outside --allowed-local-media-path ('..', a symlink out, none allowed, a
FIFO), and, against a loopback aiohttp server: a slow URL (timeout), a huge body (reading stops:
the bytes the server got out stay bounded), redirects forever, a redirect to file:, other schemes."""

import asyncio
import base64
import gzip
import io
import os
import struct
import threading
import zlib

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from jpaged.multimodal import media
from jpaged.multimodal.media import MediaError, MediaOptions

SEED = 20261128
MiB = 1 << 20


def random_image(seed: int, size=(37, 23), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def pil_decode(data: bytes) -> np.ndarray:
    """Pillow's own decode, the reference."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR declaring width x height, and an empty IDAT: a few dozen bytes."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


# -- decoding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,mode", [("PNG", "RGB"), ("JPEG", "RGB"), ("PNG", "L"), ("WEBP", "RGB"),
                                      ("GIF", "RGB"), ("BMP", "RGB"), ("TIFF", "RGB")])
def test_data_url_decodes_as_pillow(fmt, mode):
    print("seed", SEED)
    data = encode(random_image(SEED, mode=mode), fmt)
    image = media.load_image(data_url(data, f"image/{fmt.lower()}"), what="img")
    assert image.mode == "RGB" and image.size == (37, 23)
    np.testing.assert_array_equal(np.asarray(image), pil_decode(data))


def test_alpha_composited_on_white():
    print("seed", SEED)
    source = random_image(SEED + 1, mode="RGBA")
    image = media.decode_image(encode(source, "PNG"))
    rgba = np.asarray(source).astype(np.float64)
    expected = rgba[..., :3] * rgba[..., 3:] / 255 + 255 * (1 - rgba[..., 3:] / 255)
    assert np.abs(np.asarray(image).astype(np.float64) - expected).max() <= 1


def test_pil_image_and_bytes_sources():
    source = random_image(SEED + 2)
    np.testing.assert_array_equal(np.asarray(media.load_image(source)), np.asarray(source))
    data = encode(source, "PNG")
    np.testing.assert_array_equal(np.asarray(media.load_image(data)), np.asarray(source))
    with pytest.raises(MediaError, match="img: expected a PIL image"):
        media.load_image(12, what="img")


@pytest.mark.parametrize("cut", ["header", "pixels"])
def test_truncated_png(cut):
    data = encode(random_image(SEED + 3, size=(64, 64)), "PNG")
    data = data[:30] if cut == "header" else data[:len(data) // 2]
    with pytest.raises(MediaError, match=r"^img: (not an image \(or truncated|a corrupt or truncated image)"):
        media.decode_image(data, "img")


def test_truncated_jpeg():
    data = encode(random_image(SEED + 4, size=(64, 64)), "JPEG")
    with pytest.raises(MediaError, match="^img: a corrupt or truncated image"):
        media.decode_image(data[:len(data) // 2], "img")


def test_corrupt_png():
    """A flipped byte in the pixel data: verify() finds the bad CRC."""
    data = bytearray(encode(random_image(SEED + 5, size=(64, 64)), "PNG"))
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(MediaError, match="^img: a corrupt or truncated image"):
        media.decode_image(bytes(data), "img")


@pytest.mark.parametrize("data", [b"hello, not an image", b"%!PS-Adobe-3.0 EPSF-3.0\n", b"\0" * 100,
                                  b"GIF89a" + b"\0" * 10])
def test_not_an_image(data):
    """Text, zeros, a broken GIF, and an EPS file (a format Pillow opens through Ghostscript: refused)."""
    with pytest.raises(MediaError, match=r"^img: not an image .*start with"):
        media.decode_image(data, "img")
    with pytest.raises(MediaError, match="^img: empty"):
        media.decode_image(b"", "img")


def test_decompression_bomb_refused_before_decoding():
    """A 57-byte PNG declaring 10^10 pixels (30 GB as RGB) is refused at once; one declaring 25M
    pixels, under Pillow's own limit, is refused by the per-call limit before its (absent) pixels
    are read: a decode would have failed on the empty IDAT with another message."""
    bomb = png_header_only(100_000, 100_000)
    assert len(bomb) < 100
    with pytest.raises(MediaError, match=r"^img: 10000000000 pixels is over the limit of 89478485 pixels"):
        media.decode_image(bomb, "img")
    with pytest.raises(MediaError, match=r"^img: 5000x5000 = 25000000 pixels is over the limit of 1000000 pixels"):
        media.decode_image(png_header_only(5000, 5000), "img", max_pixels=1_000_000)
    with pytest.raises(MediaError, match="pixels is over the limit of 1000 pixels"):  # a caller's PIL image
        media.check_image(random_image(SEED, size=(40, 30)), "img", max_pixels=1000)
    assert Image.MAX_IMAGE_PIXELS == media.DEFAULT_MAX_PIXELS  # Pillow's global is left alone


def test_prompt_budgets():
    """All of a prompt's images together: at most max_request_pixels and max_request_bytes."""
    images = [random_image(SEED + i, size=(100, 100)) for i in range(3)]
    options = MediaOptions(max_request_pixels=25_000)
    assert len(media.load_images(images[:2], options)) == 2
    with pytest.raises(MediaError, match=r"^image 2: 100x100 = 10000 pixels; the prompt's images together"):
        media.load_images(images, options)
    urls = [data_url(encode(im, "PNG")) for im in images]
    size = len(base64.b64decode(urls[0].split(",")[1]))
    with pytest.raises(MediaError, match=r"^b: the prompt's images come to more than"):
        media.load_images(urls, MediaOptions(max_request_bytes=size + 10), ["a", "b", "c"])
    with pytest.raises(MediaError, match=r"^b: the prompt's images come to more than"):
        asyncio.run(media.load_images_async(urls, MediaOptions(max_request_bytes=size + 10), ["a", "b", "c"]))


# -- data: URLs ----------------------------------------------------------------------------------

def test_data_url_size_checked_before_decoding():
    """Over the limit: refused from the text's length (the payload is not even base64)."""
    with pytest.raises(MediaError, match=r"^u: about 3000 bytes is over the limit of 1000 bytes"):
        media.data_url_bytes("data:image/png;base64," + "!" * 4000, "u", 1000)
    exact = base64.b64encode(b"x" * 1000).decode()
    assert media.data_url_bytes("data:image/png;base64," + exact, "u", 1000) == b"x" * 1000
    with pytest.raises(MediaError, match="1001 bytes is over the limit of 1000"):
        media.data_url_bytes("data:image/png;base64," + base64.b64encode(b"x" * 1001).decode(), "u", 1000)


@pytest.mark.parametrize("url,message", [
    ("data:image/png,abcd", "only base64 data: URLs"),
    ("data:image/png;base64", "needs a ','"),
    ("data:image/png;base64,abc", "not valid base64"),
])
def test_bad_data_urls(url, message):
    with pytest.raises(MediaError, match=f"^u: .*{message}"):
        media.load_image(url, what="u")


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://x/", "javascript:alert(1)",
                                 "relative/path.png", "C:\\images\\a.png", "s3://bucket/key"])
def test_other_schemes_refused(url):
    with pytest.raises(MediaError, match="^u: (the URL scheme .* is not supported|not a URL)"):
        media.load_image(url, MediaOptions(allowed_local_media_path="/"), what="u")


# -- local files ---------------------------------------------------------------------------------

@pytest.fixture
def media_dirs(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    data = encode(random_image(SEED + 7), "PNG")
    (allowed / "in.png").write_bytes(data)
    (outside / "out.png").write_bytes(data)
    os.symlink(outside / "out.png", allowed / "link_out.png")
    os.symlink(allowed / "in.png", allowed / "link_in.png")
    return allowed, outside, data


def test_local_files_under_the_allowed_folder(media_dirs):
    allowed, _, data = media_dirs
    options = MediaOptions(allowed_local_media_path=str(allowed))
    for source in (f"file://{allowed}/in.png", str(allowed / "in.png"), f"file://{allowed}/link_in.png",
                   f"file://localhost{allowed}/in.png", f"file://{allowed}/sub/../in.png"):
        np.testing.assert_array_equal(np.asarray(media.load_image(source, options)), pil_decode(data))
    np.testing.assert_array_equal(  # the async loader reads files in a thread
        np.asarray(asyncio.run(media.load_image_async(f"file://{allowed}/in.png", options))), pil_decode(data))


def test_local_files_outside_refused(media_dirs):
    allowed, outside, _ = media_dirs
    options = MediaOptions(allowed_local_media_path=str(allowed))
    for source in (f"file://{outside}/out.png", f"file://{allowed}/../outside/out.png",
                   f"{allowed}/../outside/out.png", f"file://{allowed}/link_out.png", "file:///etc/hostname",
                   f"file://{allowed}%2F..%2Foutside%2Fout.png"):
        with pytest.raises(MediaError, match="^u: .* is outside --allowed-local-media-path"):
            media.load_image(source, options, what="u")
    with pytest.raises(MediaError, match="^u: local files are not allowed"):
        media.load_image(f"file://{allowed}/in.png", MediaOptions(), what="u")
    with pytest.raises(MediaError, match="^u: a file: URL names no host"):
        media.load_image(f"file://example.com{allowed}/in.png", options, what="u")


def test_local_special_files_refused(media_dirs):
    """A FIFO (would block a plain open), a directory, a missing file, a file over the byte limit."""
    allowed, _, data = media_dirs
    os.mkfifo(allowed / "fifo")
    (allowed / "dir").mkdir()
    options = MediaOptions(allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match="^u: not a regular file"):
        media.load_image(f"file://{allowed}/fifo", options, what="u")
    with pytest.raises(MediaError, match="^u: (not a regular file|cannot be opened)"):
        media.load_image(f"file://{allowed}/dir", options, what="u")
    with pytest.raises(MediaError, match=r"^u: cannot be opened \(No such file"):
        media.load_image(f"file://{allowed}/missing.png", options, what="u")
    small = MediaOptions(allowed_local_media_path=str(allowed), max_image_bytes=100)
    with pytest.raises(MediaError, match=f"^u: {len(data)} bytes, over the limit of 100 bytes"):
        media.load_image(f"file://{allowed}/in.png", small, what="u")
    with pytest.raises(ValueError, match="allowed_local_media_path=.*not an existing directory"):
        MediaOptions(allowed_local_media_path=str(allowed / "in.png"))


def test_options_from_env(monkeypatch):
    monkeypatch.delenv("JPAGED_IMAGE_FETCH_TIMEOUT", raising=False)
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "3")
    assert MediaOptions.from_env().fetch_timeout == 3.0
    monkeypatch.setenv("JPAGED_IMAGE_FETCH_TIMEOUT", "2.5")
    assert MediaOptions.from_env().fetch_timeout == 2.5
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    monkeypatch.setenv("JPAGED_MAX_IMAGE_BYTES", "1000")
    options = MediaOptions.from_env(max_pixels=10)
    assert (options.max_redirects, options.max_image_bytes, options.max_pixels) == (0, 1000, 10)
    monkeypatch.setenv("JPAGED_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="JPAGED_IMAGE_FETCH_TIMEOUT='soon': expected a number"):
        MediaOptions.from_env()
    with pytest.raises(ValueError, match="max_redirects=-1"):
        MediaOptions(max_redirects=-1)


# -- http(s), against a loopback server -----------------------------------------------------------

class LoopbackServer:
    """An aiohttp app on 127.0.0.1 in a thread of its own, with the URLs the tests fetch."""

    def __init__(self):
        self.image = encode(random_image(SEED + 9, size=(50, 40)), "PNG")
        self.sent = {}  # bytes each streaming handler got out before the client went away
        self.done = {}  # threading.Events: the handler returned
        self.hits = {"loop": 0}
        app = web.Application()
        app.add_routes([web.get("/image.png", self.serve_image), web.get("/slow", self.slow),
                        web.get("/endless", self.endless), web.get("/declared", self.declared),
                        web.get("/redirect/{n}", self.redirect), web.get("/loop/{i}", self.loop),
                        web.get("/to-file", self.to_file), web.get("/missing", self.missing),
                        web.get("/gzip-bomb", self.gzip_bomb), web.get("/to-localhost", self.to_localhost)])
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(app, started), daemon=True)
        self.thread.start()
        started.wait(30)

    def _run(self, app, started):
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    async def serve_image(self, request):
        return web.Response(body=self.image, content_type="image/png")

    @staticmethod
    async def until_gone(request, seconds=30.0):
        for _ in range(int(seconds / 0.02)):
            if request.transport is None or request.transport.is_closing():
                return
            await asyncio.sleep(0.02)

    async def slow(self, request):
        self.done["slow"] = threading.Event()
        await self.until_gone(request)
        self.done["slow"].set()
        return web.Response(body=self.image)

    async def endless(self, request):
        """No Content-Length, 64 KiB chunks for as long as the client reads."""
        self.sent["endless"], self.done["endless"] = 0, threading.Event()
        response = web.StreamResponse()
        await response.prepare(request)
        chunk = b"\x89PNG\r\n\x1a\n" + bytes(65528)
        try:
            for _ in range(1 << 16):  # 4 GiB at most
                await response.write(chunk)
                self.sent["endless"] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        finally:
            self.done["endless"].set()
        return response

    async def declared(self, request):
        """Content-Length: 10 GB, then a few bytes and a wait."""
        self.done["declared"] = threading.Event()
        response = web.StreamResponse(headers={"Content-Length": str(10 ** 10)})
        await response.prepare(request)
        try:
            await response.write(b"\x89PNG\r\n\x1a\n")
            await self.until_gone(request)
        finally:
            self.done["declared"].set()
        return response

    async def redirect(self, request):
        n = int(request.match_info["n"])  # n more redirects, then the image
        if n == 0:
            return await self.serve_image(request)
        raise web.HTTPFound(self.url(f"/redirect/{n - 1}"))

    async def loop(self, request):
        self.hits["loop"] += 1
        raise web.HTTPFound(self.url(f"/loop/{int(request.match_info['i']) + 1}"))

    async def to_localhost(self, request):
        raise web.HTTPFound(f"http://localhost:{self.port}/image.png")

    async def to_file(self, request):
        raise web.HTTPFound("file:///etc/passwd")

    async def missing(self, request):
        raise web.HTTPNotFound()

    async def gzip_bomb(self, request):
        """A gzip body that inflates 1000x: sent as is, never inflated (we ask for identity)."""
        body = gzip.compress(bytes(64 * MiB))
        return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "image/png"})


@pytest.fixture(scope="module")
def server():
    s = LoopbackServer()
    yield s
    s.stop()


def test_http_image(server):
    expected = pil_decode(server.image)
    url = server.url("/image.png")
    np.testing.assert_array_equal(np.asarray(asyncio.run(media.load_image_async(url, MediaOptions()))), expected)
    np.testing.assert_array_equal(np.asarray(media.load_image(url)), expected)  # the offline (sync) path

    async def inside_a_loop():  # the sync path called from code that already runs an event loop
        return media.load_image(url)
    np.testing.assert_array_equal(np.asarray(asyncio.run(inside_a_loop())), expected)
    images = asyncio.run(media.load_images_async([url, data_url(server.image), url], MediaOptions()))
    assert [im.size for im in images] == [(50, 40)] * 3


def test_http_slow(server):
    options = MediaOptions(fetch_timeout=0.3)
    with pytest.raises(MediaError, match=r"^u: not fetched within 0.3 s"):
        asyncio.run(media.load_image_async(server.url("/slow"), options, "u"))
    assert server.done["slow"].wait(30)  # the connection was closed: the handler saw it
    with pytest.raises(MediaError, match=r"^u: not fetched within 0.3 s"):
        media.load_image(server.url("/slow"), options, "u")


def test_http_huge_stops_reading(server):
    """An endless body: refused once past the limit; what the server got out (into loopback's
    socket buffers) stays within a few MiB of the limit, where reading it all would take GiBs."""
    options = MediaOptions(max_image_bytes=2 * MiB, fetch_timeout=30)
    with pytest.raises(MediaError, match=r"^u: more than the limit of 2097152 bytes \(stopped reading at"):
        asyncio.run(media.load_image_async(server.url("/endless"), options, "u"))
    assert server.done["endless"].wait(30)
    print(f"the server got out {server.sent['endless'] / MiB:.1f} MiB")
    assert server.sent["endless"] < 2 * MiB + 32 * MiB
    with pytest.raises(MediaError, match=r"^u: 10000000000 bytes is over the limit of 2097152 bytes"):
        asyncio.run(media.load_image_async(server.url("/declared"), options, "u"))
    assert server.done["declared"].wait(30)


def test_http_redirects(server):
    options = MediaOptions(max_redirects=3, fetch_timeout=30)
    image = asyncio.run(media.load_image_async(server.url("/redirect/3"), options))  # exactly 3: followed
    np.testing.assert_array_equal(np.asarray(image), pil_decode(server.image))
    with pytest.raises(MediaError, match="^u: more than 3 redirects"):
        asyncio.run(media.load_image_async(server.url("/redirect/4"), options, "u"))
    server.hits["loop"] = 0
    with pytest.raises(MediaError, match="^u: more than 3 redirects"):
        asyncio.run(media.load_image_async(server.url("/loop/0"), options, "u"))
    assert server.hits["loop"] == 4  # the first request and 3 redirects, then it stopped
    with pytest.raises(MediaError, match="^u: the server redirected .* redirects are not allowed"):
        media.load_image(server.url("/redirect/1"), MediaOptions(max_redirects=0), "u")
    with pytest.raises(MediaError, match="^u: redirected to a URL that is not http"):
        asyncio.run(media.load_image_async(server.url("/to-file"), options, "u"))


def test_allowed_media_domains(server):
    """--allowed-media-domains: other hosts refused, each redirect's host too."""
    expected = pil_decode(server.image)
    only_ip = MediaOptions(allowed_media_domains="127.0.0.1, other.example")
    assert only_ip.allowed_media_domains == ("127.0.0.1", "other.example")
    np.testing.assert_array_equal(np.asarray(media.load_image(server.url("/redirect/2"), only_ip)), expected)
    with pytest.raises(MediaError, match="^u: redirected to the host 'localhost', which is not in --allowed-media"):
        media.load_image(server.url("/to-localhost"), only_ip, "u")
    with pytest.raises(MediaError, match="^u: the host '127.0.0.1', which is not in --allowed-media-domains"):
        media.load_image(server.url("/image.png"), MediaOptions(allowed_media_domains=["LOCALHOST."]), "u")
    np.testing.assert_array_equal(  # localhost. and LOCALHOST are the same host
        np.asarray(media.load_image(server.url("/to-localhost"), MediaOptions(allowed_media_domains=["LOCALHOST.",
                                                                                                  "127.0.0.1"]))),
        expected)
    with pytest.raises(ValueError, match="allowed_media_domains"):
        MediaOptions(allowed_media_domains=[])


def test_http_errors(server):
    with pytest.raises(MediaError, match="^u: HTTP 404"):
        asyncio.run(media.load_image_async(server.url("/missing"), MediaOptions(), "u"))
    with pytest.raises(MediaError, match=r"^u: not an image .*start with b'\\x1f\\x8b"):  # gzip, not inflated
        asyncio.run(media.load_image_async(server.url("/gzip-bomb"), MediaOptions(), "u"))
    # A port nothing listens on (the server's own, after a bind-and-close would race: use port 9, discard).
    with pytest.raises(MediaError, match=r"^u: could not be fetched"):
        asyncio.run(media.load_image_async("http://127.0.0.1:9/x.png", MediaOptions(), "u"))
    # The first failure cancels the prompt's other fetches: no wait for the slow one.
    with pytest.raises(MediaError, match=r"^b: HTTP 404"):
        asyncio.run(media.load_images_async([server.url("/slow"), server.url("/missing")],
                                            MediaOptions(fetch_timeout=30), ["a", "b"]))
