"""jpaged replicas as a Ray Serve application (jpaged.ray:build_app), on a local Ray cluster that
this module starts (loopback, no dashboard) and stops.

Two applications of the tiny model, two replicas each, deployed once: "prefix" (the default
router, at /) and "rr" (round-robin, at /rr). Checked: the openai SDK's completions, chat,
streams and Responses against one engine's greedy outputs, the 4xx error body, /health and
/metrics per replica; on a shared-prefix workload the prefix router's hit rate (the replicas'
own counters) beats round-robin's; a replica killed with SIGKILL is restarted by Ray and the
requests sent after the kill succeed. build_app's bad args: a ValueError naming the key, with
no cluster. Ray is in the test extra: these tests fail, not skip, without it.
"""

import json
import os
import re
import signal
import socket
import time

import aiohttp
import asyncio
import openai
import pytest
import ray
import yaml
from ray import serve

import jpaged
from jpaged.ray import build_app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Pools (blocks of 16) that hold the workload's 6 prefixes (5 blocks each): what routing changes is
# how many replicas compute each prefix once (round-robin: both; prefix routing: one), not evictions
# (those depend on the order requests arrive in, which two clients do not fix).
ARGS = {"model": "tiny", "num_replicas": 2, "enable_prefix_caching": True, "max_model_len": 128,
        "max_num_seqs": 8, "max_num_batched_tokens": 128, "enforce_eager": True, "num_gpu_blocks_override": 64,
        "disable_log_requests": True, "disable_log_stats": True, "health_check_period_s": 1,
        "ray_actor_options": {"num_cpus": 1}}
PROMPTS = [[5 + i, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21] for i in range(3)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    port = _free_port()
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([
            serve.RunTarget(build_app(ARGS), name="prefix", route_prefix="/"),
            serve.RunTarget(build_app({**ARGS, "request_router": "round-robin"}), name="rr", route_prefix="/rr")])
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    llm = jpaged.LLM("tiny", max_model_len=128, enforce_eager=True)
    sp = jpaged.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def test_bad_args_fail_build_app_naming_the_key():
    for args, named in [({"model": "tiny", "max_model_len": "many"}, "--max-model-len"),
                        ({"model": "tiny", "max_modle_len": 64}, "max_model_len"),
                        ({"model": "tiny", "block_size": 7}, "--block-size"),
                        ({"model": "tiny", "num_replicas": 0}, "num_replicas"),
                        ({"model": "tiny", "num_replicas": 2, "autoscaling_config": {"max_replicas": 2}},
                         "autoscaling_config"),
                        ({"model": "tiny", "port": 8000}, "port"),
                        ({"model": "tiny", "request_router": "fastest"}, "request_router"),
                        ({"model": "tiny", "placement_group_bundles": "[{}]"}, "placement_group_bundles"),
                        ({"max_model_len": 64}, "model")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            build_app(args)


def test_serve_deploy_config_builds():
    """The config-file form (`serve deploy`, README): its import path and args build the app."""
    from ray._common.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    text = """
applications:
  - name: jpaged
    route_prefix: /
    import_path: jpaged.ray:build_app
    args:
      model: tiny
      num_replicas: 2
      enable_prefix_caching: true
      max_model_len: 2048
      ray_actor_options: {num_gpus: 1}
"""
    schema = ServeDeploySchema.model_validate(yaml.safe_load(text))
    app = schema.applications[0]
    built = import_attr(app.import_path)(app.args)
    assert isinstance(built, serve.Application)
    replica = built._bound_deployment.init_args[0]._bound_deployment  # OpenAIIngress.bind(llm_server, ...)
    assert replica.name == "LLMServer" and replica.num_replicas == 2
    assert replica.ray_actor_options["num_gpus"] == 1
    assert built._bound_deployment.init_args[1].max_model_len == 2048


def test_openai_sdk(cluster, reference):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0)
    for prompt, expected in zip(PROMPTS, reference):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == expected
    stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == reference[1]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0)
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert chat.usage.completion_tokens == 6
    response = client.responses.create(model="tiny", input="hello", max_output_tokens=6, temperature=0)
    assert response.status in ("completed", "incomplete") and response.output_text
    events = [e.type for e in client.responses.create(model="tiny", input="hello", max_output_tokens=6,
                                                      temperature=0, stream=True)]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    with pytest.raises(openai.BadRequestError) as error:  # the same 4xx body as `jpaged serve`
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=-1)
    assert error.value.body["param"] == "max_tokens" and error.value.body["type"] == "invalid_request_error"


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as r:
            return r.status, await r.text()


def test_health_and_metrics_per_replica(cluster):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0)
    for i in range(4):
        client.completions.create(model="tiny", prompt=[40 + i] * 20, max_tokens=2)
    deadline = time.monotonic() + 30
    while True:  # the router learns of both replicas' reports within routing_stats_period_s
        status, body = asyncio.run(_get(cluster + "/health"))
        health = json.loads(body)
        if len(health["replicas"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200 and health["status"] == "ok"
    assert [r["state"] for r in health["replicas"]] == ["up", "up"] and all(r["pid"] for r in health["replicas"])
    status, text = asyncio.run(_get(cluster + "/metrics"))
    engines = set(re.findall(r'^jpaged:num_requests_running\{model_name="tiny",engine="([^"]+)"\}', text, re.M))
    assert status == 200 and engines == {r["replica"] for r in health["replicas"]}


async def _hit_rate(url: str, prompts: list[list[int]]) -> float:
    """Prefix-cache hits / queries (tokens) over the replicas' counters, sending `prompts` one by one."""
    pattern = r'^jpaged:prefix_cache_(hits|queries)_total\{model_name="tiny",engine="([^"]+)"\} (\S+)$'

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def counters():
            async with session.get(url + "/metrics") as r:
                found = re.findall(pattern, await r.text(), re.M)
            return {kind: sum(float(v) for k, _, v in found if k == kind) for kind in ("hits", "queries")}

        async def send(batch):
            for prompt in batch:
                async with session.post(url + "/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()

        # One client: the router's load balancing (which may override affinity under concurrent
        # load, as on a busy CI machine: prefix 0.558 vs round-robin 0.539 once) stays out of it.
        before = await counters()
        await send(prompts)
        after = await counters()
    return (after["hits"] - before["hits"]) / (after["queries"] - before["queries"])


def test_prefix_routing_beats_round_robin(cluster):
    import numpy as np

    rng = np.random.default_rng(int(os.environ.get("JPAGED_TEST_SEED", "0")))

    def prompts():  # 10 prefixes of 5 blocks, 3 prompts each, shuffled; each router gets its own
        prefixes = [rng.integers(3, 259, 80).tolist() for _ in range(10)]
        out = [p + rng.integers(3, 259, 8).tolist() for p in prefixes for _ in range(3)]
        return [out[i] for i in rng.permutation(len(out))]

    # A router that keeps a prefix on one replica misses once per prefix (hit rate up to 2/3); round
    # robin sends the 3 prompts of a prefix to both replicas, missing once on each (about 1/3 to 1/2).
    # (With 5 prompts of 6 prefixes, and one set of prompts for both, the gap was 0.09-0.16 run to
    # run, a flaky margin for 0.1.)
    prefix, rr = asyncio.run(_hit_rate(cluster, prompts())), asyncio.run(_hit_rate(cluster + "/rr", prompts()))
    print(f"hit rate: prefix {prefix:.3f}, round-robin {rr:.3f}")
    assert prefix > rr + 0.1


async def _streams_across_a_kill(url: str, pid: int) -> list[tuple[bool, bool, int]]:
    """Two long streams (round-robin: one per replica); SIGKILL `pid` once both have output.
    Each stream's (ended with [DONE], had an error event, finished with its 100 tokens)."""
    started = [asyncio.Event(), asyncio.Event()]

    async def stream(session, i):
        done = error = chunks = False  # chunks: finished with finish_reason "length"
        async with session.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS[i], "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    error = error or "error" in event
                    chunks = chunks or any(c.get("finish_reason") == "length" for c in event.get("choices", ()))
                    started[i].set()
        started[i].set()
        return done, error, chunks

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
        tasks = [asyncio.create_task(stream(session, i)) for i in range(2)]
        await asyncio.gather(*(e.wait() for e in started))
        os.kill(pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def test_killed_replica_restarts(cluster):
    """SIGKILL one replica of "rr" while two streams run: the stream it served ends with an error
    event, the other finishes, nothing hangs; Ray starts another replica; requests after the kill
    all succeed."""
    url = cluster + "/rr"
    health = json.loads(asyncio.run(_get(url + "/health"))[1])
    victim = health["replicas"][0]
    results = asyncio.run(_streams_across_a_kill(url, victim["pid"]))
    assert all(done for done, _, _ in results)  # both ended: [DONE] after the error event too
    assert sorted(error for _, error, _ in results) == [False, True], results
    assert any(not error and finished for _, error, finished in results), results
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    for i in range(6):  # the dead replica's turns go to the other (a replica that dies unstarted: retried)
        assert client.completions.create(model="tiny", prompt=PROMPTS[i % 3], max_tokens=4).usage.completion_tokens == 4
    deadline = time.monotonic() + 120
    while True:
        health = json.loads(asyncio.run(_get(url + "/health"))[1])
        replicas = {r["replica"] for r in health["replicas"] if r["state"] == "up"}
        if len(replicas) == 2 and victim["replica"] not in replicas or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2 and victim["replica"] not in replicas, health
    for i in range(4):
        assert client.completions.create(model="tiny", prompt=PROMPTS[i % 3], max_tokens=4).usage.completion_tokens == 4


def test_dead_engine_fails_the_health_check_and_ray_replaces_the_replica(cluster):
    """The engine (not the actor) dies: LLMServer.check_health raises, Ray replaces that replica,
    /health shows it down meanwhile, and requests after it succeed."""
    def _die_on_next_step(engine):  # nested: Ray pickles it by value (the workers cannot import tests)
        """In the replica's engine thread (LLMServer.call): its next step raises; a request of
        its own makes that step happen."""
        def step():
            raise RuntimeError("injected engine failure")

        engine.step = step
        engine.add_request("poison", [1, 2, 3], jpaged.SamplingParams(max_tokens=1))

    health = json.loads(asyncio.run(_get(cluster + "/health"))[1])
    victim = health["replicas"][0]["replica"]
    handle = serve.get_deployment_handle("LLMServer", app_name="prefix")
    handle.call.remote(_die_on_next_step, target_replica=victim).result(timeout_s=60)
    deadline = time.monotonic() + 120
    states = []
    while time.monotonic() < deadline:
        health = json.loads(asyncio.run(_get(cluster + "/health"))[1])
        states.append({r["replica"]: r["state"] for r in health["replicas"]})
        up = {r for r, state in states[-1].items() if state == "up"}
        if len(up) == 2 and victim not in up:
            break
        time.sleep(0.5)
    print("replica states:", states[::max(1, len(states) // 6)])
    assert len(up) == 2 and victim not in up, states[-3:]
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0)
    for i in range(4):
        assert client.completions.create(model="tiny", prompt=PROMPTS[i % 3], max_tokens=4).usage.completion_tokens == 4
