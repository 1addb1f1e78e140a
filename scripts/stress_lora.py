"""LoRA attacks against a running `jpaged serve --enable-lora --enable-lora-runtime-updates` (issue 38).

  churn    many clients load and unload adapters (names mapped to adapter directories) while
           streams ask for them, greedy; every 200 stream's text must equal what its adapter
           gives alone (found first, one adapter at a time). Any stream answered by another
           adapter, any 5xx or error event mid-stream, fails. A burst of concurrent loads of
           different names must all succeed.
  files    hostile adapter directories (a FIFO, /dev/zero, JSON nested 100,000 deep, NaN or huge
           tensors, bad alphas and field types, int8 tensors, missing paths): each must be a 400
           with an OpenAI error, fast, while /health is polled and a victim stream runs (its
           largest gap between two chunks is reported).

    python scripts/stress_lora.py --url http://127.0.0.1:8000 --adapters A_DIR B_DIR C_DIR \
        --streams 5000 --hostile-dir DIR_UNDER_ALLOWED_LORA_PATHS
"""

import argparse
import asyncio
import collections
import json
import os
import random
import time

import aiohttp
import numpy as np

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # token ids: any vocabulary


async def _post(session, url, path, body, headers=None):
    async with session.post(url + path, json=body, headers=headers) as r:
        return r.status, await r.text()


async def complete(session, url, model, max_tokens, headers=None, stream=True, started=None):
    """(status, text, error event seen): one greedy completion of PROMPT (`started`, an
    asyncio.Event, is set at its first streamed text)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200 or not stream:
            payload = await r.text()
            text = json.loads(payload)["choices"][0]["text"] if r.status == 200 else payload
            return r.status, text, False
        text, error = [], False
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = True
            else:
                text.append(event["choices"][0]["text"])
                if started is not None and text[-1]:
                    started.set()
        return 200, "".join(text), error


async def expected_texts(session, url, adapters, max_tokens, headers=None) -> dict[str, str]:
    """Each adapter directory's greedy text, loaded alone under a fresh name, then unloaded."""
    out = {}
    for i, path in enumerate(adapters):
        name = f"reference-{i}-{random.getrandbits(32):x}"
        status, text = await _post(session, url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                   headers)
        assert status == 200, (path, status, text)
        status, out[path], _ = await complete(session, url, name, max_tokens, headers, stream=False)
        assert status == 200, (status, out[path])
        await _post(session, url, "/v1/unload_lora_adapter", {"lora_name": name}, headers)
    return out


async def burst(session, url, adapters, expected, n=8, max_tokens=8, headers=None) -> list[str]:
    """n concurrent loads of different names: all must succeed and answer with their adapter."""
    tag = f"{random.getrandbits(32):x}"
    names = {f"burst-{tag}-{i}": adapters[i % len(adapters)] for i in range(n)}
    loads = await asyncio.gather(*[_post(session, url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                         headers) for name, path in names.items()])
    problems = [f"load {name}: {status} {text[:200]}" for (name, _), (status, text) in zip(names.items(), loads)
                if status != 200]
    for name, path in names.items():
        status, text, error = await complete(session, url, name, max_tokens, headers)
        if status != 200 or error or text != expected[path]:
            problems.append(f"{name} ({os.path.basename(path)}): {status} {text!r}, expected {expected[path]!r}")
        await _post(session, url, "/v1/unload_lora_adapter", {"lora_name": name}, headers)
    return problems


async def churn(session, url, adapters, expected, *, streams=5000, names=8, loaders=12, clients=16, max_tokens=8,
                seed=0, headers=None) -> dict:
    """Loads and unloads from `loaders` clients while `clients` clients run streams until `streams`
    were answered (each checked against its adapter alone)."""
    rng = random.Random(seed)
    tag = f"{rng.getrandbits(32):x}"
    path_of = {f"churn-{tag}-{i}": adapters[i % len(adapters)] for i in range(names)}
    counts: collections.Counter = collections.Counter()
    wrong: list = []
    left = [streams]
    done = asyncio.Event()

    async def loader(r):
        """Loads a name, holds it a moment, unloads it (or another client's name was loaded first)."""
        while not done.is_set():
            name = r.choice(sorted(path_of))
            for path, body, hold in (("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path_of[name]}, 0.5),
                                     ("/v1/unload_lora_adapter", {"lora_name": name}, 0.05)):
                status, text = await _post(session, url, path, body, headers)
                counts[f"{path.split('_')[0][4:]} {status}"] += 1
                if status >= 500 or (status == 400 and "already been loaded" not in text):
                    wrong.append(("loader", name, status, text[:200]))
                await asyncio.sleep(r.uniform(0, hold))

    async def client(r):
        """Streams until `streams` were answered (a 404 or 400, the name not loaded now, counts not)."""
        while left[0] > 0:
            name = r.choice(sorted(path_of))
            status, text, error = await complete(session, url, name, max_tokens, headers)
            counts[f"stream {status}"] += 1
            if status != 200:
                await asyncio.sleep(0.02)
            if status == 200:
                left[0] -= 1
                if error or text != expected[path_of[name]]:
                    counts["wrong"] += 1
                    wrong.append((name, os.path.basename(path_of[name]), text, "error event" if error else ""))
                else:
                    counts["right"] += 1
            elif status >= 500:
                wrong.append((name, status, text[:200]))
        return None

    start = time.monotonic()
    loader_tasks = [asyncio.create_task(loader(random.Random(rng.random()))) for _ in range(loaders)]
    await asyncio.gather(*[client(random.Random(rng.random())) for _ in range(clients)])
    done.set()
    await asyncio.gather(*loader_tasks)
    for name in path_of:  # leave nothing loaded
        await _post(session, url, "/v1/unload_lora_adapter", {"lora_name": name}, headers)
    return {"seconds": time.monotonic() - start, "counts": dict(sorted(counts.items())), "failures": wrong}


# ---------------------------------------------------------------------- hostile adapter files
def make_hostile_adapters(root: str, valid: str) -> dict[str, str]:
    """Hostile adapter directories under `root`, built from the valid adapter `valid`:
    {case: directory}. Each must be refused with a 400."""
    import safetensors.numpy

    config = json.load(open(os.path.join(valid, "adapter_config.json")))
    tensors = safetensors.numpy.load_file(os.path.join(valid, "adapter_model.safetensors"))
    cases = {}

    def adapter(case, config=config, tensors=tensors, config_text=None):
        directory = os.path.join(root, case)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "adapter_config.json"), "w") as f:
            f.write(config_text if config_text is not None else json.dumps(config))
        if tensors is not None:
            safetensors.numpy.save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
        cases[case] = directory
        return directory

    def replace(directory, file, make):
        os.remove(os.path.join(directory, file)) if os.path.exists(os.path.join(directory, file)) else None
        make(os.path.join(directory, file))

    replace(adapter("fifo-safetensors"), "adapter_model.safetensors", os.mkfifo)
    replace(adapter("fifo-config"), "adapter_config.json", os.mkfifo)
    replace(adapter("dev-zero-config"), "adapter_config.json", lambda p: os.symlink("/dev/zero", p))
    replace(adapter("dev-zero-safetensors"), "adapter_model.safetensors", lambda p: os.symlink("/dev/zero", p))
    adapter("deep-json", config_text='{"a": ' * 100_000 + "1" + "}" * 100_000)
    adapter("huge-config", config_text=json.dumps({**config, "pad": "x" * (8 << 20)}))
    first = sorted(tensors)[0]
    adapter("nan-tensors", tensors={k: np.full_like(v, np.nan) for k, v in tensors.items()})
    adapter("inf-tensor", tensors={**tensors, first: np.full_like(tensors[first], np.inf)})
    adapter("1e38-tensor", tensors={**tensors, first: np.full_like(tensors[first], 1e38)})
    adapter("int8-tensors", tensors={k: np.ones(v.shape, np.int8) for k, v in tensors.items()})
    for case, change in [("alpha-1e308", {"lora_alpha": 1e308}), ("alpha-0", {"lora_alpha": 0}),
                         ("alpha-negative", {"lora_alpha": -8}), ("target-modules-5", {"target_modules": 5}),
                         ("use-rslora-yes", {"use_rslora": "yes"}), ("r-string", {"r": "4"})]:
        adapter(case, config={**config, **change})
    cases["missing"] = os.path.join(root, "does-not-exist")
    cases["a-file"] = os.path.join(cases["nan-tensors"], "adapter_config.json")
    return cases


async def hostile_files(session, url, cases: dict[str, str], *, victim_tokens=100, headers=None) -> dict:
    """Each case's load (status, seconds, message) while a victim stream and /health polls run."""
    health: list[float] = []
    gaps: list[float] = []
    results = {}
    stop = asyncio.Event()

    async def poll():
        while not stop.is_set():
            start = time.monotonic()
            async with session.get(url + "/health") as r:
                health.append(time.monotonic() - start if r.status == 200 else float("inf"))
            await asyncio.sleep(0.05)

    async def victim():
        body = {"prompt": PROMPT, "max_tokens": victim_tokens, "ignore_eos": True, "stream": True}
        chunks, last = 0, time.monotonic()
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    now = time.monotonic()
                    if chunks:
                        gaps.append(now - last)
                    chunks, last = chunks + 1, now
        return chunks

    poller, stream = asyncio.create_task(poll()), asyncio.create_task(victim())
    await asyncio.sleep(0.5)  # the victim is streaming
    for case, path in cases.items():
        start = time.monotonic()
        status, text = await _post(session, url, "/v1/load_lora_adapter", {"lora_name": f"hostile-{case}",
                                                                             "lora_path": path}, headers)
        seconds = time.monotonic() - start
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text[:200]
        results[case] = (status, seconds, message)
        if status == 200:  # a load that should have failed: leave the server as it was
            await _post(session, url, "/v1/unload_lora_adapter", {"lora_name": f"hostile-{case}"}, headers)
    chunks = await stream
    stop.set()
    await poller
    return {"cases": results, "victim_chunks": chunks, "victim_largest_gap_s": max(gaps, default=0.0),
            "health_answers": len(health), "health_slowest_s": max(health, default=0.0)}


async def idle(session, url, timeout=60.0) -> bool:
    """Nothing running or waiting and no KV block held (no leaked block)."""
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(url + "/metrics") as r:
            values = {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
                      for line in (await r.text()).splitlines() if line and not line.startswith("#")}
        if all(values[f"jpaged:{k}"] == 0 for k in ("num_requests_running", "num_requests_waiting",
                                                   "gpu_cache_usage_perc")):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)


async def main(args) -> int:
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print("seed", seed)
    random.seed(seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    failed = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        expected = await expected_texts(session, args.url, args.adapters, args.max_tokens, headers)
        if len(set(expected.values())) < len(expected):
            print("WARNING: two adapters give the same text; a wrong adapter could go unseen", expected)
        problems = await burst(session, args.url, args.adapters, expected, max_tokens=args.max_tokens, headers=headers)
        print(f"burst of 8 concurrent loads: {len(problems)} problems", *problems[:5], sep="\n  ")
        result = await churn(session, args.url, args.adapters, expected, streams=args.streams, names=args.names,
                             loaders=args.loaders, clients=args.clients, max_tokens=args.max_tokens, seed=seed,
                             headers=headers)
        counts = result["counts"]
        print(f"churn: {args.streams} answered streams from {args.clients} clients, {args.loaders} loaders over "
              f"{args.names} names in {result['seconds']:.1f} s")
        print("  ", counts)
        print(f"  wrong-adapter answers: {counts.get('wrong', 0)}; failures: {len(result['failures'])}")
        for failure in sorted(result["failures"], key=lambda f: f[0] == "loader")[:10]:  # wrong answers first
            print("  FAILURE:", failure)
        failed |= bool(problems or result["failures"])
        if args.hostile_dir:
            cases = make_hostile_adapters(args.hostile_dir, args.adapters[0])
            report = await hostile_files(session, args.url, cases, headers=headers)
            for case, (status, seconds, message) in report["cases"].items():
                print(f"  {case:22s} {status} in {seconds * 1e3:7.1f} ms: {message[:110]}")
                failed |= status != 400
            print(f"victim stream: {report['victim_chunks']} chunks, largest gap "
                  f"{report['victim_largest_gap_s'] * 1e3:.0f} ms; /health: {report['health_answers']} answers, "
                  f"slowest {report['health_slowest_s'] * 1e3:.0f} ms")
        clean = await idle(session, args.url)
        print("engine idle with no KV block held:", clean)
        failed |= not clean
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--adapters", nargs="+", required=True, help="PEFT adapter directories the server may read")
    parser.add_argument("--streams", type=int, default=5000, help="answered (200) streams, each checked")
    parser.add_argument("--names", type=int, default=8, help="adapter names churned (name i -> adapter i %% n)")
    parser.add_argument("--loaders", type=int, default=12, help="clients loading and unloading")
    parser.add_argument("--clients", type=int, default=16, help="clients running streams")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--hostile-dir", default=None, help="where to build hostile adapters (under the server's "
                        "--allowed-lora-paths); omitted: no file attacks")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=None)
    raise SystemExit(asyncio.run(main(parser.parse_args())))
