"""A jpaged replica that spans hosts under Ray Serve: `num_processes=2` places the replica's two
processes (jax.distributed; tensor_parallel_size=4 over two CPU devices each) in a placement
group on two Ray nodes (a local two-node cluster, ray.cluster_utils, on loopback). Checked: the
processes run on distinct nodes (/health lists them), the openai SDK gets what one engine at
tensor_parallel_size=1 gives (greedy), and killing the follower process fails the replica's
health check, so Ray replaces the replica (both processes) and later requests succeed.
"""

import os
import signal
import time

import openai
import pytest
import ray
import requests
from ray import serve
from ray.cluster_utils import Cluster

import jpaged
from jpaged.ray import build_app
from test_ray_serve import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = {"model": "tiny", "num_processes": 2, "tensor_parallel_size": 4, "max_model_len": 128, "max_num_seqs": 4,
        "max_num_batched_tokens": 64, "enforce_eager": True, "disable_log_requests": True,
        "disable_log_stats": True, "health_check_period_s": 1, "ray_actor_options": {"num_cpus": 1}}
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59]]


@pytest.fixture(scope="module")
def app():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    port = _free_port()
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(ARGS), name="multihost", route_prefix="/")
        yield f"http://127.0.0.1:{port}", {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _completions(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in PROMPTS]


def _replica(url: str) -> dict:
    """The one replica as /health lists it, once its report names both processes."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        replicas = requests.get(url + "/health", timeout=30).json().get("replicas", [])
        if len(replicas) == 1 and len(replicas[0].get("processes", ())) == 2 and replicas[0]["state"] == "up":
            return replicas[0]
        time.sleep(1)
    raise AssertionError("the replica never reported its two processes")


def test_placement_group_per_process_and_bad_placements():
    """No cluster: the default group (one bundle per process, like the replica's resources, one
    per node) and the refusals, each naming its key."""
    built = build_app({**ARGS, "ray_actor_options": {"num_cpus": 2, "num_gpus": 1}})
    replica = built._bound_deployment.init_args[0]._bound_deployment  # OpenAIIngress.bind(llm_server, ...)
    options = replica._replica_config
    assert options.placement_group_bundles == [{"CPU": 2, "GPU": 1}] * 2
    assert options.placement_group_strategy == "STRICT_SPREAD"
    for args, named in [({**ARGS, "placement_group_bundles": [{"CPU": 1}]}, "placement_group_bundles"),
                        ({**ARGS, "coordinator_address": "10.0.0.1:1234"}, "coordinator_address"),
                        ({**ARGS, "process_id": 1}, "process_id")]:
        with pytest.raises(ValueError, match=named):
            build_app(args)


@pytest.mark.slow
def test_processes_on_two_nodes_answer_as_one_engine(app):
    url, nodes = app
    reference = jpaged.LLM("tiny", max_model_len=128, enforce_eager=True)
    expected = [o.outputs[0].text for o in reference.generate(
        PROMPTS, jpaged.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    assert _completions(url) == expected
    processes = _replica(url)["processes"]
    print("processes:", processes)
    assert [p["process_id"] for p in processes] == [0, 1]
    assert {p["node_id"] for p in processes} == nodes  # STRICT_SPREAD: one process per node


@pytest.mark.slow
def test_killed_follower_replaces_the_replica(app):
    url, _ = app
    before = _replica(url)
    follower = before["processes"][1]
    os.kill(follower["pid"], signal.SIGKILL)  # the two nodes are this machine
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # Ray's health check fails, it replaces the replica
        try:
            after = _replica(url)
        except (requests.RequestException, AssertionError):
            continue
        if after["replica"] != before["replica"]:
            break
        time.sleep(1)
    else:
        raise AssertionError("the replica was not replaced")
    assert after["processes"][1]["pid"] != follower["pid"]
    assert len(_completions(url)) == len(PROMPTS)
