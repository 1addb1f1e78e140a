"""`jpaged serve --data-parallel-size 2 --data-parallel-external-lb`: each replica answers on its own
port (a router such as llm-d's picks the replica), its /metrics, /health and KV events (by replay, each on its own port) its own, next
to the built-in front; a replica that is down answers 503 on its port while the front still serves."""

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
import zmq
from kv_event_consumers import llmd_positional
from test_kv_event_consumers import _replay
from test_kv_events import _free_port
from test_server import Server
from test_vllm_metrics import endpoint_picker, samples

from serving.cli import build_parser, serve_options

LIMITS = ["--max-num-seqs", "8", "--max-model-len", "128", "--max-num-batched-tokens", "64", "--enforce-eager"]


def test_the_flag_needs_replicas():
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "tiny", "--data-parallel-external-lb"])
    with pytest.raises(ValueError, match="--data-parallel-external-lb needs --data-parallel-size >= 2"):
        serve_options(args)
    args = parser.parse_args(["serve", "--model", "tiny", "--data-parallel-size", "2", "--data-parallel-external-lb"])
    assert serve_options(args)[1].data_parallel_external_lb


async def _request(method, url, body=None):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.request(method, url, json=body) as r:
            text = await r.text()
            return r.status, json.loads(text) if text.startswith("{") else text


def _replica_urls(server, count, timeout=60.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        urls = {int(line.split()[3]): line.split(" at ")[1].split("/v1")[0] for line in list(server.log)
                if line.startswith("jpaged: data-parallel replica ")}
        if len(urls) == count:
            return urls
        time.sleep(0.2)
    raise AssertionError("replica ports not announced:\n" + "".join(server.log))


def _tokens_generated(url) -> float:
    status, text = asyncio.run(_request("GET", url + "/metrics"))
    assert status == 200
    return sum(v for _, v, _ in samples(text).get("jpaged:generation_tokens_total", []))


def test_each_replica_serves_on_its_own_port():
    events_port, replay_port = _free_port(), _free_port()
    server = Server("--data-parallel-size", "2", "--data-parallel-external-lb", "--no-dp-restart",
                    "--enable-prefix-caching", "--kv-events-config",
                    json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}",
                                "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv@pod@tiny"}), *LIMITS)
    context = zmq.Context.instance()
    try:
        urls = _replica_urls(server, 2)
        assert len({server.url, *urls.values()}) == 3
        for rank, url in urls.items():
            status, health = asyncio.run(_request("GET", url + "/health"))
            assert status == 200 and [r["rank"] for r in health["replicas"]] == [rank], health
            before = {r: _tokens_generated(u) for r, u in urls.items()}
            prompt = [7 + rank] * 20 + list(range(30, 50))
            status, body = asyncio.run(_request("POST", url + "/v1/completions", {
                "model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}))
            assert status == 200, body
            after = {r: _tokens_generated(u) for r, u in urls.items()}
            assert after[rank] - before[rank] == 5 and after[1 - rank] == before[1 - rank]  # only that replica ran it
            read = endpoint_picker(asyncio.run(_request("GET", url + "/metrics"))[1])
            assert read["running"] == 0 and read["waiting"] == 0 and read["block_size"] == 16
            # vLLM's rule: replica r's replay endpoint is the configured port + r. Its batches (read
            # back from the start: the publisher thread sends in the background) carry its rank.
            deadline = time.monotonic() + 30
            while True:
                batches = [llmd_positional(p) for _, p in _replay(context, f"tcp://127.0.0.1:{replay_port + rank}", 0)]
                if any(e["type"] == "BlockStored" for b in batches for e in b.events):
                    break
                assert time.monotonic() < deadline, f"no BlockStored from replica {rank}"
                time.sleep(0.2)
            assert all(b.data_parallel_rank == rank for b in batches)
        # The front still routes; a replica killed (no restart) answers 503 on its own port.
        status, body = asyncio.run(_request("POST", server.url + "/v1/completions", {
            "model": "tiny", "prompt": "hello", "max_tokens": 2}))
        assert status == 200, body
        pid = asyncio.run(_request("GET", server.url + "/health"))[1]["replicas"][1]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while asyncio.run(_request("GET", urls[1] + "/health"))[0] != 503:
            assert time.monotonic() < deadline, "replica 1's port still healthy"
            time.sleep(0.2)
        status, body = asyncio.run(_request("POST", urls[1] + "/v1/completions", {
            "model": "tiny", "prompt": "hello", "max_tokens": 2}))
        assert status == 503 and "replica 1" in body["error"]["message"], body
        for url in (server.url, urls[0]):
            status, body = asyncio.run(_request("POST", url + "/v1/completions", {
                "model": "tiny", "prompt": "hello", "max_tokens": 2}))
            assert status == 200, body
    finally:
        assert server.stop() == 0
