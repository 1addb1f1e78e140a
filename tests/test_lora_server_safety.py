"""LoRA adapters held to the server's promises (issue 38): no request answered with another
adapter while clients load and unload adapters (ids reserved atomically), hostile adapter files
(a FIFO, /dev/zero, JSON 100,000 deep, NaN or huge tensors, bad fields) refused with a 400 while
/health and a victim stream go on, runtime loading only when the operator opts in, under
--allowed-lora-paths, and neither /v1/models nor a load error telling what exists on disk.

The attacks are scripts/stress_lora.py's (its full run: >= 5,000 streams); here a few hundred."""

import asyncio
import json
import os
import random
import shutil
import threading

import aiohttp
import httpx
import pytest
from test_lora import checkpoint  # noqa: F401 (the fixture: a tiny Llama and three PEFT adapters)
from test_server import Server

from jpaged.lora.peft import AdapterUnreadable, load_peft_adapter
from scripts import stress_lora
from serving.lora import RUNTIME_UPDATES_ENV, runtime_updates_allowed

SEED = 20261125
FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-model-len", "128",
         "--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--enforce-eager", "--disable-log-requests")
# What each hostile adapter's 400 must say: the field or tensor, or (nothing readable) only that
# the path is not a loadable adapter.
UNREADABLE = "is not a loadable adapter"
HOSTILE = {
    "fifo-safetensors": UNREADABLE, "fifo-config": UNREADABLE, "dev-zero-config": UNREADABLE,
    "dev-zero-safetensors": UNREADABLE, "huge-config": UNREADABLE, "missing": UNREADABLE, "a-file": UNREADABLE,
    "deep-json": "nested deeper", "nan-tensors": "NaN or infinite", "inf-tensor": "NaN or infinite",
    "1e38-tensor": "magnitude", "int8-tensors": "dtype I8", "alpha-1e308": "lora_alpha", "alpha-0": "lora_alpha",
    "alpha-negative": "lora_alpha", "target-modules-5": "target_modules", "use-rslora-yes": "use_rslora",
    "r-string": "r=",
}


def _root(adapters: dict) -> str:
    return os.path.dirname(next(iter(adapters.values())))


@pytest.fixture(scope="module")
def server(checkpoint):  # noqa: F811
    base_dir, adapters = checkpoint
    s = Server("--model", base_dir, *FLAGS, "--enable-lora-runtime-updates", "--allowed-lora-paths",
               _root(adapters))
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


def run(coro):
    async def with_session():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await coro(session)
    return asyncio.run(with_session())


def test_hostile_adapters_are_refused_without_hanging(checkpoint, tmp_path):  # noqa: F811
    """Offline (no server): each hostile adapter a ValueError naming what is wrong, within a
    generous time (a FIFO used to block forever, /dev/zero to eat memory until killed)."""
    _, adapters = checkpoint
    cases = stress_lora.make_hostile_adapters(str(tmp_path), adapters["attn-r4"])
    assert set(cases) == set(HOSTILE)
    for case, path in cases.items():
        outcome = []

        def load():
            try:
                load_peft_adapter(path, 16, download=False)
                outcome.append("loaded")
            except ValueError as e:
                outcome.append(e)

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        thread.join(60)
        assert outcome, f"{case}: still reading after 60 s"
        error = outcome[0]
        assert isinstance(error, ValueError), f"{case}: {error}"
        assert isinstance(error, AdapterUnreadable) == (HOSTILE[case] == UNREADABLE), (case, error)
        if HOSTILE[case] != UNREADABLE:
            assert HOSTILE[case] in str(error), (case, error)
    # The valid ones still load, their values checked.
    for path in adapters.values():
        assert load_peft_adapter(path, 16, download=False).weights


def test_runtime_updates_env_var(monkeypatch):
    for value, allowed in (("true", True), ("1", True), ("TRUE ", True), ("0", False), ("false", False),
                           ("", False)):
        monkeypatch.setenv(RUNTIME_UPDATES_ENV, value)
        assert runtime_updates_allowed(False) is allowed, value
    monkeypatch.delenv(RUNTIME_UPDATES_ENV)
    assert not runtime_updates_allowed(False) and runtime_updates_allowed(True)


def test_runtime_loading_is_opt_in_and_models_show_no_paths(checkpoint):  # noqa: F811
    """Without --enable-lora-runtime-updates the routes are a 404 (as vLLM's); --lora-modules
    adapters are served, and /v1/models shows no server path."""
    base_dir, adapters = checkpoint
    s = Server("--model", base_dir, "--served-model-name", "base", *FLAGS, "--lora-modules",
               f"attn-r4={adapters['attn-r4']}")
    try:
        for path in ("load_lora_adapter", "unload_lora_adapter"):
            r = httpx.post(f"{s.url}/v1/{path}", json={"lora_name": "x", "lora_path": adapters["all-r8"]}, timeout=60)
            assert r.status_code == 404 and "error" in r.json(), r.text
        models = httpx.get(f"{s.url}/v1/models", timeout=60)
        assert {m["id"] for m in models.json()["data"]} == {"base", "attn-r4"}
        assert _root(adapters) not in models.text and base_dir not in models.text, models.text
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "attn-r4", "prompt": [1, 2, 3], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0


def test_hostile_adapter_files_get_400s_while_serving(server, checkpoint):  # noqa: F811
    _, adapters = checkpoint
    root = _root(adapters)
    hostile = os.path.join(root, "hostile")
    cases = stress_lora.make_hostile_adapters(hostile, adapters["attn-r4"])
    # Outside --allowed-lora-paths (directly, through "..", through a symlink): the same answer
    # as a missing path, whether or not the adapter there is valid.
    outside = os.path.join(os.path.dirname(root), f"outside-{random.Random(SEED).getrandbits(32):x}")
    shutil.copytree(adapters["attn-r4"], outside)  # a valid adapter
    os.symlink(outside, os.path.join(root, "link-out"), target_is_directory=True)
    cases["outside"] = outside
    cases["dot-dot"] = os.path.join(root, "..", os.path.basename(outside))
    cases["symlink-out"] = os.path.join(root, "link-out")
    report = run(lambda session: stress_lora.hostile_files(session, server.url, cases, victim_tokens=60))
    for case, (status, _, message) in report["cases"].items():
        print(case, status, f"{_ * 1e3:.1f} ms", message)
        expected = HOSTILE.get(case, UNREADABLE)
        assert status == 400 and expected in message, (case, status, message)
        if expected == UNREADABLE:  # nothing about what exists: the message is the path and this sentence
            assert message == f"lora_path {cases[case]!r} is not a loadable adapter (not a readable PEFT adapter " \
                              "directory)", message
    print({k: v for k, v in report.items() if k != "cases"})
    assert report["victim_chunks"] > 0 and report["health_answers"] > 0
    assert report["health_slowest_s"] != float("inf")  # every /health answer a 200
    assert run(lambda session: stress_lora.idle(session, server.url))


def _large_header_adapter(directory: str, like: str, body: bytes) -> str:
    os.makedirs(directory)
    shutil.copy(os.path.join(like, "adapter_config.json"), directory)
    with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
        f.write(len(body).to_bytes(8, "little") + body)
    return directory


def test_health_answers_while_large_headers_are_checked(server, checkpoint):  # noqa: F811
    """Issue 60: adapters whose safetensors header is large (15 MiB: one metadata string, parsed;
    tiny objects that would parse to ~25 x, refused unparsed; 20 MiB, over the adapter's cap)
    are 400s in well under a second each while /health and a victim stream go on. The old depth
    check held the GIL for seconds (/health blocked 18-80 s at 100 MB) and took ~120 x the header."""
    _, adapters = checkpoint
    root = os.path.join(_root(adapters), "large-headers")
    like = adapters["attn-r4"]
    cases = {
        "string": _large_header_adapter(os.path.join(root, "string"), like,
                                        b'{"__metadata__":{"x":"' + b"a" * (15 << 20) + b'"}}'),
        "objects": _large_header_adapter(os.path.join(root, "objects"), like,
                                         b'{"__metadata__":{"x":[' + b",".join([b"{}"] * (5 << 20)) + b"]}}"),
        "over-cap": _large_header_adapter(os.path.join(root, "over-cap"), like, b" " * (20 << 20)),
    }
    expected = {"string": "the adapter has no LoRA weights", "objects": "too many values",
                "over-cap": "more than the 16777216 bytes allowed"}
    try:
        report = run(lambda session: stress_lora.hostile_files(session, server.url, cases, victim_tokens=60))
    finally:
        shutil.rmtree(root)
    for case, (status, seconds, message) in report["cases"].items():
        print(case, status, f"{seconds:.2f} s", message[:160])
    print({k: v for k, v in report.items() if k != "cases"})
    assert report["health_answers"] > 0 and report["victim_chunks"] > 0
    assert report["health_slowest_s"] < 0.5, report
    for case, (status, seconds, message) in report["cases"].items():
        assert status == 400 and expected[case] in message, (case, status, message)
        assert seconds < 5, (case, seconds)


def test_unload_while_streaming_finishes_with_the_adapter(server, checkpoint):  # noqa: F811
    """An adapter unloaded mid-stream: the stream ends with that adapter's text, while two other
    adapters take both device slots; a new request naming it is a 404."""
    _, adapters = checkpoint
    paths = list(adapters.values())

    async def scenario(session):
        url = server.url
        expected = await stress_lora.expected_texts(session, url, paths, 100)
        assert len(set(expected.values())) == len(expected)
        for i, path in enumerate(paths):
            assert (await stress_lora._post(session, url, "/v1/load_lora_adapter",
                                            {"lora_name": f"mid-{i}", "lora_path": path}))[0] == 200
        started = asyncio.Event()
        stream = asyncio.create_task(stress_lora.complete(session, url, "mid-0", 100, started=started))
        await started.wait()
        assert (await stress_lora._post(session, url, "/v1/unload_lora_adapter", {"lora_name": "mid-0"}))[0] == 200
        others = await asyncio.gather(*[stress_lora.complete(session, url, f"mid-{i}", 100) for i in (1, 2, 1, 2)])
        status, text, error = await stream
        assert (status, text, error) == (200, expected[paths[0]], False)
        assert [o[1] for o in others] == [expected[paths[i]] for i in (1, 2, 1, 2)]
        assert (await stress_lora.complete(session, url, "mid-0", 4))[0] == 404
        for i in (1, 2):
            await stress_lora._post(session, url, "/v1/unload_lora_adapter", {"lora_name": f"mid-{i}"})
        return await stress_lora.idle(session, url)

    assert run(scenario)


def test_churn_never_answers_with_another_adapter(server, checkpoint):  # noqa: F811
    """Concurrent loads of different names all succeed (they once got one id and seven 400s);
    then clients load and unload while streams check every answer against its adapter alone."""
    _, adapters = checkpoint
    paths = list(adapters.values())
    seed = random.Random(SEED).randrange(2**31)
    print("seed", seed)

    async def scenario(session):
        expected = await stress_lora.expected_texts(session, server.url, paths, 8)
        assert len(set(expected.values())) == len(expected), expected  # a wrong adapter would show
        problems = await stress_lora.burst(session, server.url, paths, expected)
        result = await stress_lora.churn(session, server.url, paths, expected, streams=300, seed=seed)
        return problems, result, await stress_lora.idle(session, server.url)

    problems, result, idle = run(scenario)
    print(json.dumps(result["counts"]), f"{result['seconds']:.1f} s")
    assert problems == []
    assert result["failures"] == [] and result["counts"].get("wrong", 0) == 0
    assert result["counts"].get("right", 0) > 0 and result["counts"].get("load 200", 0) > 0
    assert idle


def test_manager_keeps_registered_adapters_and_retires_unloaded_ones():
    """Without an engine: a registered adapter is rebuilt from what was read (its path is never
    opened), one removed while a request runs with it stays usable by that request only, and is
    forgotten once the request finished."""
    import types

    import numpy as np

    from jpaged.lora.manager import LoRAManager
    from jpaged.lora.peft import PeftAdapter
    from jpaged.lora.request import LoRARequest

    runner = types.SimpleNamespace(lora_linears={}, writes=[])
    runner.write_lora_slot = lambda slot, weights: runner.writes.append(slot)
    manager = LoRAManager({}, runner, max_loras=1, max_lora_rank=4, max_cpu_loras=1, dtype=np.float32)
    a, b = LoRARequest("a", 1, "/nonexistent/a"), LoRARequest("b", 2, "/nonexistent/b")
    manager.register(a, PeftAdapter(a.lora_path, 1, {}), {})
    manager.register(b, PeftAdapter(b.lora_path, 1, {}), {})  # a leaves the host LRU (max_cpu_loras=1)
    assert manager.slots({1: a}) == {1: 0}  # rebuilt from what was read: /nonexistent is never opened
    with pytest.raises(ValueError, match="already names"):
        manager.register(LoRARequest("c", 1, "/nonexistent/c"), PeftAdapter("c", 1, {}), {})
    running = types.SimpleNamespace(lora_request=a, finished=False)
    running.is_finished = lambda: running.finished
    assert manager.remove(1, [running, types.SimpleNamespace(lora_request=None)])
    with pytest.raises(ValueError, match="unloaded"):
        manager.add(a)  # a new request naming it
    assert manager.slots({2: b}) == {2: 0} and manager.slots({1: a}) == {1: 0}  # the running one still gets it
    running.finished = True
    manager.add(b)  # forgets a
    with pytest.raises(ValueError, match="unloaded"):
        manager.add(a)
    with pytest.raises(ValueError, match="removed"):
        manager.register(a, PeftAdapter(a.lora_path, 1, {}), {})  # ids are not reused
    assert manager.requests() == [b] and runner.writes == [0, 0, 0]
