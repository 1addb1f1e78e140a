"""The background warm-up (jpaged/runner/warmup.py): the engine serves while it compiles, on the
shapes compiled so far, with the same outputs as a warm engine and no compile of its own; the
server's port opens before the warm-up ends (/health's progress, the warm-up gauge); `jpaged
warmup` fills the executable cache; a compile that fails leaves the server up, with a clear error
for the requests that need it; SIGTERM mid-warm-up exits 0 and leaves no partial cache file.
Each test starts cold (its own cache directory): that is what it is about."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import aiohttp
import jax
import numpy as np
import pytest

import jpaged
from jpaged.runner.executable_cache import MAGIC
from jpaged.runner import warmup
from jpaged.runner.warmup import FAIL_ENV

LIMITS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
FLAGS = ["--max-num-seqs", "4", "--max-model-len", "64", "--max-num-batched-tokens", "64"]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def prompts_and_params(rng):
    """A prompt longer than the first buckets (it must be chunked while they are all there is), a
    short one, greedy and seeded sampling."""
    prompts = [rng.integers(1, 256, size=40).tolist(), rng.integers(1, 256, size=3).tolist()]
    params = [jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              jpaged.SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)]
    return prompts, params


def test_generate_while_compiling_matches_warm_engine_and_compiles_nothing_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng()
    prompts, params = prompts_and_params(rng)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(threading.current_thread().name)

    switch_interval = sys.getswitchinterval()
    llm = jpaged.LLM("tiny", **LIMITS)
    runner = llm.llm_engine.runner
    assert not llm.llm_engine.warmup_progress()["ready"]  # returned before the warm-up ended
    limits = []
    execute = runner.execute
    runner.execute = lambda plan, *a, **k: limits.append((runner.token_limit, plan.num_batched_tokens)) \
        or execute(plan, *a, **k)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        warming = llm.generate(prompts, params, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    # The first steps ran on the first buckets: capped by the scheduler, the long prompt chunked.
    steps = [(limit, tokens) for limit, tokens in limits if tokens]
    assert steps[0][0] is not None and steps[0][0] < 40, limits
    assert all(limit is None or tokens <= limit for limit, tokens in limits), limits
    # Every compile meanwhile was the background's: serving compiled nothing, nor waited for one.
    assert compiles and all(name.startswith("jpaged-") for name in compiles), compiles
    # Once steps could run, XLA's unnamed compile threads were given the background's nice value.
    reniced = dict(runner.warmup._reniced or {})
    if sys.platform == "linux" and not runner.warmup.done.is_set() and \
            os.getpriority(os.PRIO_PROCESS, 0) < warmup.BACKGROUND_NICE:  # (not when the tests run niced)
        assert reniced, "no XLA thread reniced while serving"
        assert all(_nice(tid) in (None, warmup.BACKGROUND_NICE) for tid in reniced), reniced
    # While warming, Python switched threads more often (warmup.SWITCH_INTERVAL_S); set back after.
    current = sys.getswitchinterval()
    if not runner.warmup.done.is_set():
        assert current <= warmup.SWITCH_INTERVAL_S
    assert llm.wait_for_warmup(timeout=600)
    runner.warmup._thread.join(60)
    if not warmup._switch["warming"]:  # (another engine's warm-up in this process keeps it lowered)
        assert sys.getswitchinterval() == switch_interval
    if os.geteuid() == 0:  # given back (a lower nice value takes privileges)
        assert all(_nice(tid) in (None, former) for tid, former in reniced.items())
    assert llm.llm_engine.warmup_progress() == {"ready": True, "compiled": runner.num_compilations,
                                                 "total": len(list(runner.buckets.keys()))}
    # A fully warmed engine (everything loaded from the cache at construction) gives the same tokens.
    warm = jpaged.LLM("tiny", background_warmup=False, **LIMITS)
    assert warm.llm_engine.runner.executable_cache.hits == warm.llm_engine.runner.num_compilations
    expected = warm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warming] == [o.outputs[0].token_ids for o in expected]


def test_overlapping_warm_ups_restore_the_switch_interval_once_the_last_ends():
    """warmup._fast_switching: the first warm-up in lowers Python's switch interval, the last one
    out restores the value from before the first (not the lowered one it found)."""
    former = sys.getswitchinterval()
    if warmup._switch["warming"]:
        pytest.skip("another engine's warm-up is running in this process")
    try:
        sys.setswitchinterval(0.004)
        warmup._fast_switching(True)
        warmup._fast_switching(True)  # a second engine's, while the first runs
        assert sys.getswitchinterval() == warmup.SWITCH_INTERVAL_S
        warmup._fast_switching(False)
        assert sys.getswitchinterval() == warmup.SWITCH_INTERVAL_S  # the other still warms
        warmup._fast_switching(False)
        assert sys.getswitchinterval() == 0.004
    finally:
        sys.setswitchinterval(former)


def _nice(tid):
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # the thread ended
        return None


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values: Linux")
def test_renice_native_threads_leaves_python_and_step_threads():
    """Only XLA's unnamed native threads are reniced (Python's threads and XLA's named tf_* pools,
    which run the steps, keep theirs), and the former values come back."""
    jax.jit(lambda x: x + 1)(np.ones(3))  # XLA's threads exist
    python = {t.native_id for t in threading.enumerate()}
    nice = os.getpriority(os.PRIO_PROCESS, 0) + 1  # one above the process's own (the tests may run niced)
    if nice > 19:
        pytest.skip("the process already runs at the lowest priority")
    former = warmup._renice_native_threads(nice=nice)
    try:
        print("reniced:", former)
        assert former and not set(former) & python
        for tid in former:
            assert open(f"/proc/self/task/{tid}/comm").read().strip() == open("/proc/self/comm").read().strip()
            assert _nice(tid) in (None, nice)
        named = [int(t) for t in os.listdir("/proc/self/task")
                 if open(f"/proc/self/task/{t}/comm").read().startswith("tf_")]
        assert not set(named) & set(former)
    finally:
        warmup._renice_native_threads(saved=former)
    if os.geteuid() == 0:  # giving a lower nice value back takes privileges (CAP_SYS_NICE)
        assert all(_nice(tid) in (None, value) for tid, value in former.items())


class Server:
    """`jpaged serve` in a subprocess: the URL from its "serving" line, its log kept."""

    def __init__(self, cache_dir, *flags, env=None):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JPAGED_CACHE_DIR": str(cache_dir), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", "--model", "tiny", "--port", "0",
                                      *FLAGS, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env)
        self.log, self.url = [], None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("jpaged: serving"):
                self.url = line.split(" at ")[1].split("/v1")[0]
                break
        assert self.url, "".join(self.log)
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def get(self, path):
        return asyncio.run(_request("get", self.url + path))

    def post(self, path, body):
        return asyncio.run(_request("post", self.url + path, body))

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(120)


async def _request(method, url, body=None):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, json=body) as r:
            return r.status, await r.text()


def health(server) -> dict:
    status, text = server.get("/health")
    assert status == 200, text
    return json.loads(text)


def warmup_gauge(server) -> float:
    status, text = server.get("/metrics")
    return float(next(line for line in text.splitlines()
                      if line.startswith("jpaged:warmup_executables_remaining")).rsplit(" ", 1)[1])


def assert_whole_cache_files(cache_dir):
    """No temporary file left, and every executable file whole (its header's lengths add up)."""
    names = os.listdir(cache_dir)
    assert not [n for n in names if n.startswith(".tmp")], names
    for name in names:
        if name.endswith(".bin"):
            data = open(os.path.join(cache_dir, name), "rb").read()
            key_len, payload_len = (int.from_bytes(data[len(MAGIC) + 8 * i:len(MAGIC) + 8 * (i + 1)], "big")
                                    for i in range(2))
            assert data.startswith(MAGIC) and len(data) == len(MAGIC) + 16 + key_len + 32 + payload_len, name


def test_server_serves_while_compiling_a_failed_shape_errors_sigterm_exits_0(tmp_path):
    """The port opens before the warm-up ends; a request is served meanwhile, as a warm engine
    serves it; the block copy's compile is made to fail: a request that forks (copy-on-write)
    gets that error, the server stays up and serves the others; SIGTERM mid-warm-up: status 0
    and no partial cache file."""
    rng = np.random.default_rng()
    prompts, params = prompts_and_params(rng)
    server = Server(tmp_path, env={FAIL_ENV: "('copy_blocks'"})
    try:
        first = health(server)
        assert first["status"] == "ok" and first["ready"] is False and first["compiled"] < first["total"], first
        assert warmup_gauge(server) > 0
        status, text = server.post("/v1/completions", {"model": "tiny", "prompt": prompts[0], "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True})
        assert status == 200, text
        served = json.loads(text)["choices"][0]["text"]
        # Two samples of one prompt share its last block until the first token: a block copy.
        status, text = server.post("/v1/completions", {"model": "tiny", "prompt": prompts[1], "max_tokens": 4,
                                                       "n": 2, "temperature": 1.0, "seed": 1})
        assert status == 500 and "failed to compile" in json.loads(text)["error"]["message"], text
        status, text = server.post("/v1/completions", {"model": "tiny", "prompt": prompts[1], "max_tokens": 4})
        assert status == 200, text  # still serving
        progress = health(server)
        assert progress["failed"] == 1 and progress["ready"] is False, progress
        mid_warm_up = progress["compiled"] + progress["failed"] < progress["total"]
        assert server.stop() == 0, "".join(server.log)[-3000:]
    finally:
        server.proc.kill()
    log = "".join(server.log)
    assert "compiling step shape ('copy_blocks', 32) failed: RuntimeError('injected compile failure" in log, log[-3000:]
    assert "Traceback (most recent call last)" in log  # the failure's own, logged once
    assert_whole_cache_files(tmp_path)
    print("SIGTERM landed mid-warm-up:", mid_warm_up)
    # The text the server produced while compiling is a warm engine's.
    warm = jpaged.LLM("tiny", background_warmup=False, enforce_eager=True, **LIMITS)
    expected = warm.generate([prompts[0]], params[0], use_tqdm=False)[0].outputs[0].text
    assert served == expected


def test_jpaged_warmup_fills_the_cache_and_a_server_loads_it_all(tmp_path):
    done = subprocess.run([sys.executable, "-m", "serving.cli", "warmup", "--model", "tiny", *FLAGS],
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "JPAGED_CACHE_DIR": str(tmp_path)},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "(0 already there)" in done.stdout, done.stdout[-2000:]
    files = [n for n in os.listdir(tmp_path) if n.endswith(".bin")]
    assert_whole_cache_files(tmp_path)
    server = Server(tmp_path)
    try:
        while not (progress := health(server))["ready"]:
            time.sleep(0.2)
        assert progress["compiled"] == progress["total"] == len(files), (progress, files)
        assert warmup_gauge(server) == 0
        status, text = server.post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 200, text
        assert server.stop() == 0
    finally:
        server.proc.kill()
    log = "".join(server.log)
    assert f"({len(files)} loaded from the executable cache)" in log, log[-3000:]
    # Data parallelism: /health sums the replicas' progress, which idle replicas report as it
    # goes (no request is sent before "ready").
    server = Server(tmp_path, "--data-parallel-size", "2")
    try:
        seen = [health(server)]
        while not seen[-1]["ready"]:
            time.sleep(0.2)
            seen.append(health(server))
        print("data-parallel progress:", [(h["compiled"], h["total"]) for h in seen[::max(1, len(seen) // 8)]])
        assert seen[-1]["compiled"] == seen[-1]["total"] == 2 * len(files), seen[-1]
        assert all(h["compiled"] <= h["total"] and not h["degraded"] for h in seen), seen
        assert server.stop() == 0
    finally:
        server.proc.kill()
