"""Data-parallel serving (`--data-parallel-size 2`): replica processes behind one front end.

A 2-replica server of the tiny model (its own tiny LoRA adapter, written by PEFT) is checked
against a single engine's greedy outputs: completions, chat, streams, an adapter loaded at run
time, /metrics with vLLM's `engine` label, /kv per replica and /health per replica. Then one
replica is killed with SIGKILL while streams run: the stream it served ends with an error event,
the other finishes, /health names the replica within a second, the replica restarts, and the
server serves again; SIGTERM then exits 0 with no replica left. Offline, `LLM(data_parallel_size=2)`
returns what one engine returns, in input order. Routing rules themselves: test_dp_router.py.
"""

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import aiohttp
import pytest

import jpaged
from jpaged.config import EngineConfig
from jpaged.data_parallel.fleet import Fleet, replica_env
from jpaged.lora.request import LoRARequest
from test_server import Server

LIMITS = ["--max-num-seqs", "8", "--max-model-len", "128", "--max-num-batched-tokens", "64", "--enforce-eager"]
OFFLINE = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64, enforce_eager=True)
PROMPTS = [[5 + i, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21] for i in range(6)]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A rank-4 PEFT adapter over the tiny model's checkpoint (the server loads both)."""
    import peft
    import transformers

    from jpaged.models import tiny

    root = tmp_path_factory.mktemp("dp")
    config = tiny.tiny_config()
    base = transformers.LlamaForCausalLM(config)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
    lora.save_pretrained(root / "adapter")
    return str(root / "adapter")


@pytest.fixture(scope="module")
def reference(adapter):
    """One engine's greedy outputs: the base model and the adapter."""
    llm = jpaged.LLM("tiny", enable_lora=True, max_lora_rank=8, **OFFLINE)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    adapted = [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False,
                                                       lora_request=LoRARequest("a", 1, adapter))]
    return base, adapted


@pytest.fixture(scope="module")
def server():
    s = Server("--data-parallel-size", "2", "--enable-prefix-caching", "--enable-lora", "--max-lora-rank", "8",
               "--enable-lora-runtime-updates", "--enable-sleep-mode", *LIMITS)
    yield s
    if s.proc.poll() is None:
        s.stop()


async def _post(url, path, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as r:
            text = await r.text()
            return r.status, json.loads(text) if text.startswith("{") else text


async def _get(url, path):
    async with aiohttp.ClientSession() as session:
        async with session.get(url + path) as r:
            return r.status, await r.text()


async def _stream(url, body, started: asyncio.Event | None = None) -> list:
    """The stream's events (parsed), up to [DONE]; `started` is set at the first one."""
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if started is not None:
                        started.set()
    return events


def health(url) -> dict:
    status, text = asyncio.run(_get(url, "/health"))
    assert status == 200, text
    return json.loads(text)


def test_every_endpoint_answers_as_one_engine(server, reference, adapter):
    base, adapted = reference
    h = health(server.url)
    assert h["status"] == "ok" and not h["degraded"] and [r["rank"] for r in h["replicas"]] == [0, 1]
    assert all(r["state"] == "up" and r["pid"] > 0 for r in h["replicas"])

    async def completions(model="tiny"):
        bodies = [{"model": model, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                  for p in PROMPTS]
        return await asyncio.gather(*(_post(server.url, "/v1/completions", b) for b in bodies))

    answers = asyncio.run(completions())
    assert [status for status, _ in answers] == [200] * len(PROMPTS)
    assert [a["choices"][0]["text"] for _, a in answers] == base
    events = asyncio.run(_stream(server.url, {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True}))
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == base[0]
    status, chat = asyncio.run(_post(server.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))
    assert status == 200 and chat["usage"]["completion_tokens"] >= 1
    status, response = asyncio.run(_post(server.url, "/v1/responses", {"input": "Hi", "max_output_tokens": 4}))
    assert status == 200 and response["object"] == "response" and response["output"], response
    status, stored = asyncio.run(_get(server.url, f"/v1/responses/{response['id']}"))  # the front end's store
    assert status == 200 and json.loads(stored)["id"] == response["id"]
    status, tokens = asyncio.run(_post(server.url, "/tokenize", {"prompt": "Hi"}))
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) >= 2, tokens

    # An adapter loaded at run time is read by every replica, and answers as PEFT's through one engine.
    status, body = asyncio.run(_post(server.url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapter}))
    assert status == 200, body
    answers = asyncio.run(completions("a"))
    assert [a["choices"][0]["text"] for _, a in answers] == adapted
    status, error = asyncio.run(_post(server.url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/nope"}))
    assert status == 400 and error["error"]["param"] == "lora_path", error

    # Sleep and wake reach every replica.
    assert asyncio.run(_post(server.url, "/sleep?level=1", None))[0] == 200
    assert json.loads(asyncio.run(_get(server.url, "/is_sleeping"))[1]) == {"is_sleeping": True}
    status, error = asyncio.run(_post(server.url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2}))
    assert status == 400 and "asleep" in error["error"]["message"], error
    assert asyncio.run(_post(server.url, "/wake_up", None))[0] == 200

    # Both replicas served (the router spread 6 different prompts), each under its own label.
    _, text = asyncio.run(_get(server.url, "/metrics"))
    served = {}
    for rank in (0, 1):
        line = next(l for l in text.splitlines()
                    if l.startswith(f'jpaged:generation_tokens_total{{model_name="tiny",engine="{rank}"}}'))
        served[rank] = float(line.split()[-1])
    assert all(v > 0 for v in served.values()) and sum(served.values()) >= 12 * 13, served
    assert text.count("# TYPE jpaged:generation_tokens_total counter") == 1
    _, page = asyncio.run(_get(server.url, "/kv"))
    assert "replica 0" in page and "replica 1" in page


def test_a_killed_replica_is_reported_restarted_and_its_streams_end_with_an_error(server, reference):
    base, _ = reference
    pids = {r["rank"]: r["pid"] for r in health(server.url)["replicas"]}

    async def scenario():
        body = {"max_tokens": 100, "temperature": 0, "ignore_eos": True}
        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(_stream(server.url, {**body, "prompt": p}, e))
                   for p, e in zip(PROMPTS[:4], started)]
        await asyncio.gather(*(e.wait() for e in started))  # every stream has output: none can move
        os.kill(pids[1], signal.SIGSTOP)  # frozen mid-stream however fast the machine: its streams cannot end
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        while True:
            status, text = await _get(server.url, "/health")
            state = json.loads(text)
            if state["degraded"]:
                return time.monotonic() - killed, state, await asyncio.gather(*streams)
            await asyncio.sleep(0.05)

    seen_after, state, streams = asyncio.run(scenario())
    print(f"replica 1 reported down {seen_after:.2f} s after SIGKILL: {state}")
    assert state["down"] == [1] and state["status"] == "degraded"
    assert seen_after < 1.0
    errors = [s for s in streams if any("error" in e for e in s)]
    finished = [s for s in streams if s and s[-1].get("choices") and s[-1]["choices"][0]["finish_reason"] == "length"]
    assert errors and finished and len(errors) + len(finished) == len(streams), streams
    assert all("replica 1" in next(e for e in s if "error" in e)["error"]["message"] for s in errors)

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and health(server.url)["degraded"]:
        time.sleep(0.5)
    after = health(server.url)
    assert not after["degraded"] and after["replicas"][1]["pid"] != pids[1], after
    async def completions():
        return await asyncio.gather(*(_post(server.url, "/v1/completions", {
            "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}) for p in PROMPTS))

    answers = asyncio.run(completions())
    assert [a["choices"][0]["text"] for _, a in answers] == base


def test_with_no_replica_up_requests_get_503_with_retry_after(server, reference):
    """Both replicas killed: until one is back, requests are told to retry (503, Retry-After), not
    failed with a 500, and the server lives on."""
    base, _ = reference
    pids = [r["pid"] for r in health(server.url)["replicas"]]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    async def during_restart():
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(server.url + "/health") as r:
                    state = json.loads(await r.text())
                if state.get("down") == [0, 1]:
                    break
                await asyncio.sleep(0.02)
            async with session.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}) as r:
                return r.status, r.headers.get("Retry-After"), json.loads(await r.text()), state

    status, retry_after, body, state = asyncio.run(during_restart())
    print("during the restart:", state)
    assert status == 503 and retry_after is not None and int(retry_after) >= 1, (status, body)
    assert body["error"]["code"] == "no_replica_up" and body["error"]["type"] == "server_error"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status, text = asyncio.run(_get(server.url, "/health"))
        if status == 200 and not json.loads(text)["degraded"]:
            break
        time.sleep(0.5)
    assert server.proc.poll() is None and not health(server.url)["degraded"]
    status, answer = asyncio.run(_post(server.url, "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}))
    assert status == 200 and answer["choices"][0]["text"] == base[0]


def test_sigterm_stops_every_replica_and_exits_0(server):
    pids = [r["pid"] for r in health(server.url)["replicas"]]
    assert server.stop() == 0, "".join(server.log[-30:])
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # reaped by the server before it exited
            os.kill(pid, 0)


def test_offline_llm_spreads_prompts_and_keeps_their_order(reference):
    base, _ = reference
    import zmq

    from kv_event_consumers import llmd_positional
    from test_kv_events import _free_port

    def two_free_ports() -> int:  # replica r binds the endpoint's port + r
        import socket

        while True:
            port = _free_port()
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue

    context = zmq.Context.instance()
    for attempt in range(3):  # another process (a parallel test) may take a port between the check and the bind
        port = two_free_ports()
        subscribers = []
        for rank in (0, 1):  # vLLM's rule: replica r publishes on the endpoint's port + r
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port + rank}")
            subscribers.append(sub)
        try:
            llm = jpaged.LLM("tiny", data_parallel_size=2, dp_routing="round-robin", dp_restart=False,
                             enable_prefix_caching=True, kv_events_config={"enable_kv_cache_events": True,
                                                                           "endpoint": f"tcp://*:{port}"}, **OFFLINE)
            break
        except RuntimeError as e:
            for sub in subscribers:
                sub.close(linger=0)
            if "Address already in use" not in str(e) or attempt == 2:
                raise
    try:
        time.sleep(0.5)  # the subscriptions reach the publishers (ZMQ drops what is sent before)
        sp = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == base
        for rank, sub in enumerate(subscribers):
            assert sub.poll(5000), f"no KV events from replica {rank}"
            _, _, payload = sub.recv_multipart()
            batch = llmd_positional(payload)  # the default encoding, "array", as llm-d's KV-cache manager reads it
            assert batch.data_parallel_rank == rank and any(e["type"] == "BlockStored" for e in batch.events)
            sub.close(linger=0)
        per_replica = llm.llm_engine.replica_stats()
        assert all(s["num_compilations"] > 0 for s in per_replica)  # both ran steps
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([[1] * 200], sp, use_tqdm=False)
        assert [o.outputs[0].text for o in llm.generate(PROMPTS[:2], sp, use_tqdm=False)] == base[:2]
        # --no-dp-restart: a killed replica stays down, and the other one serves everything.
        fleet = llm.llm_engine.fleet
        os.kill(fleet.replicas[1].pid, signal.SIGKILL)
        assert fleet.wait_until(lambda: fleet.states[1] == "down", timeout=5)
        time.sleep(1)
        fleet.pump(timeout=0)
        state = fleet.health()
        assert state["down"] == [1] and state["replicas"][1]["last_exit"] == "killed by signal 9", state
        assert [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == base
    finally:
        llm.shutdown()


def test_a_replica_that_cannot_start_fails_the_start_up(tmp_path):
    with pytest.raises(RuntimeError, match="replica 0 failed to start.*nope"):
        Fleet(EngineConfig(model=str(tmp_path / "nope"), data_parallel_size=2)).start()


@pytest.mark.parametrize("field, value", [("data_parallel_size", 0), ("data_parallel_size", "2"),
                                          ("dp_routing", "random"), ("data_parallel_rank", -1)])
def test_bad_options_are_value_errors_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_bad_flags_fail_the_command_line():
    import subprocess
    import sys

    for flags in (["--data-parallel-size", "0"], ["--dp-routing", "random"], ["--data-parallel-size", "x"]):
        run = subprocess.run([sys.executable, "-m", "serving.cli", "serve", *flags], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert run.returncode != 0 and ("data-parallel-size" in run.stderr or "dp-routing" in run.stderr
                                        or "data_parallel_size" in run.stderr), (flags, run.stderr[-500:])


def test_each_replica_gets_its_own_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = EngineConfig(data_parallel_size=2, tensor_parallel_size=2)
    assert [replica_env(config, r)["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_env(config, 1)["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    config = EngineConfig(data_parallel_size=2, devices="7,6")
    assert replica_env(config, 1)["CUDA_VISIBLE_DEVICES"] == "6"


class _FakeReplica:
    """A replica process's stand-in for the fleet's bookkeeping: commands recorded, SIGKILLed."""

    def __init__(self, rank: int):
        self.rank, self.pid, self.sent, self.exitcode = rank, 1000 + rank, [], -9
        self.process = self

    def wait(self, timeout=None):
        return -9

    def send(self, command):
        self.sent.append(command)

    def kill(self):
        pass


def test_a_dead_replicas_unstarted_requests_move_and_started_ones_fail():
    from types import SimpleNamespace

    fleet = Fleet(EngineConfig(data_parallel_size=2, dp_restart=False, dp_routing="round-robin"))
    fleet.replicas, fleet.states = [_FakeReplica(0), _FakeReplica(1)], ["up", "up"]
    lost, answers = [], []
    fleet.on_lost = lambda ids, error: lost.append((ids, str(error)))
    fleet.on_call_done = lambda call_id, got: answers.append(got)
    params = jpaged.SamplingParams(max_tokens=4)
    ranks = {rid: fleet.submit(rid, [1, 2, 3], params) for rid in "abcd"}
    assert ranks == {"a": 0, "b": 1, "c": 0, "d": 1} and fleet.loads == [2, 2]
    call_id = fleet.call_all(len)
    fleet._on_message(fleet.replicas[0], ("result", call_id, None, 7))
    # b produced output (a client may have seen it); d did not.
    fleet._on_message(fleet.replicas[1], ("step", [SimpleNamespace(request_id="b", finished=False)], None, [], None))
    fleet._on_message(fleet.replicas[1], ("exit",))
    assert [ids for ids, _ in lost] == [["b"]] and "replica 1" in lost[0][1] and "signal 9" in lost[0][1]
    assert fleet.rank_of("d") == 0 and fleet.replicas[0].sent[-1][:2] == ("add", "d")
    assert fleet.rank_of("b") is None and fleet.loads == [3, 0]
    assert answers == [{0: (None, 7), 1: ("ReplicaDiedError", "replica 1 died: killed by signal 9")}]
    health = fleet.health()
    assert health["down"] == [1] and health["status"] == "degraded"
    assert health["replicas"][1]["last_exit"] == "killed by signal 9" and health["replicas"][1]["restarts"] == 0
    assert fleet.submit("e", [1, 2, 3], params) == 0  # only replica 0 takes requests now
    fleet._on_message(fleet.replicas[0], ("exit",))
    with pytest.raises(Exception, match="no replica can take the request"):
        fleet.submit("f", [1, 2, 3], params)


def test_a_replica_that_dies_while_restarting_is_restarted_again_with_backoff(monkeypatch):
    """Whatever state a replica dies in, a new one takes its rank: at once after serving, then
    after 1, 2, 4, ... s (scaled down here) while its restarts keep dying before they are ready."""
    from jpaged.data_parallel import fleet as fleet_module

    monkeypatch.setattr(fleet_module, "RESTART_BACKOFF_S", 0.05)
    fleet = Fleet(EngineConfig(data_parallel_size=2, dp_restart=True, dp_routing="round-robin"))
    fleet.replicas, fleet.states, fleet.started = [_FakeReplica(0), _FakeReplica(1)], ["up", "up"], True
    spawned = []

    def spawn(rank):
        fleet.states[rank], fleet.errors[rank] = "starting", None
        fleet.replicas[rank] = _FakeReplica(rank)
        spawned.append(time.monotonic())

    monkeypatch.setattr(fleet, "_spawn", spawn)
    fleet._on_message(fleet.replicas[1], ("exit",))  # died while up: restarted at once
    assert len(spawned) == 1 and fleet.states[1] == "starting" and fleet.restarts[1] == 1
    for expected_delay in (0.05, 0.1, 0.2):  # each restart dies while starting
        died = time.monotonic()
        fleet._on_message(fleet.replicas[1], ("exit",))
        assert fleet.states[1] == "restarting" and fleet.coming_back
        assert fleet.health()["status"] == "degraded" and fleet.health()["down"] == [1]
        fleet.wait_until(lambda n=len(spawned): len(spawned) > n, timeout=5)
        assert fleet.states[1] == "starting" and spawned[-1] - died >= expected_delay * 0.9
    fleet._on_message(fleet.replicas[1], ("ready", {"stats": {}}))
    assert fleet.states[1] == "up" and fleet.failures[1] == 0 and fleet.restarts[1] == 4
    fleet._on_message(fleet.replicas[1], ("exit",))  # up again: the next restart is immediate
    assert len(spawned) == 5 and fleet.states[1] == "starting"


def test_a_silent_replica_is_killed_and_its_queued_requests_move(monkeypatch):
    fleet = Fleet(EngineConfig(data_parallel_size=2, dp_restart=False, dp_routing="round-robin"))
    fleet.replicas, fleet.states, fleet.started = [_FakeReplica(0), _FakeReplica(1)], ["up", "up"], True
    killed = []
    for replica in fleet.replicas:
        replica.exitcode, replica.last_seen = None, time.monotonic()
        replica.kill = lambda r=replica: (killed.append(r.rank), fleet._on_message(r, ("exit",)))
    params = jpaged.SamplingParams(max_tokens=4)
    assert [fleet.submit(rid, [1, 2, 3], params) for rid in "ab"] == [0, 1]
    now = time.monotonic()
    fleet.check_heartbeats(now + fleet.heartbeat_timeout / 2)  # within the timeout: nothing
    fleet.pump(timeout=0.1)
    assert killed == []
    fleet.replicas[0].last_seen = now + fleet.heartbeat_timeout  # replica 0 keeps answering
    fleet.check_heartbeats(now + fleet.heartbeat_timeout + 1)
    fleet.pump(timeout=1)
    assert killed == [1] and "no heartbeat for" in fleet.health()["replicas"][1]["last_exit"]
    assert fleet.rank_of("b") == 0  # it had produced nothing: moved


def test_no_heartbeat_timeout_but_seconds():
    from jpaged.data_parallel.fleet import heartbeat_timeout

    assert heartbeat_timeout({}) == 30.0 and heartbeat_timeout({"JPAGED_DP_HEARTBEAT_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match="JPAGED_DP_HEARTBEAT_TIMEOUT"):
            heartbeat_timeout({"JPAGED_DP_HEARTBEAT_TIMEOUT": bad})


def test_a_stopped_replica_is_detected_killed_and_replaced(reference, monkeypatch):
    """SIGSTOP: the process lives, its pipe stays open, it answers nothing. Its heartbeats stop,
    so after the timeout the fleet kills it, moves its requests (none had output) to the other
    replica and starts a new one in its rank. Every request is answered, none hangs."""
    base, _ = reference
    monkeypatch.setenv("JPAGED_DP_HEARTBEAT_TIMEOUT", "3")
    llm = jpaged.LLM("tiny", data_parallel_size=2, dp_routing="round-robin", **OFFLINE)
    try:
        fleet = llm.llm_engine.fleet
        stopped = fleet.replicas[1].pid
        os.kill(stopped, signal.SIGSTOP)
        sp = jpaged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        start = time.monotonic()
        assert [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == base
        print(f"answered in {time.monotonic() - start:.1f} s with replica 1 stopped")
        state = fleet.health()["replicas"][1]
        assert state["pid"] != stopped and state["restarts"] == 1, state
        assert "no heartbeat for" in state["last_exit"], state
        assert fleet.wait_until(lambda: fleet.states[1] == "up", timeout=300), fleet.health()
    finally:
        llm.shutdown()
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGKILL)


def test_unstarted_requests_of_the_last_replica_are_told_to_retry(monkeypatch):
    """No replica left up but one coming back: a request that produced nothing gets
    NoReplicaUpError (the server's 503 with Retry-After), not a replica-died failure."""
    from jpaged.data_parallel.fleet import NoReplicaUpError, ReplicaDiedError

    fleet = Fleet(EngineConfig(data_parallel_size=2, dp_restart=True, dp_routing="round-robin"))
    fleet.replicas, fleet.states, fleet.started = [_FakeReplica(0), _FakeReplica(1)], ["up", "up"], True
    monkeypatch.setattr(fleet, "_spawn", lambda rank: fleet.states.__setitem__(rank, "starting"))
    lost = []
    fleet.on_lost = lambda ids, error: lost.append((ids, error))
    params = jpaged.SamplingParams(max_tokens=4)
    assert [fleet.submit(rid, [1, 2, 3], params) for rid in "ab"] == [0, 1]
    fleet._on_message(fleet.replicas[1], ("exit",))  # replica 0 is up: b moves there
    assert lost == [] and fleet.rank_of("b") == 0
    fleet._on_message(fleet.replicas[0], ("step", [type("Out", (), {"request_id": "a", "finished": False})()],
                                          None, [], None))  # a has produced output: it cannot be retried
    fleet._on_message(fleet.replicas[0], ("exit",))
    assert [(ids, type(e)) for ids, e in lost] == [(["a"], ReplicaDiedError), (["b"], NoReplicaUpError)]


_RELEASE, _REGISTERED = threading.Event(), []  # (the off-thread calls below travel pickled: module-level)


def _slow_read(engine):
    return _RELEASE.wait(10) and "weights"


def _register(engine, value):
    _REGISTERED.append(value)
    return 7


def _unreadable(engine):
    raise ValueError("not an adapter")


def _never_registered(engine, value):
    raise AssertionError("a refused read is not registered")


def test_an_off_thread_call_does_not_hold_up_the_replicas_steps():
    """A replica's loop keeps stepping while an adapter is read (OffThreadCall's background part
    in a worker thread); its registration and answer come after, between steps, in order."""
    import multiprocessing
    import types

    from jpaged.data_parallel.off_thread import OffThreadCall
    from jpaged.data_parallel.replica import _Loop

    class Engine:  # the loop's view of an engine: requests to step, stats (and what router_stats reads)
        steps = 0
        scheduler = types.SimpleNamespace(running=[], waiting=[], swapped=[])
        config = types.SimpleNamespace(enable_lora=False, max_loras=1)
        block_manager = types.SimpleNamespace(block_size=16)

        def has_unfinished_requests(self):
            return True

        def step(self):
            self.steps += 1
            time.sleep(0.001)
            return []

        def stats(self):
            return {}

        def stats_while_warming(self):
            return {}

    class Events:
        def take(self):
            return []

    engine = Engine()
    _RELEASE.clear()
    _REGISTERED.clear()
    commands_out, commands_in = multiprocessing.Pipe(duplex=False)
    messages_out, messages_in = multiprocessing.Pipe(duplex=False)
    loop = _Loop(engine, Events(), commands_out, messages_in)
    commands_in.send(("call", 1, OffThreadCall(_slow_read, _register)))
    commands_in.send(("call", 2, OffThreadCall(_unreadable, _never_registered)))
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 30
    while engine.steps <= 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.steps > 50 and _REGISTERED == []  # stepping on while the read waits
    _RELEASE.set()
    results = []
    deadline = time.monotonic() + 10
    while len(results) < 2 and time.monotonic() < deadline:
        if messages_out.poll(0.1):
            message = messages_out.recv()
            if message[0] == "result":
                results.append(message[1:])
    commands_in.send(("shutdown",))
    runner.join(10)
    assert results == [(1, None, 7), (2, "ValueError", "not an adapter")] and _REGISTERED == ["weights"]
