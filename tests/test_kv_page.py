"""GET /kv, the live KV map, rendered by a real headless browser (Chromium) while requests run, behind
--api-key; one snapshot serves every poller for SNAPSHOT_S."""

import asyncio
import gzip
import random
import shutil
import subprocess
import threading

import aiohttp
import pytest

from test_server import API_KEY, AUTH, Server, get, metrics, run

from serving import kv_page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="chromium is not installed (Debian: apt-get install chromium)")

NUM_BLOCKS = 40
CELL = 12 * 12  # pixels of one block's cell (kv_map.CELL square, device scale factor 1)
COLORS = {"in use": (0x16, 0xA3, 0x4A), "reserved": (0xFA, 0xCC, 0x15), "free": (0xE5, 0xE7, 0xEB)}


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", API_KEY, "--max-num-seqs", "2", "--max-model-len", "128", "--max-num-batched-tokens", "128",
               "--num-gpu-blocks-override", str(NUM_BLOCKS), "--block-size", "16", "--enforce-eager")
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


def screenshot(url: str, path, page: str | None = None) -> dict[str, int]:
    """Load the page in headless Chromium, the API key given as the Basic password in the URL (as a
    browser asked by WWW-Authenticate sends it), or `page` (HTML the server sent earlier, from a
    file); the number of cells of each colour it rendered (the legend's one cell per colour not counted)."""
    Image = pytest.importorskip("PIL.Image")
    if page is not None:
        html = path.with_suffix(".html")
        html.write_text(page)
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={path.parent / 'chromium'}", "--force-device-scale-factor=1",
                    "--window-size=1100,400", f"--screenshot={path}",
                    url.replace("://", f"://jpaged:{API_KEY}@") + "/kv" if page is None else html.as_uri()],
                   check=True, capture_output=True, timeout=60)
    pixels = {rgb: n for n, rgb in Image.open(path).convert("RGB").getcolors(1 << 20)}
    return {state: round(pixels.get(rgb, 0) / CELL) - 1 for state, rgb in COLORS.items()}


@needs_chromium
def test_page_and_metrics_follow_the_pool(server, tmp_path):
    status, page = run(get(server.url, "/kv"))
    assert status == 200 and '<meta http-equiv="refresh"' in page and page.count('class="block ') == NUM_BLOCKS
    idle = screenshot(server.url, tmp_path / "idle.png")
    assert idle == {"in use": 0, "reserved": 0, "free": NUM_BLOCKS}

    async def generate(i):
        body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 60, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status == 200, await r.text()

    async def generate_all():
        await asyncio.gather(*(generate(i) for i in range(4)))

    requests = threading.Thread(target=lambda: run(generate_all()))
    requests.start()
    # Pages the server sent while requests ran (kept: the requests may end before a browser starts),
    # each drawn by the browser afterwards.
    pages = []
    while requests.is_alive() and len(pages) < 3:
        values = metrics(server.url)
        if values['jpaged:kv_slots{model_name="tiny",state="token"}'] > 0:
            assert sum(values[f'jpaged:kv_slots{{model_name="tiny",state="{s}"}}']
                       for s in ("token", "reserved", "fragmented", "free")) == NUM_BLOCKS * 16
            status, page = run(get(server.url, "/kv"))
            if status == 200 and 'class="block in-use"' in page:
                pages.append(page)
    requests.join()
    busy = [screenshot(server.url, tmp_path / f"busy{i}.png", page) for i, page in enumerate(pages)]
    # Two requests run at a time, each growing to 5 blocks of 16 tokens: the browser saw blocks
    # in use, every block drawn once, and different pictures as blocks filled and freed.
    seen = [b for b in busy if b["in use"] > 0]
    assert seen, f"no screenshot caught a request running: {busy}"
    assert all(0 < b["in use"] <= 10 and b["in use"] + b["reserved"] + b["free"] == NUM_BLOCKS for b in seen), seen
    assert len({tuple(b.values()) for b in busy + [idle]}) >= 2
    assert screenshot(server.url, tmp_path / "after.png") == idle


class _Usage:
    allocated_slots = total_slots = token_slots = reserved_slots = fragmented_slots = free_slots = 0


class _Map:
    def to_svg(self):
        return "<svg></svg>"


class _Engine:
    """AsyncLLMEngine.call_all's shape: {0: fn(engine)} answered later, counted."""

    def __init__(self):
        self.calls = 0

    async def call_all(self, fn):
        self.calls += 1
        await asyncio.sleep(0)  # the engine thread answers between two steps: the other pollers arrive first
        return {0: fn(self)}

    def kv_map(self):
        return _Map()

    def kv_usage(self):
        return _Usage()


def test_pollers_share_one_snapshot_per_interval():
    """Many clients polling /kv cost the engine one map per SNAPSHOT_S (20 pollers slowed another
    user's stream 6x when each took its own): concurrent requests wait for the snapshot being
    taken, later ones within SNAPSHOT_S get it as it is, and a later poll takes a new one."""
    rng = random.Random(20261125)
    now = [0.0]
    engine = _Engine()
    page = kv_page.KVPage(engine, "tiny", API_KEY, clock=lambda: now[0])

    async def poll():
        pages = await asyncio.gather(*(page.page() for _ in range(20)))
        assert len(set(pages)) == 1 and b"KV cache of tiny" in pages[0][0]
        assert gzip.decompress(pages[0][1]) == pages[0][0]
        now[0] += rng.uniform(0, kv_page.SNAPSHOT_S / 3)
        await asyncio.gather(*(page.page() for _ in range(20)))
        assert engine.calls == 1
        now[0] += kv_page.SNAPSHOT_S
        await page.page()
        assert engine.calls == 2

    asyncio.run(poll())
